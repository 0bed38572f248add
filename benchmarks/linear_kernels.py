"""CPU linear kernels at few rows: how fast each reads its weight from memory.

A decode step of one to seven requests is bound by reading every weight once. For each of
the default model's weight shapes (or `--shapes`), each row count and each dtype, this times
PyTorch's `F.linear` (MKL's sgemm in float32, oneDNN in bfloat16), oneDNN's
`_linear_pointwise` (where it runs the dtype: not bfloat16 on AVX2-only CPUs), our
`contbatch_cpu::small_linear` (1-7 rows) and, in bfloat16 and float16, the float32 product `upcast` (for
CPUs without a bfloat16 GEMM; try `--rows 1,8,64,512`), each call on a different copy of
the weight cut from `--pool-mb` of memory (as a forward reads them: timing one weight over and
over measures the cache instead, and chose the wrong kernel), best of `--repeats` passes, and
prints GB/s of weight read (at batch sizes, GB/s x rows x 1e9 / 2 is the FLOP rate), with the
largest error of ours against float64.

    python benchmarks/linear_kernels.py [--rows 1,2,4,7] [--dtypes float32,bfloat16] [--pool-mb 256]
"""

from __future__ import annotations

import time

import torch

import harness as H
from contbatch.cpu import native
from contbatch.cpu.linear_kernels import available_kernels, onednn_linear, upcast_linear
from contbatch.cpu.ops import small_linear

DEFAULT_SHAPES = "1536x576,576x1536,576x576,192x576,49152x576"  # SmolLM2-135M: MLP, attention, LM head


def best_seconds(fn, weights: list[torch.Tensor], x: torch.Tensor, repeats: int) -> float:
    fn(x, weights[0], None)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(x, w, None)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def main() -> None:
    p = H.parser(__doc__)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of OUTxIN")
    p.add_argument("--rows", default="1,2,4,7")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--pool-mb", type=int, default=256, help="memory the weight copies are cut from")
    p.add_argument("--repeats", type=int, default=5)
    args = H.parse(p)
    print(f"threads {torch.get_num_threads()}; C++ kernels: {native.load()[1]}")
    kernels = {"aten": lambda x, w, b: torch.nn.functional.linear(x, w, b), "onednn": onednn_linear,
               "small_linear": small_linear, "upcast": upcast_linear}  # named as cpu/knobs.py names them
    table = H.Table(["dtype", "rows", "weight", *[f"{k} GB/s" for k in kernels], "max error vs float64 (small_linear)"],
                    [False, True, False, *[True] * len(kernels), True])
    with torch.inference_mode():
        for dtype in map(H.dtype_of, H.comma_list(args.dtypes)):
            size = torch.tensor([], dtype=dtype).element_size()
            for rows in H.comma_list(args.rows, int):
                for shape in H.comma_list(args.shapes):
                    out_f, in_f = map(int, shape.split("x"))
                    copies = max(1, (args.pool_mb << 20) // (out_f * in_f * size))
                    pool = (torch.rand(copies * out_f * in_f) - 0.5).to(dtype)
                    weights = [pool[i * out_f * in_f:(i + 1) * out_f * in_f].view(out_f, in_f) for i in range(copies)]
                    x = (torch.rand(rows, in_f) - 0.5).to(dtype)
                    gb = out_f * in_f * size / 1e9
                    can = available_kernels(dtype, rows)
                    rates = [gb / best_seconds(fn, weights, x, args.repeats) if k in can else None
                             for k, fn in kernels.items()]
                    err = "-"
                    if "small_linear" in can:
                        exact = torch.nn.functional.linear(x.double(), weights[0].double())
                        err = f"{(small_linear(x, weights[0], None).double() - exact).abs().max().item():.1e}"
                    table.row(str(dtype)[6:], rows, shape,
                              *[None if r is None else f"{r:.1f}" if r >= 1 else f"{r:.3f}" for r in rates], err)
                    del pool, weights


if __name__ == "__main__":
    main()
