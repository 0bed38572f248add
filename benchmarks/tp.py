"""Tensor parallelism on this machine: the same model at TP=1 and TP=2, throughput and the
communication each step costs.

The default model has 3 KV heads (TP=3 only), so this builds a small random-weight Llama with
2 KV heads (`--layers`, `--hidden`; the default tokenizer's vocabulary) unless `--model` names
a folder. Each system is a fresh set of processes started through `contbatch.distributed.spawn`
(TP=1: one process with every core; TP=2: two with half each; TP=1 on half the cores, what one
rank gets), in an order rotated each round, for
`--rounds` rounds; in each, rank 0 runs one untimed warm-up batch, then `--repeats` timed
batches of `--prompts` prompts x `--new-tokens` tokens (EOS ignored). On rank 0 the model's
collectives (the all-reduces of the row-wise layers, the all-gather of the logits) are timed
by wrapping DTensor's redistribution, and rank 0's own per-step broadcast of the batch is
timed directly. Greedy tokens of every system are compared with TP=1's.

What this machine can show: with two cores, TP=2 runs two one-thread processes instead of one
two-thread process, and adds the collectives; it is about fitting a model and cutting latency
on real accelerators with fast links, not speed here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness as H

_COMM = {"seconds": 0.0, "calls": 0}


def time_collectives() -> None:
    """Benchmark instrumentation (rank 0): time every collective the sharded model runs. The
    model's TP layers move tensors through DTensor's `redistribute_local_tensor` (the
    all-reduce after a row-wise layer, the all-gather of the logits); plain all-reduces go
    through torch.distributed. The time includes waiting for the slower rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import _redistribute

    def timed(fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _COMM["seconds"] += time.perf_counter() - t0
                _COMM["calls"] += 1
        return wrapper

    _redistribute.redistribute_local_tensor = timed(_redistribute.redistribute_local_tensor)
    dist.all_reduce = timed(dist.all_reduce)
    dist.all_gather_into_tensor = timed(dist.all_gather_into_tensor)


def build_model(out: Path, layers: int, hidden: int) -> None:
    """A random-weight Llama with 2 KV heads and the default tokenizer, saved to `out`."""
    tok = H.default_tokenizer()
    model = H.random_llama(seed=0, tokenizer=tok, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                           num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=2048, initializer_range=0.2)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def rank_main(args: argparse.Namespace) -> None:
    """One rank of one system: workers run rank 0's steps; rank 0 measures."""
    import random

    import torch
    import torch.distributed as dist

    from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, SamplingParams, load_model
    from contbatch.engine import run_worker

    tp = int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    model, _ = load_model(args.model, device=args.device, tp_plan="auto" if tp > 1 else None)
    if tp > 1 and dist.get_rank() != 0:
        run_worker(model)
        dist.destroy_process_group()
        return
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    if tp > 1:
        time_collectives()
    # The same linear kernels at every size (TP turns the CPU linear router off): only TP differs.
    config = ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens, cpu_kernel_overrides={"linear": "aten"})
    manager = ContinuousBatchingManager(model, None, config)
    runner = manager.core.runner
    manager.start()

    def batch():
        ids = manager.add_requests(prompts, sampling_params=params)
        return [manager.get_result(rid, timeout=600).generated_tokens for rid in ids]

    tokens = batch()  # warm-up
    times, steps0 = [], manager.stats()["steps"]
    send0 = (getattr(runner, "send_seconds", 0.0), getattr(runner, "sends", 0))
    comm0 = _COMM["seconds"]
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        batch()
        times.append(time.perf_counter() - t0)
    steps = manager.stats()["steps"] - steps0
    send_s = getattr(runner, "send_seconds", 0.0) - send0[0]
    comm = _COMM["seconds"] - comm0
    manager.stop()
    manager.destroy()
    Path(args.out).write_text(json.dumps({
        "tp": tp, "times": times, "tokens_per_batch": args.prompts * args.new_tokens, "steps": steps,
        "broadcast_s_per_step": send_s / max(steps, 1), "collective_s_per_step": comm / max(steps, 1),
        "first_tokens": tokens,
        "threads": torch.get_num_threads(),
    }))
    if tp > 1:
        dist.destroy_process_group()


def main() -> None:
    p = H.parser(__doc__, whole_doc=True)
    p.add_argument("--model", default=None, help="HF folder with 2 KV heads (default: a random small Llama)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (each rank on cuda:LOCAL_RANK; NCCL)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None, help="write the JSON summary here")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = H.parse(p)
    if args.rank:
        return rank_main(args)

    from contbatch.distributed import spawn

    tmp = Path(tempfile.mkdtemp(prefix="contbatch-tp-"))
    if args.model is None:
        args.model = str(tmp / "model")
        build_model(Path(args.model), args.layers, args.hidden)
    cores = os.cpu_count() or 1
    # (label, ranks, threads per rank): every core for one process, the same cores split over
    # two ranks, and one process on one thread (what each TP rank gets here).
    systems = [("tp1", 1, cores), ("tp2", 2, max(1, cores // 2))]
    if args.device == "cpu" and cores // 2 != cores:
        systems.append(("tp1-half", 1, max(1, cores // 2)))
    load = H.LoadRange()
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in systems}
    for r, (name, ranks, threads) in H.rounds(systems, args.rounds):  # the order rotated each round
        out = tmp / f"{name}-{r}.json"
        cmd = [sys.executable, __file__, "--rank", "--model", args.model, "--out", str(out),
               *(f"--{k}={getattr(args, k.replace('-', '_'))}" for k in
                 ("prompts", "prompt-len", "new-tokens", "max-batch-tokens", "repeats", "device"))]
        status = spawn(ranks, cmd, timeout=args.timeout, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        if status != 0:
            sys.exit(f"{name} run failed with status {status}")
        runs[name].append(json.loads(out.read_text()))
        load.sample()
    rate = {name: [r["tokens_per_batch"] / t for r in rs for t in r["times"]] for name, rs in runs.items()}
    same = all(r["first_tokens"] == runs["tp1"][0]["first_tokens"] for rs in runs.values() for r in rs)
    summary = {"load_1min": load.values, "tokens_equal": same,
               "model": args.model, "args": {k: v for k, v in vars(args).items() if k != "rank"}}
    rows = []
    for name, ranks, threads in systems:
        rs = runs[name]
        bc = [r["broadcast_s_per_step"] * 1e3 for r in rs]
        coll = [r["collective_s_per_step"] * 1e3 for r in rs]
        step = [t * 1e3 / (r["steps"] / len(r["times"])) for r in rs for t in r["times"]]
        summary[name] = {"ranks": ranks, "threads_per_rank": threads, "tok_s": rate[name], "step_ms": step,
                         "broadcast_ms_per_step": bc, "collective_ms_per_step": coll}
        rows.append([f"TP={ranks}, {threads} thread{'s' * (threads > 1)} per rank", H.Spread.of(rate[name]).fmt(),
                     H.Spread.of(step).fmt(), H.Spread.of(bc).fmt() if ranks > 1 else "-",
                     H.Spread.of(coll).fmt() if ranks > 1 else "-"])
    ratios = {name: statistics.median(rate["tp2"]) / statistics.median(rate[name]) for name in runs if name != "tp2"}
    print(f"# TP benchmark: {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens each, "
          f"{args.rounds} rounds x {args.repeats} batches, model {args.model}; {load.line()}")
    print(H.md_table(["system", "tokens/s", "ms per step", "rank 0 batch broadcast, ms/step",
                      "model collectives on rank 0, ms/step"], rows, [False] * 5))
    print("TP=2 throughput / " + ", ".join(f"{name}: {v:.2f}x" for name, v in ratios.items())
          + f"; greedy tokens equal everywhere: {same}")
    summary["tp2_throughput_ratio"] = ratios
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
