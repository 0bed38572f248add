"""The CPU kernels, as one subsystem.

- `native.py` builds and loads our C++ library (`csrc/`) into `torch.ops.contbatch_cpu`;
- `ops.py` wraps every op of that library: nothing else calls `torch.ops.contbatch_cpu`;
- `linear_kernels.py` holds the linear kernels that are not ours (oneDNN, plain or prepacked,
  and the float32 product of 16-bit weights) and their custom ops for compiled steps;
- `probe.py` times the linear kernels and keeps the timings per machine (`load.py`: whether
  other processes kept the CPUs busy meanwhile, when they are not kept);
- `routers/` put the kernels on a model's modules inside engine steps, for a manager's life;
- `plan.py` decides all of it once per model (`plan_cpu` gives one `CpuPlan`) from the user's
  knobs (`knobs.py`: `cpu_kernels` and `cpu_kernel_overrides`).

Nothing here imports the engine, the attention backends, the cache or the config: those
import this package. Importing it builds nothing.
"""
