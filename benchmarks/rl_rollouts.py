"""RL rollouts on the default model: what a weight update costs, and what logprobs cost.

Two measurements, in one process on a quiet machine:
- update: `manager.update_weights(state_dict)` with the full state dict (every tensor copied,
  the version bumped, the prefix cache dropped), timed from the call to its return (pause to
  resume), with requests in flight (`inflight="recompute"`) and without;
- rollouts: n=4 samples per prompt at temperature 1, a fixed token budget, with
  `return_logprobs=True` against without, interleaved and repeated (medians with spread).

    .venv/bin/python benchmarks/rl_rollouts.py --repeats 3 --results-md benchmarks/RESULTS.md
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness as H  # noqa: E402
from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, SamplingParams  # noqa: E402


def rollouts(model, prompts, new_tokens: int, logprobs: bool) -> H.Sample:
    config = ContinuousBatchingConfig(return_logprobs=logprobs, max_prompt_length=max(map(len, prompts)),
                                      max_generated_length=new_tokens)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    manager = ContinuousBatchingManager(model, GenerationConfig(eos_token_id=None), config)
    start = time.perf_counter()
    manager.start()
    try:
        outs = [manager.get_result(r, timeout=None) for r in manager.add_requests(prompts, sampling_params=params)]
    finally:
        manager.stop(timeout=60)
    wall = time.perf_counter() - start
    samples = [s for o in outs for s in o.samples]
    assert all((s.logprobs is not None) == logprobs for s in samples)
    return H.Sample(wall, sum(len(s.generated_tokens) for s in samples))


def update_seconds(model, prompts, repeats: int, inflight: bool) -> list[float]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    manager = ContinuousBatchingManager(model, GenerationConfig(eos_token_id=None), ContinuousBatchingConfig())
    manager.start()
    times = []
    try:
        for _ in range(repeats):
            ids = manager.add_requests(prompts, max_new_tokens=64) if inflight else []
            if inflight:
                time.sleep(1.0)  # prompts prefilled, decoding under way
            start = time.perf_counter()
            manager.update_weights(state, inflight="recompute")
            times.append(time.perf_counter() - start)
            for rid in ids:
                manager.get_result(rid, timeout=None)
    finally:
        manager.stop(timeout=60)
    return times


def main() -> None:
    p = H.parser(__doc__)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    H.add_model_args(p)
    H.add_common_args(p)
    args = H.parse(p)
    torch.manual_seed(0)
    model, tok = H.load(args.model, args.dtype)
    ids = tok(H.source_text()[:40000])["input_ids"]
    prompts = [ids[i * 40 : i * 40 + 32 + (i % 4) * 8] for i in range(args.prompts)]
    machine = H.machine_info()
    monitor = H.LoadMonitor(threshold=args.noise_threshold).start()
    idle = H.in_worker(lambda: update_seconds(model, prompts[:4], args.repeats, inflight=False))
    busy = H.in_worker(lambda: update_seconds(model, prompts, args.repeats, inflight=True))
    runs = H.run_interleaved({"logprobs off": lambda: rollouts(model, prompts, args.new_tokens, False),
                              "logprobs on": lambda: rollouts(model, prompts, args.new_tokens, True)},
                             args.repeats, warmup=not args.no_warmup, between=H.cleanup)
    load = monitor.stop()
    off, on = (H.Spread.of([s.tok_s for s in runs[k]]) for k in ("logprobs off", "logprobs on"))
    params = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    rows = [["update_weights, idle engine (s)", H.Spread.of(idle).fmt(".3f")],
            [f"update_weights, {args.prompts} requests decoding, recompute (s)", H.Spread.of(busy).fmt(".3f")],
            ["rollout tok/s, logprobs off", off.fmt()], ["rollout tok/s, logprobs on", on.fmt()],
            ["logprobs on / off", H.fmt_ratio(H.ratio(on, off))]]
    md = "\n".join(H.report_header(f"RL rollouts ({args.dtype}, {params / 2**20:.0f} MiB of weights, "
                                   f"{args.prompts} prompts x 4 samples x {args.new_tokens} tokens)", machine, load)
                   + [H.md_table(["measure", "median [min, max]"], rows)])
    print(md)
    H.write_outputs(args, {"load": load, "idle_s": idle, "busy_s": busy,
                           "off": off.as_dict(), "on": on.as_dict()}, md)


if __name__ == "__main__":
    main()
