"""Why the prefix cache evicts least-recently-released blocks first (LRU).

The reference engine demotes the most recently initialised block first; vLLM evicts the least
recently used. This drives our `BlockManager` alone (no model: the hit rate depends only on
the order of allocations and releases) through a serving-like workload under cache pressure
and reports the prefix-cache hit rate under each order, `lru` and `mru` (most recently
released first, the reference's behaviour).

Workload: system prompts of popularity following Zipf's law, each request one of them plus a
unique user turn and its generated tokens, a fixed number of requests in flight.

The result is a hit rate, deterministic for a seed: timing does not enter it, so there are no
repeats and no noisy rule; the wall time of each order is printed for information only. The
table and the markdown/JSON output use the shared `harness/`.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as H  # noqa: E402
from contbatch.cache import BlockManager  # noqa: E402


def run(eviction: str, args: argparse.Namespace) -> tuple[float, int]:
    rng = random.Random(args.seed)
    bs = args.block_size
    systems = [[rng.randrange(1000, 50000) for _ in range(args.system_blocks * bs)] for _ in range(args.num_systems)]
    weights = [1 / (rank + 1) ** args.zipf for rank in range(args.num_systems)]
    bm = BlockManager(args.num_blocks, bs, allow_block_sharing=True, eviction=eviction)
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
    parser = H.parser(__doc__)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--num-systems", type=int, default=32)
    parser.add_argument("--system-blocks", type=int, default=8)
    parser.add_argument("--tail-blocks", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=0, help="default: in-flight need + a third of the systems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2,000 requests")
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    parser.add_argument("--results-md", type=Path, help="record the markdown section here (e.g. benchmarks/RESULTS.md)")
    args = H.parse(parser)
    if args.quick and "--requests" not in sys.argv:
        args.requests = 2000
    if not args.num_blocks:
        args.num_blocks = args.in_flight * (args.system_blocks + args.tail_blocks) + args.num_systems * args.system_blocks // 3
    workload = (f"{args.requests} requests, {args.num_systems} system prompts (zipf {args.zipf}) of {args.system_blocks} "
                f"blocks + {args.tail_blocks} unique blocks, {args.in_flight} in flight, cache {args.num_blocks} blocks "
                f"of {args.block_size}, seed {args.seed}")
    print(workload)
    rows, body = {}, []
    for eviction in ("lru", "mru"):
        t = time.perf_counter()
        rate, evictions = run(eviction, args)
        rows[eviction] = {"hit_rate": rate, "evictions": evictions, "wall_s": time.perf_counter() - t}
        body.append([eviction, f"{rate:.1%}", f"{evictions:,}"])
    table = H.md_table(["eviction", "prefix hit rate", "evictions"], body)
    print(table)
    machine = H.machine_info()
    md = H.report_header("prefix-cache eviction order (`benchmarks/prefix_eviction.py`)", machine, None)
    md += [f"Block manager alone (deterministic: no timing, no repeats): {workload}.\n", table]
    report = {"benchmark": "prefix_eviction", "command": H.command_line(), "machine": machine, "workload": vars(args),
              "rows": rows}
    args.force_results = True  # nothing timed: a busy machine cannot change a hit rate
    H.write_outputs(args, report, "\n".join(md))


if __name__ == "__main__":
    main()
