"""Hardware ceilings measured in the run: the floors a benchmark's figures are read against.

- `matmul_rate(dtype)`: GFLOP/s of a large square product, the fastest of the kernels at hand;
  the *matmul floor* of a workload is 2 x non-embedding params x tokens / that rate.
- `weight_read_bandwidth(model)`: GB/s of reading every parameter once, as a lone decode step
  must, by the fastest of several readers; the *weight-read floor* of one stream is weight
  bytes / that bandwidth per token.

These machines' GEMM rate and memory bandwidth drift by up to 2x within minutes, so benchmarks
measure them again between their timed runs (`ceiling_probe`: `offline.py`, `serve.py`) rather
than once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from .running import Sample

CEILING = "ceiling probe"  # a pseudo-system: the hardware ceiling, re-measured in every round


def ceiling_probe(measure: Callable[[], float], unit: str) -> Callable[[], Sample]:
    """The ceiling as a system of the interleaved rounds (its reading as `tok_s`, over a wall of
    1 s): the machine's memory bandwidth and GEMM rate drift within minutes, so a floor measured
    once at the start misreads every later run. Fractions of the floor use the median of the
    readings taken between the runs."""
    return lambda: Sample(1.0, measure(), extra={"unit": unit})


def matmul_rate(dtype, n: int = 2048, seconds: float = 1.0) -> float:
    """GFLOP/s of a large square [n x n] @ [n x n] matmul at `dtype`: the best of a timed loop,
    and the best of PyTorch's own kernel, oneDNN's and (bfloat16) the product in float32: the
    machine's ceiling is the fastest (in float32 on AMD CPUs MKL, which `@` calls, runs at about
    half oneDNN's rate). A kernel whose first call outlasts `seconds` is not timed further
    (PyTorch's bfloat16 `@` took ~60 s at 2048^3 on an AVX2-only EPYC)."""
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    kernels = [lambda: a @ b]
    from contbatch.cpu.linear_kernels import onednn_available

    if dtype == torch.bfloat16:  # without a bfloat16 GEMM (AVX2-only EPYC: ~0.3 GFLOP/s here), float32 is the
        kernels.append(lambda: a.float() @ b.float())  # fastest bfloat16 product, as the engine's upcast kernel runs it
    if onednn_available(dtype):  # not every CPU runs oneDNN's bfloat16 linear (AVX2-only EPYCs do not)
        bt = b.t().contiguous()
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, bt, None, "none", [], ""))
    best = math.inf
    for kernel in kernels:
        t = time.perf_counter()
        kernel()
        if time.perf_counter() - t > seconds:
            best = min(best, time.perf_counter() - t)
            continue
        kernel()
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            t = time.perf_counter()
            kernel()
            best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def weight_read_bandwidth(model, repeats: int = 5) -> tuple[float, int, str]:
    """(GB/s, bytes, how): the best time to read every parameter once, as a decode step at
    batch 1 must, by the fastest of several readers (as `matmul_rate` takes the fastest
    GEMM): a sum over each parameter, and a one-row product against each 2-D weight (the
    GEMV a lone decode step runs) through PyTorch's kernel, oneDNN's and contbatch's few-row
    kernel where they run; 1-D parameters are summed. On the 2-core EPYC the sum and our
    kernel read within a few percent of each other in the same run, either one ahead: the
    floor is the faster, so it never rests on a slow reader. Tied weights are counted once
    (`parameters()` deduplicates them)."""
    import torch

    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    mats = [p for p in params if p.dim() == 2]
    vecs = [p for p in params if p.dim() != 2]
    rows = {p.shape[1]: torch.randn(1, p.shape[1]).to(p.dtype) for p in mats}
    readers = {"sum": lambda p: p.sum(), "aten GEMV": lambda p: torch.nn.functional.linear(rows[p.shape[1]], p)}
    from contbatch.cpu import native
    from contbatch.cpu.linear_kernels import onednn_available

    if onednn_available(params[0].dtype):
        readers["oneDNN GEMV"] = lambda p: torch.ops.mkldnn._linear_pointwise(rows[p.shape[1]], p, None, "none", [], "")
    if native.load()[0]:
        readers["contbatch GEMV"] = lambda p: torch.ops.contbatch_cpu.small_linear(rows[p.shape[1]], p, None)
    best, how = math.inf, ""
    with torch.inference_mode():
        for name, read in readers.items():
            for _ in range(repeats):
                t = time.perf_counter()
                for p in mats:
                    read(p)
                for p in vecs:
                    p.sum()
                took = time.perf_counter() - t
                if took < best:
                    best, how = took, name
                elif took > 4 * best:  # a slow reader here (a bfloat16 GEMV without a bfloat16 kernel)
                    break
    return nbytes / best / 1e9, nbytes, how


def non_embedding_params(model) -> int:
    emb = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    return total - emb.numel()
