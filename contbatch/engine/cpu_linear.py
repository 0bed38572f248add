"""CPU linear layers on the fastest kernel the machine has, per weight shape and row count.

Three kernels compute `nn.Linear` on the CPU:
- `aten`: PyTorch's `F.linear` (MKL's sgemm in float32, oneDNN in bfloat16);
- `onednn`: `torch.ops.mkldnn._linear_pointwise`. On AMD EPYC machines MKL's float32 path is
  slow: on the 2-core EPYC these machines use, 64x576x1536 ran at ~160 GFLOP/s through MKL and
  ~330 through oneDNN;
- `native`: our C++ kernel for one to seven rows (`csrc/small_linear_cpu.cpp`). Those products
  are bound by reading the weight, and the GEMM kernels read it slowly: one row of 576x1536
  streamed its weight at ~18 GB/s through MKL, ~27 through oneDNN and ~46 through ours;
- `upcast` (bfloat16 and float16): the product in float32, the weight converted a slice at a
  time. CPUs without AVX-512 or AVX-NE-CONVERT have no fast 16-bit GEMM: on an AVX2-only
  EPYC, PyTorch's bfloat16 linear ran at ~14 GFLOP/s at every row count (float32: 60-110),
  float16 about as slowly, and oneDNN's runs neither; converting first ran 64 rows 4-6x faster.
  16-bit products are exact in float32, so this rounds once, at the end.

oneDNN reads its weight in a blocked layout it reorders the plain weight into on every call;
with a copy of the weight kept in that layout (prepacked, as Inductor's freezing does) the same
products run 1.2-1.5x faster at 8-64 rows (a decode step's batch) and ~1.05x at 200-2048, with
bit-identical results. So layers routed to oneDNN keep a prepacked copy while the manager runs,
where the copies fit in `PREPACK_RAM_FRACTION` of the available RAM: packed at the layer's second
multi-row call (a lone request's one prompt step never pays for it), and packed again
when its weight changed (a new tensor, or an in-place update: its version counter moved).

At start-up the engine times them on each distinct weight shape and dtype of the model, at
one row (a lone request decoding), at four rows (a few requests, a speculative verification
run) and at 64 rows, each timed call reading a different copy of the weight as a forward
does, and routes a shape to a kernel other than aten only where it wins by a clear margin.
The timings persist in `$CONTBATCH_CACHE/linear_probe/` per machine, so later starts route (and
round) the same way without probing again.

Only calls made inside an engine step are routed (`ops.in_step()`, set on the engine thread
around each forward): the user's own forward, backward or `model.generate` on the same model
runs the unmodified `nn.Linear.forward`. A compiled step cannot read that thread-local flag
while Dynamo traces it, so the runner sets `compiled_step` around its compiled calls and the
routed layers call the kernels as opaque ops: `contbatch_cpu::routed_linear` (C++, a fake for
shapes), which picks the route's kernel by row count when it runs, so one graph serves every
step size; without our C++ library, or on a route with `upcast`, the choice is made while
tracing (one graph per row regime) and oneDNN goes through `contbatch::onednn_linear`.
Inductor's own lowering of the oneDNN linear wants weights prepacked by freezing, which would
make them constants and `update_weights` impossible; without the routing a compiled step ran
MKL's sgemm and lost to the eager step.
Only plain `nn.Linear` modules with float32, bfloat16 or float16 CPU weights are touched (float16
on aten, oneDNN or `upcast`: our kernel reads 32- and 16-bit brain floats only), and only
those with no forward of their own already patched in (hooks, adapters). The change is
rounding only (a different summation order, float32 accumulation); greedy tokens are checked
against `model.generate` in the test suite like every kernel choice.
"""

from __future__ import annotations

import functools
import logging
import time
import types
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch

from .. import native
from ..attention import ops
from ..config import CPU_LINEAR_KERNELS
from .probe_store import ProbeStore

KERNELS = CPU_LINEAR_KERNELS
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Three regimes, each with its own verdict per weight shape: one row, a few rows (probed at 4:
# MKL's sgemm ran 2-4x slower at 2-8 rows than at one on the EPYC), and a batch (probed at 64).
PROBE_ROWS = (1, 4, 64)
FEW_ROWS = 8  # calls with 2 .. FEW_ROWS - 1 rows take the 4-row verdict; more, the 64-row one
NATIVE_MAX_ROWS = FEW_ROWS - 1  # what csrc/small_linear_cpu.cpp takes
WIN_MARGIN = 1.1  # a kernel must be this much faster than aten to be chosen: noise must not flip kernels
POOL_BYTES = 128 << 20  # probe weights streamed from up to this much memory: 4x this L3 (32 MiB)
PREPACK_RAM_FRACTION = 0.25  # prepacked oneDNN weights only while their copies fit in this much free RAM
# The row count oneDNN's blocked layout is chosen for. Any count runs on it, but a lone row ran
# slower on it than on the plain weight in a lone request's steps (the 49152x576 LM head: ~3.8
# vs ~3.4 ms, and worse inside the engine), so single rows keep the plain weight.
PACK_ROWS = 64
logger = logging.getLogger("contbatch")


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's linear runs at `dtype` here, tried on a small product and a packing.
    A build can have oneDNN and still lack a dtype: on an AVX2-only EPYC its bfloat16 linear
    raised "could not create a primitive descriptor" (it wants AVX-512 or AVX-NE-CONVERT), so
    routing a bfloat16 model there crashed the first step."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    x, w = torch.ones(2, 16, dtype=dtype), torch.ones(8, 16, dtype=dtype)
    try:
        with torch.inference_mode():
            onednn_linear(x, w, None)
            packed_linear(x, pack(w), None)
    except RuntimeError as exc:
        logger.debug("oneDNN's %s linear does not run here: %s", dtype, exc)
        return False
    return True


def available_kernels(dtype: torch.dtype, rows: int = 1) -> list[str]:
    """The kernels that can compute a product of `rows` rows at `dtype` here, aten first: ours
    takes 1-7 rows of float32 or bfloat16, `upcast` 16-bit weights."""
    return (["aten"] + ["onednn"] * onednn_available(dtype)
            + ["native"] * (native.load()[0] and dtype != torch.float16 and rows <= NATIVE_MAX_ROWS)
            + ["upcast"] * (dtype in (torch.bfloat16, torch.float16)))


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a [out, in] weight (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


@dataclass(eq=False)
class PackedWeight:
    """A layer's prepacked weight and the weight (tensor and version) it was packed from.

    Packed at the layer's second call of more than one row, not at start-up: packing the default
    model's 211 weights takes ~0.15-0.3 s, as long as its 225-token prompt, and a lone request
    (one prompt step, then one-row steps, which read the plain weight) never uses the copies.
    Its first multi-row call runs oneDNN on the plain weight: the same products, bit for bit."""

    weight: torch.Tensor | None
    version: int
    packed: torch.Tensor | None
    unpacked_calls: int = 1  # multi-row calls still to run on the plain weight

    def fresh(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of `weight` as it is now (None while deferred): packed again if it
        was replaced or updated in place (an optimizer step, `update_weights`), so a stale copy
        never runs."""
        if self.unpacked_calls > 0:
            self.unpacked_calls -= 1
            return None
        if weight is not self.weight or weight._version != self.version:
            self.weight, self.version, self.packed = weight, weight._version, pack(weight)
        return self.packed

    # A copy of the model made while a manager runs (a frozen reference policy, a pickled
    # checkpoint) cannot copy oneDNN's opaque tensor: it gets an empty one, packed on first use.
    def __deepcopy__(self, memo) -> "PackedWeight":
        return PackedWeight(None, -1, None, 0)

    def __reduce__(self):
        return (PackedWeight, (None, -1, None, 0))


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.contbatch_cpu.small_linear(x, weight, bias)  # [..., in] -> [..., out], 1-7 rows


UPCAST_SLICE = 1 << 21  # weight elements converted at a time: 8 MiB of float32, in L3 beside the rows


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A bfloat16 or float16 product in float32, on oneDNN where it runs (MKL's float32 is
    slower on the EPYC). A large weight is converted a slice of output features at a time:
    converting the whole 49152x576 LM head first spent more in the fresh 113 MB buffer than in
    the product."""
    rows = x.reshape(-1, x.shape[-1]).float()
    matmul = onednn_linear if onednn_available(torch.float32) else torch.nn.functional.linear
    step = max(1, UPCAST_SLICE // weight.shape[1])
    if weight.shape[0] <= step:
        out = matmul(rows, weight.float(), None if bias is None else bias.float()).to(x.dtype)
    else:
        out = rows.new_empty(rows.shape[0], weight.shape[0], dtype=x.dtype)
        for start in range(0, weight.shape[0], step):
            part = slice(start, start + step)
            out[:, part] = matmul(rows, weight[part].float(), None if bias is None else bias[part].float())
    return out.view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("contbatch::upcast_linear", mutates_args=())
def _upcast_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return upcast_linear(x, weight, bias)


@torch.library.custom_op("contbatch::onednn_linear", mutates_args=())
def _onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return onednn_linear(x, weight, bias)


@_onednn_linear_op.register_fake
@_upcast_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_fake_registered: list[bool] = []


def _register_native_fake() -> None:
    """Shapes of our C++ `small_linear` for Dynamo, so a compiled step calls it directly (an
    extern kernel in Inductor's output) rather than through a Python custom op per layer."""
    if not _fake_registered:
        fake = torch.library.register_fake("contbatch_cpu::small_linear")
        fake(lambda x, w, b: x.new_empty(*x.shape[:-1], w.shape[0]))
        fake = torch.library.register_fake("contbatch_cpu::routed_linear")
        fake(lambda x, w, b, one, few, many: x.new_empty(*x.shape[:-1], w.shape[0]))
        _fake_registered.append(True)


class _CompiledStep:
    """Set while the runner calls a compiled step (Dynamo guards on it): routed layers traced
    then take the opaque ops. A class attribute, not a thread-local, because Dynamo traces it."""

    active = False


@contextmanager
def compiled_step():
    _CompiledStep.active = True
    try:
        yield
    finally:
        _CompiledStep.active = False


def _seconds(fn, weights: list[torch.Tensor], repeats: int) -> float:
    """Best-of seconds per call, each pass calling `fn` once on every weight in turn."""
    for w in weights[:2]:
        fn(w)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def _copies(pool: torch.Tensor, out_features: int, in_features: int) -> list[torch.Tensor]:
    """As many [out, in] weights as `pool` holds (at least one), cut from it without copying."""
    size = out_features * in_features
    return [pool[i * size:(i + 1) * size].view(out_features, in_features) for i in range(max(1, pool.numel() // size))]


def _probe(out_features: int, in_features: int, rows: int, pool: ProbePool, kernels: tuple[str, ...],
           packed: Callable[[], list[torch.Tensor]] | None = None) -> dict[str, float]:
    """Best-of seconds per kernel for one product, cached per process, thread count and pool.
    Each timed call reads a different copy of the weight, cut from `pool`: a real forward
    streams its weights from memory, and timing one weight over and over (hot in the cache)
    chose the wrong kernel. On the EPYC, one row of 576x1536: MKL 49 us hot vs oneDNN 63, but
    198 vs 144 us with the weight in memory, which is what a lone request decoding sees.
    `packed`, where oneDNN runs on prepacked weights, gives the pool's copies packed (what will
    run), made once per shape for every row count probed."""
    prepack = packed is not None
    key = (f"{out_features}x{in_features} rows={rows} threads={torch.get_num_threads()} pool={pool.numel} "
           f"{pool.dtype} {','.join(kernels)}{' packed' if prepack else ''}")
    times = _store.get(key)
    if times is None:
        weights = _copies(pool.tensor, out_features, in_features)
        x = (torch.rand(rows, in_features, generator=torch.Generator().manual_seed(0)) - 0.5).to(pool.dtype)
        repeats = max(3, min(10, int(2e8 // max(out_features * in_features * rows * len(weights), 1))))
        fns = {"aten": torch.nn.functional.linear, "onednn": packed_linear if prepack else onednn_linear,
               "native": native_linear, "upcast": upcast_linear}
        with torch.inference_mode():
            times = {k: _seconds(lambda w, f=fns[k]: f(x, w, None),
                                 packed() if k == "onednn" and prepack else weights, repeats)
                     for k in kernels}
        _store.put(key, times)
    return times


_store = ProbeStore()


@dataclass(eq=False)
class ProbePool:
    """Memory to cut weight copies from, drawn only when a product is actually timed: with
    every verdict read from the probe file, drawing up to POOL_BYTES of random values was most
    of a start's linear planning (~0.3 of 0.33 s on the default model)."""

    numel: int
    dtype: torch.dtype

    def draw(self) -> torch.Tensor:
        return (torch.rand(self.numel, generator=torch.Generator().manual_seed(0)) - 0.5).to(self.dtype)

    @functools.cached_property
    def tensor(self) -> torch.Tensor:
        return self.draw()


def _probe_pool(model_bytes: int, largest: int, dtype: torch.dtype) -> ProbePool:
    """As many bytes as the model's linears of that dtype (so a model small enough to stay in
    the cache is probed in the cache), at most POOL_BYTES, and at least one copy of the largest
    weight."""
    size = torch.tensor([], dtype=dtype).element_size()
    return ProbePool(max(min(model_bytes, POOL_BYTES) // size, largest), dtype)


Shape = tuple[int, int, str]  # (out_features, in_features, weight dtype name): plain JSON in resolved_config


@dataclass(frozen=True)
class LinearPlan:
    """The kernel of each weight shape routed away from aten, per regime, and how the choice was made."""

    kernel: str  # what the user asked: auto, aten, onednn or native
    routes: tuple[tuple[Shape, tuple[str, str, str]], ...]  # shape -> kernel at 1 row, a few rows, a batch
    summary: str
    prepack: bool = False  # layers routed to oneDNN keep a prepacked copy of their weight

    @property
    def routes_anything(self) -> bool:
        return bool(self.routes)

    def kernels_at(self, regime: int) -> dict[Shape, str]:
        """{shape: kernel} at one regime (0: one row, 1: a few, 2: a batch), aten left out."""
        return {shape: kernels[regime] for shape, kernels in self.routes if kernels[regime] != "aten"}


def _candidates(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules()
            if type(m) is torch.nn.Linear and m.weight.dtype in DTYPES and m.weight.device.type == "cpu"
            and "forward" not in m.__dict__]


def _shape(m: torch.nn.Linear) -> Shape:
    return (m.out_features, m.in_features, str(m.weight.dtype).removeprefix("torch."))


def _prepack_verdict(layers: list[torch.nn.Linear], asked: bool, available: list[str]) -> tuple[bool, str]:
    """Whether oneDNN layers keep prepacked weights, and why: asked, oneDNN here, trackable
    weights (inference tensors have no version counter), and copies of every candidate layer's
    weight within PREPACK_RAM_FRACTION of the available RAM."""
    if not asked:
        return False, "oneDNN weights not prepacked (as asked)"
    if "onednn" not in available:
        return False, ""
    if any(m.weight.is_inference() for m in layers):
        return False, "oneDNN weights not prepacked (inference-mode weights: updates could not be seen)"
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    budget = PREPACK_RAM_FRACTION * psutil.virtual_memory().available
    if nbytes > budget:
        return False, (f"oneDNN weights not prepacked (copies would take {nbytes / 2**30:.2f} GiB, over "
                       f"{PREPACK_RAM_FRACTION:.0%} of the available RAM)")
    return True, ""


def _packs(route: tuple[str, str, str] | None) -> bool:
    """Whether a layer with this route runs oneDNN on two rows or more (one row keeps the plain weight)."""
    return route is not None and "onednn" in route[1:]


def _packed_note(model: torch.nn.Module, routes, prepack: bool, why: str) -> str:
    if not prepack:
        return f"; {why}" if why else ""
    by_shape = dict(routes)
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in _candidates(model)
                 if _packs(by_shape.get(_shape(m))))
    return f"; oneDNN weights prepacked ({nbytes / 2**20:.0f} MiB of copies)" if nbytes else ""


def plan_linear(model: torch.nn.Module, kernel: str = "auto", prepack: bool = True) -> LinearPlan:
    if kernel not in KERNELS:
        raise ValueError(f"cpu_linear_kernel must be one of {KERNELS}, got {kernel!r}")
    layers = _candidates(model)
    shapes = sorted({_shape(m) for m in layers})
    if kernel == "aten" or not shapes:
        why = "as asked" if kernel == "aten" else "no float32, bfloat16 or float16 CPU nn.Linear layers"
        return LinearPlan(kernel, (), f"aten ({why})")
    if native.load()[0]:
        _register_native_fake()
    available = {name: available_kernels(getattr(torch, name)) for name in sorted({s[2] for s in shapes})}
    prepack, why = _prepack_verdict(layers, prepack, [k for kernels in available.values() for k in kernels])
    missing = sorted(name for name, kernels in available.items() if "onednn" not in kernels)
    no_onednn = f"; oneDNN's linear does not run in {', '.join(missing)} here" if missing else ""
    if kernel != "auto":
        routes = []
        for s in shapes:
            if kernel in available[s[2]]:
                batch = kernel if kernel != "native" else "onednn" if "onednn" in available[s[2]] else "aten"
                routes.append((s, (kernel, kernel, batch)))
        if not routes:
            return LinearPlan(kernel, (), f"aten ({kernel} is not available here{no_onednn})")
        above = f"; oneDNN or aten above {NATIVE_MAX_ROWS} rows" if kernel == "native" else ""
        left = (f"; {len(shapes) - len(routes)} on aten ({kernel} is not available for them)"
                if len(routes) < len(shapes) else "")
        return LinearPlan(kernel, tuple(routes), f"{kernel} for {len(routes)} of {len(shapes)} weight shapes "
                          f"(as asked{above}){left}{no_onednn}" + _packed_note(model, routes, prepack, why), prepack)
    start = time.perf_counter()
    hits, probed = _store.hits, _store.probed
    chosen: dict[Shape, list[str]] = {}
    gains: list[list[float]] = [[] for _ in PROBE_ROWS]
    for name in sorted({s[2] for s in shapes}):
        of_dtype = [s for s in shapes if s[2] == name]
        dtype = getattr(torch, name)
        nbytes = sum(m.weight.numel() * m.weight.element_size() for m in layers if m.weight.dtype == dtype)
        pool = _probe_pool(nbytes, max(o * i for o, i, _ in of_dtype), dtype)
        for shape in of_dtype:
            chosen[shape] = []
            packed = functools.cache(lambda s=shape: [pack(w) for w in _copies(pool.tensor, s[0], s[1])])
            for regime, rows in enumerate(PROBE_ROWS):
                kernels = tuple(available_kernels(dtype, rows))
                times = _probe(shape[0], shape[1], rows, pool, kernels, packed if prepack and rows > 1 else None)
                best = min(times, key=times.get)
                gains[regime].append(times["aten"] / times[best])
                chosen[shape].append(best if times["aten"] > WIN_MARGIN * times[best] else "aten")
            del packed  # the packed copies (up to POOL_BYTES) go before the next shape's are made
        del pool
    routes = tuple((s, tuple(k)) for s, k in chosen.items() if set(k) != {"aten"})
    parts = []
    for regime, rows in enumerate(PROBE_ROWS):
        counts = {k: sum(v[regime] == k for v in chosen.values()) for k in KERNELS[1:]}
        parts.append(f"{rows} row{'s' * (rows > 1)}: " + ", ".join(f"{k} {n}" for k, n in counts.items() if n)
                     + f" of {len(shapes)} shapes (aten/best time {min(gains[regime]):.2f}-{max(gains[regime]):.2f}x)")
    _store.save()
    how = f"probed in {time.perf_counter() - start:.2f} s"
    if _store.hits > hits:
        how = f"{how}, other verdicts" if _store.probed > probed else "probe verdicts"
        how += f" reused from {_store.path} (delete it to probe again)"
    summary = "; ".join(parts) + f"; {how}, kept where >= {WIN_MARGIN}x{no_onednn}"
    return LinearPlan(kernel, routes, summary + _packed_note(model, routes, prepack, why), prepack)


def _kernel(route: tuple[str, str, str], rows) -> str:
    return "aten" if rows == 0 else route[0 if rows == 1 else 1 if rows < FEW_ROWS else 2]


# Kernel codes of `contbatch_cpu::routed_linear` (csrc/small_linear_cpu.cpp), which picks a
# route's kernel by the row count at run time: a compiled step that chose in Python branched on
# the row count, one graph (and one trace of every layer) per regime.
ROUTED_CODES = {"aten": 0, "onednn": 1, "native": 2}


def _routed_codes(route: tuple[str, str, str]) -> tuple[int, int, int] | None:
    """The route as `routed_linear`'s codes, or None where it names a kernel the op lacks
    (`upcast`) or the C++ library is not loaded (no compiler here)."""
    if not native.load()[0] or any(k not in ROUTED_CODES for k in route):
        return None
    _register_native_fake()
    return tuple(ROUTED_CODES[k] for k in route)


def _routed_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    compiling = torch.compiler.is_compiling()  # Dynamo folds this to True and never traces in_step()
    if (_CompiledStep.active if compiling else ops.in_step()) and input.dtype == self.weight.dtype:
        codes = self.__dict__.get("_contbatch_codes") if compiling else None
        if codes is not None:
            return torch.ops.contbatch_cpu.routed_linear(input, self.weight, self.bias, *codes)
        rows = input.numel() // self.in_features
        kernel = _kernel(self._contbatch_route, rows)
        if kernel == "onednn":  # in a graph through its custom op (see the module docstring)
            if compiling:
                return torch.ops.contbatch.onednn_linear(input, self.weight, self.bias)
            packed = self.__dict__.get("_contbatch_packed")
            blocked = packed.fresh(self.weight) if packed is not None and rows > 1 else None  # see PACK_ROWS
            if blocked is not None:
                return packed_linear(input, blocked, self.bias)
            return onednn_linear(input, self.weight, self.bias)
        if kernel == "native":  # traceable as is: its C++ op has a fake
            return native_linear(input, self.weight, self.bias)
        if kernel == "upcast":
            if compiling:
                return torch.ops.contbatch.upcast_linear(input, self.weight, self.bias)
            return upcast_linear(input, self.weight, self.bias)
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
        routes = dict(self.plan.routes)
        for m in _candidates(self.model):
            route = routes.get(_shape(m))
            if route is not None:
                m._contbatch_route = route
                m._contbatch_codes = _routed_codes(route)
                if self.plan.prepack and _packs(route):
                    m._contbatch_packed = PackedWeight(None, -1, None)  # packed when first reused
                m.forward = types.MethodType(_routed_forward, m)
                self.modules.append(m)

    def uninstall(self) -> None:
        for m in self.modules:
            for attr in ("forward", "_contbatch_route", "_contbatch_codes", "_contbatch_packed"):
                m.__dict__.pop(attr, None)
        self.modules = []
