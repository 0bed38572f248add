"""Why the prefix cache evicts least-recently-released blocks first (LRU).

The reference engine demotes the most recently initialised block first; vLLM evicts the least
recently used. This drives our `BlockManager` alone (no model: the hit rate depends only on
the order of allocations and releases) through a serving-like workload under cache pressure
and reports the prefix-cache hit rate under each order, `lru` and `mru` (most recently
released first, the reference's behaviour).

Workload: system prompts of popularity following Zipf's law, each request one of them plus a
unique user turn and its generated tokens, a fixed number of requests in flight.
"""

from __future__ import annotations

import argparse
import random
from collections import deque

from contbatch.cache import BlockManager


def run(eviction: str, args: argparse.Namespace) -> tuple[float, int]:
    rng = random.Random(args.seed)
    bs = args.block_size
    systems = [[rng.randrange(1000, 50000) for _ in range(args.system_blocks * bs)] for _ in range(args.num_systems)]
    weights = [1 / (rank + 1) ** args.zipf for rank in range(args.num_systems)]
    bm = BlockManager(args.num_blocks, bs, enable_prefix_sharing=True, eviction=eviction)
    live: deque[str] = deque()
    for i in range(args.requests):
        system = rng.choices(systems, weights)[0]
        tokens = system + [rng.randrange(1000, 50000) for _ in range(args.tail_blocks * bs)]
        rid = f"r{i}"
        bm.match_prefix(rid, tokens)
        while not bm.ensure(rid, len(tokens)):  # make room: finish the oldest in flight
            bm.free(live.popleft())
        bm.commit(rid, tokens, len(tokens))
        live.append(rid)
        if len(live) > args.in_flight:
            bm.free(live.popleft())
    return bm.prefix_hits / max(1, bm.prefix_queries), bm.evictions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--num-systems", type=int, default=32)
    parser.add_argument("--system-blocks", type=int, default=8)
    parser.add_argument("--tail-blocks", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=0, help="default: in-flight need + a third of the systems")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.num_blocks:
        args.num_blocks = args.in_flight * (args.system_blocks + args.tail_blocks) + args.num_systems * args.system_blocks // 3
    print(f"{args.requests} requests, {args.num_systems} system prompts (zipf {args.zipf}) of {args.system_blocks} blocks "
          f"+ {args.tail_blocks} unique blocks, {args.in_flight} in flight, cache {args.num_blocks} blocks of {args.block_size}")
    print("| eviction | prefix hit rate | evictions |\n|---|---|---|")
    for eviction in ("lru", "mru"):
        rate, evictions = run(eviction, args)
        print(f"| {eviction} | {rate:.1%} | {evictions} |")


if __name__ == "__main__":
    main()
