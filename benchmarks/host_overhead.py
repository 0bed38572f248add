"""Host time per engine step, outside the model's forward: what async batching must hide.

On a GPU a decode step of a ~1B model at batch 64 takes about half a millisecond of device
time (its weights, ~2 GB, over ~4 TB/s), so the host work of a step (scheduling, building
and padding the batch, sampling bookkeeping, applying tokens) must stay below that for the
GPU never to wait. This measures that host work on the CPU with the GPU layout (`reference`
backend, async batching) and a one-layer model, as engine-thread CPU time per step minus
the forward's, for several batch sizes (`--backend torch` measures the CPU backend's own
per-step planning too). Run on a quiet machine; it prints a Markdown table.

    .venv/bin/python benchmarks/host_overhead.py --batches 16 64 256 --new-tokens 100
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness as H  # noqa: E402
from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager  # noqa: E402
from contbatch.cpu import native  # noqa: E402
from contbatch.runtime import core, step_runner  # noqa: E402
from contbatch.scheduling import scheduler  # noqa: E402

PHASES = {
    "step": (core.EngineCore, "step"),
    "schedule": (scheduler.Scheduler, "schedule"),
    "build": (core, "build_step_batch"),
    "launch": (step_runner.StepRunner, "launch"),
    "forward": (step_runner.StepRunner, "_forward"),
    "sample": (step_runner.StepRunner, "sample"),
    "apply": (core.EngineCore, "_apply"),
}


def instrument(totals: dict[str, float]) -> None:
    """Wrap each phase to add its engine-thread CPU time (not wall time: the machine is noisy)."""
    for name, (owner, attr) in PHASES.items():
        inner = getattr(owner, attr)

        def timed(*args, _inner=inner, _name=name, **kwargs):
            start = time.thread_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                totals[_name] = totals.get(_name, 0.0) + time.thread_time() - start

        setattr(owner, attr, timed)


def tiny_model() -> torch.nn.Module:
    """One layer, 32 hidden units: the forward costs next to nothing, the host work stands out."""
    return H.random_llama(seed=0, vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)


def measure(model, batch: int, new_tokens: int, totals: dict[str, float], backend: str = "reference",
            cpu_kernels: str = "off") -> dict[str, float]:
    totals.clear()
    prompts = [[(7 * i + j) % 500 + 1 for j in range(16)] for i in range(batch)]
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    # cpu_kernels="off": PyTorch's own ops, so a fresh machine (the GPU check's) builds no C++ kernels.
    config = ContinuousBatchingConfig(block_size=16, attention_backend=backend, use_async_batching=backend != "torch",
                                      cpu_kernels=cpu_kernels)
    manager = ContinuousBatchingManager(model, gc, config)
    manager.start()
    for rid in manager.add_requests(prompts):
        manager.get_result(rid, timeout=600)
    steps_run = manager.stats()["steps"]
    manager.stop()
    per_step = {k: v / steps_run * 1e3 for k, v in totals.items()}
    per_step["host"] = per_step["step"] - per_step["forward"]
    return per_step


def main() -> None:
    p = H.parser(__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--new-tokens", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3, help="best of N runs per batch size")
    p.add_argument("--backend", default="reference", choices=["reference", "torch"])
    p.add_argument("--cpu-kernels", default="off", choices=["off", "auto"],
                   help="our C++ CPU kernels (auto builds them on first use); off: PyTorch's ops")
    args = H.parse(p)
    if args.cpu_kernels == "off":  # nothing built: the sampler's argmax and cache writes take PyTorch's ops too
        native.disable("host_overhead.py --cpu-kernels off")
    torch.set_num_threads(1)
    totals: dict[str, float] = {}
    instrument(totals)
    model = tiny_model()
    measure(model, 8, 4, totals, args.backend, args.cpu_kernels)  # warm-up
    load = H.LoadRange()
    print(f"load average (1 min) {load.values[0]:.2f} before; CPU ms per step (best of {args.repeats})")
    table = H.Table(["requests", "host", "schedule", "build", "launch", "sample", "apply", "forward"])
    for batch in args.batches:
        runs = (measure(model, batch, args.new_tokens, totals, args.backend, args.cpu_kernels)
                for _ in range(args.repeats))
        best = min(runs, key=lambda r: r["host"])
        launch_only = best["launch"] - best["forward"]
        row = [best["host"], best["schedule"], best["build"], launch_only, best["sample"], best["apply"], best["forward"]]
        table.row(batch, *[f"{v:.2f}" for v in row])
    print("launch excludes the forward; host = step - forward (build is part of host, not of launch)")


if __name__ == "__main__":
    main()
