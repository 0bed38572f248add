"""The C++ CPU decode attention (`csrc/paged_decode_cpu.cpp`) of two source trees, interleaved.

Decode rows of R requests with C keys each (SmolLM2's 9 query / 3 KV heads of 64 dims, blocks
of 256 scattered at random in the cache), one call per layer, cycling through as many layers'
caches as fill ~300 MB so that keys and values come from memory as in a real step, not from
the cache. Each tree runs in its own fresh process (it builds its own library), the trees
alternate `--repeats` rounds; each row reports the median microseconds per call (its best
round) and the GB/s of K/V read, next to a plain `sum` over 73 MB in the same process.

    git worktree add /tmp/before <commit>
    python benchmarks/decode_attention.py before=/tmp/before after=. --repeats 3
"""

from __future__ import annotations

import json

import harness as H

CHILD = r'''
import json, sys, time, torch
from contbatch.cpu import native
assert native.load()[0], native.load()[1]
torch.manual_seed(0)
out = {}
big = torch.rand(73 * 2**20 // 4)
ts = []
for _ in range(20):
    t = time.perf_counter(); big.sum(); ts.append(time.perf_counter() - t)
out["sum GB/s"] = big.numel() * 4 / min(ts) / 1e9
for rows, ctx, dtype in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    heads, kvh, dim, bs = 9, 3, 64, 256
    width = (ctx + bs - 1) // bs
    nblocks = rows * width + 2
    layers = max(1, min(30, int(300e6 // (nblocks * bs * kvh * dim * 8))))
    ks = [torch.randn(kvh, nblocks * bs, dim).to(dtype) for _ in range(layers)]
    vs = [torch.randn(kvh, nblocks * bs, dim).to(dtype) for _ in range(layers)]
    table = torch.randperm(nblocks)[: rows * width].view(rows, width).int().contiguous()
    lens = torch.full((rows,), ctx, dtype=torch.int32)
    q = torch.randn(rows, heads, dim).to(dtype)
    empty = torch.empty(0)
    call = lambda i: torch.ops.contbatch_cpu.paged_decode(q, ks[i % layers], vs[i % layers], table, lens, empty, bs,
                                                          0.125, 0, 0.0)
    for i in range(layers):
        call(i)
    ts = []
    for i in range(3 * layers):
        t = time.perf_counter(); call(i); ts.append(time.perf_counter() - t)
    t = sorted(ts)[len(ts) // 2]
    nbytes = rows * ctx * kvh * dim * 2 * torch.tensor([], dtype=dtype).element_size()
    out[f"{rows}x{ctx} {str(dtype)[6:]}"] = [t * 1e6, nbytes / t / 1e9]
print("RESULT " + json.dumps(out))
'''

CASES = [(1, 300, "float32"), (1, 2000, "float32"), (48, 140, "float32"), (48, 1000, "float32"),
         (8, 2000, "float32"), (48, 140, "bfloat16"), (48, 1000, "bfloat16")]


def main() -> None:
    p = H.parser(__doc__, whole_doc=True)
    p.add_argument("trees", nargs="+", help="name=path of a contbatch source tree")
    p.add_argument("--repeats", type=int, default=3)
    args = H.parse(p)
    trees = H.parse_named(args.trees)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    load = H.LoadRange()
    for _ in range(args.repeats):
        for name, path in trees.items():
            runs[name].append(H.run_child(CHILD, [json.dumps(CASES)], tree=path))
            load.sample()
    cases = [k for k in runs[next(iter(trees))][0] if k != "sum GB/s"]
    rows = [[case] + [f"{min(r[case][0] for r in runs[n]):.0f} [{max(r[case][1] for r in runs[n]):.1f}]" for n in trees]
            for case in cases]
    print(f"{args.repeats} rounds, {load.line()}")
    print(H.md_table(["case (requests x keys, dtype)"] + [f"{n} us [GB/s]" for n in trees], rows))
    sums = {n: max(r["sum GB/s"] for r in runs[n]) for n in trees}
    print("plain sum over 73 MB, best GB/s: " + ", ".join(f"{n} {v:.1f}" for n, v in sums.items()))


if __name__ == "__main__":
    main()
