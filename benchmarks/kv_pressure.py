"""Prefix caching and KV pressure, end to end on the default model.

(a) Many requests sharing one long system prompt, prefix cache on vs off: throughput and mean
    time to first token. (b) Long generations in a small cache: CPU offload vs soft reset vs
    ample memory: throughput and the number of offloads, restores and soft resets.
Both sides of each comparison run in the same process, back to back, on the same prompts.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
from transformers import GenerationConfig

import contbatch


def run(model, prompts, new_tokens: int, config: contbatch.ContinuousBatchingConfig) -> dict:
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    start = time.perf_counter()
    with contbatch.continuous_batching(model, gen, config) as manager:
        ids = manager.add_requests(prompts)
        outs = [manager.get_result(rid) for rid in ids]
        stats = manager.stats()
    wall = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outs)
    ttft = sum(o.first_token_at - o.queued_at for o in outs) / len(outs)
    return {"wall_s": wall, "tok_s": tokens / wall, "mean_ttft_s": ttft, "outputs": [o.generated_tokens for o in outs],
            **{k: stats[k] for k in ("prefix_cache_hits", "prefix_cache_queries", "offloads", "restores", "soft_resets")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared-requests", type=int, default=200)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--shared-new-tokens", type=int, default=16)
    parser.add_argument("--pressure-requests", type=int, default=16)
    parser.add_argument("--pressure-new-tokens", type=int, default=256)
    parser.add_argument("--pressure-blocks", type=int, default=48, help="cache for (b), in blocks of 16 tokens")
    parser.add_argument("--only", default="a,b")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} (numbers are only comparable within one run)")
    model, _ = contbatch.load_model()
    rng = random.Random(0)
    vocab = model.config.vocab_size

    if "a" in args.only:
        system = [rng.randrange(100, vocab) for _ in range(args.system_tokens)]
        prompts = [system + [rng.randrange(100, vocab) for _ in range(rng.randint(8, 32))]
                   for _ in range(args.shared_requests)]
        print(f"\n(a) {len(prompts)} requests sharing a {args.system_tokens}-token system prompt, "
              f"{args.shared_new_tokens} new tokens each, block_size 16")
        print("| prefix cache | wall s | output tok/s | mean TTFT s | hit rate |\n|---|---:|---:|---:|---:|")
        rows = {}
        for sharing in (False, True):
            config = contbatch.ContinuousBatchingConfig(block_size=16, allow_block_sharing=sharing)
            r = rows[sharing] = run(model, prompts, args.shared_new_tokens, config)
            rate = r["prefix_cache_hits"] / max(1, r["prefix_cache_queries"])
            print(f"| {'on' if sharing else 'off'} | {r['wall_s']:.1f} | {r['tok_s']:.1f} | {r['mean_ttft_s']:.2f} | {rate:.1%} |")
        print(f"identical outputs: {rows[True]['outputs'] == rows[False]['outputs']}")

    if "b" in args.only:
        prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 96))] for _ in range(args.pressure_requests)]
        print(f"\n(b) {len(prompts)} requests of 32..96 prompt tokens, {args.pressure_new_tokens} new tokens each, "
              f"block_size 16")
        print("| memory | wall s | output tok/s | offloads | restores | soft resets |\n|---|---:|---:|---:|---:|---:|")
        rows = {}
        cases = {
            "ample": dict(num_blocks=None),
            f"{args.pressure_blocks} blocks, soft reset": dict(num_blocks=args.pressure_blocks),
            f"{args.pressure_blocks} blocks, CPU offload": dict(num_blocks=args.pressure_blocks, cpu_offload_space=1.0),
        }
        for name, extra in cases.items():
            config = contbatch.ContinuousBatchingConfig(block_size=16, safety_margin=0.0, allow_block_sharing=False, **extra)
            r = rows[name] = run(model, prompts, args.pressure_new_tokens, config)
            print(f"| {name} | {r['wall_s']:.1f} | {r['tok_s']:.1f} | {r['offloads']} | {r['restores']} | {r['soft_resets']} |")
        outs = [r["outputs"] for r in rows.values()]
        print(f"identical outputs: {all(o == outs[0] for o in outs)}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
