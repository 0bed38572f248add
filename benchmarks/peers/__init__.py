"""The strong peers of the benchmarks: vLLM's CPU engine and llama.cpp's server.

Each lives outside the project's own virtualenv (vLLM pins its own stack; llama.cpp is a
native build), under one work folder (`paths.work_dir()`), set up by `setup_peers.py`
(`make bench-peers`) from the package registries:

- `paths`: where each peer, its build and the shared model files live (a leaf).
- `setup_peers`: the idempotent set-up steps; `python benchmarks/peers/setup_peers.py`.
- `models`: the model folders every system loads (the default model's float weights, a
  0.5B-class model of Qwen2.5-0.5B's shape with random weights) and their GGUF files.
- `vllm_worker` / `vllm_offline`: vLLM's `LLM.generate` in a fresh process of its venv, and
  the offline benchmark's client of it.
- `servers`: start and stop `vllm serve`, `llama-server` and `contbatch serve` with given knobs.
- `knobs`: each peer's documented small sweep of its own knobs.
- `serve_sweep`: a launched server's knobs swept by measurement (`serve.py --sweep`).
- `ttft`: the shared-system-prompt TTFT workload (`serve.py --workload ttft-prefix`).
"""
