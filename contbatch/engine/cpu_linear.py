"""Float32 linear layers on oneDNN during engine steps, where the machine says it is faster.

PyTorch's CPU `F.linear` in float32 calls MKL's sgemm. On AMD EPYC machines MKL takes a slow
code path: on the 2-core EPYC these machines use, a 64x576x1536 product ran at ~160 GFLOP/s
through MKL and ~330 through oneDNN (`torch.ops.mkldnn._linear_pointwise`, the kernel PyTorch
already uses for bfloat16), and the tied 49152-row LM head of the default model at one row
ran 8 vs 22 GFLOP/s. On other CPUs MKL may win. So at start-up the engine times both kernels
on each distinct weight shape of the model, at one row (a lone request decoding), at four
rows and at a batch of rows, and routes a layer's calls to oneDNN only where it won by a clear margin.

Only calls made inside an engine step are routed (`ops.in_step()`, set on the engine thread
around each forward): the user's own forward, backward or `model.generate` on the same model
runs the unmodified `nn.Linear.forward`. Only plain `nn.Linear` modules with float32 CPU
weights are touched, and only those with no forward of their own already patched in (hooks,
adapters). The change is rounding only (a different summation order); greedy tokens are
checked against `model.generate` in the test suite like every kernel choice.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass

import torch

from ..attention import ops

KERNELS = ("auto", "aten", "onednn")
# Three regimes, each with its own verdict per weight shape: one row (a lone request decoding),
# a few rows (a handful of requests, or a speculative verification run: MKL's sgemm ran 2-4x
# slower at 2-8 rows than at one on the EPYC, where oneDNN barely changed), and a batch.
PROBE_ROWS = (1, 4, 64)
FEW_ROWS = 16  # calls with 2 .. FEW_ROWS - 1 rows take the 4-row verdict; more, the 64-row one
WIN_MARGIN = 1.1  # oneDNN must be this much faster to be chosen: noise must not flip kernels
_probe_cache: dict[tuple, tuple[float, float]] = {}


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def _seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _probe(out_features: int, in_features: int, rows: int) -> tuple[float, float]:
    """Best-of seconds (aten, oneDNN) for one product; cached per process and thread count."""
    key = (out_features, in_features, rows, torch.get_num_threads())
    if key not in _probe_cache:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(out_features, in_features, generator=gen)
        x = torch.randn(rows, in_features, generator=gen)
        work = out_features * in_features * rows
        repeats = max(3, min(20, int(2e8 // max(work, 1))))
        with torch.inference_mode():
            _probe_cache[key] = (_seconds(lambda: torch.nn.functional.linear(x, w), repeats),
                                 _seconds(lambda: onednn_linear(x, w, None), repeats))
    return _probe_cache[key]


@dataclass(frozen=True)
class LinearPlan:
    """Which distinct weight shapes go to oneDNN, per regime, and how the choice was made."""

    kernel: str  # what the user asked: auto, aten or onednn
    onednn_small: tuple[tuple[int, int], ...]  # (out, in) shapes routed at one row
    onednn_few: tuple[tuple[int, int], ...]  # ... at 2 .. FEW_ROWS - 1 rows
    onednn_large: tuple[tuple[int, int], ...]  # ... at FEW_ROWS rows or more
    summary: str

    @property
    def routes_anything(self) -> bool:
        return bool(self.onednn_small or self.onednn_large or self.onednn_few)


def _candidates(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules()
            if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
            and "forward" not in m.__dict__]


def plan_linear(model: torch.nn.Module, kernel: str = "auto") -> LinearPlan:
    if kernel not in KERNELS:
        raise ValueError(f"cpu_linear_kernel must be one of {KERNELS}, got {kernel!r}")
    shapes = sorted({(m.out_features, m.in_features) for m in _candidates(model)})
    if kernel == "aten" or not shapes:
        why = "as asked" if kernel == "aten" else "no float32 CPU nn.Linear layers"
        return LinearPlan(kernel, (), (), (), f"aten ({why})")
    if not onednn_available():
        return LinearPlan(kernel, (), (), (), "aten (this PyTorch build has no oneDNN linear)")
    if kernel == "onednn":
        every = tuple(shapes)
        return LinearPlan(kernel, every, every, every, f"onednn for all {len(shapes)} weight shapes (as asked)")
    start = time.perf_counter()
    chosen: dict[int, set] = {rows: set() for rows in PROBE_ROWS}
    speedups: dict[int, list[float]] = {rows: [] for rows in PROBE_ROWS}
    for shape in shapes:
        for rows in PROBE_ROWS:
            aten, onednn = _probe(*shape, rows)
            speedups[rows].append(aten / onednn)
            if aten > WIN_MARGIN * onednn:
                chosen[rows].add(shape)
    small, few, large = (tuple(sorted(chosen[r])) for r in PROBE_ROWS)
    parts = [f"onednn for {len(chosen[r])}/{len(shapes)} weight shapes at {r} row{'s' * (r > 1)} "
             f"(aten/onednn time {min(speedups[r]):.2f}-{max(speedups[r]):.2f}x)" for r in PROBE_ROWS]
    summary = "; ".join(parts) + f"; probed in {time.perf_counter() - start:.2f} s, kept where >= {WIN_MARGIN}x"
    return LinearPlan(kernel, small, few, large, summary)


def _routed_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    route = self._contbatch_route
    # is_compiling() first: Dynamo folds it to True and never traces the thread-local read.
    if not torch.compiler.is_compiling() and ops.in_step() and input.dtype == torch.float32:
        rows = input.numel() // self.in_features
        if route[0 if rows == 1 else 1 if rows < FEW_ROWS else 2]:
            return onednn_linear(input, self.weight, self.bias)
    return torch.nn.Linear.forward(self, input)


class LinearRouter:
    """Installs the plan on a model's layers for the life of a manager, and takes it back."""

    def __init__(self, model: torch.nn.Module, plan: LinearPlan) -> None:
        self.model = model
        self.plan = plan
        self.modules: list[torch.nn.Linear] = []

    def install(self) -> None:
        if not self.plan.routes_anything or self.modules:
            return
        for m in _candidates(self.model):
            shape = (m.out_features, m.in_features)
            route = (shape in self.plan.onednn_small, shape in self.plan.onednn_few, shape in self.plan.onednn_large)
            if any(route):
                m._contbatch_route = route
                m.forward = types.MethodType(_routed_forward, m)
                self.modules.append(m)

    def uninstall(self) -> None:
        for m in self.modules:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_contbatch_route", None)
        self.modules = []
