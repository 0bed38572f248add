"""CPU linear layers on the fastest kernel the machine has, per weight shape and row count.

The kernels: `aten` (`F.linear`), `onednn` and `upcast` (`linear_kernels.py`), `small_linear` (ours,
1-7 rows of float32 or bfloat16: `ops.small_linear`) and `panel` (ours, float32 batches on a
weight packed in panels: `ops.panel_linear`). `plan_linear` chooses per weight shape
and dtype and per row regime (`ops.row_regime`): one row (a lone request decoding), a few rows
(2 to 7: a few requests, a speculative verification run; timed at 4), a batch (8 to 256 rows:
a decode step of many requests; timed at 32) and prompt chunks (more rows; timed at 512). "auto"
times every available kernel on the model's own shapes (`probe.py`) and takes one other than
aten only where it wins by WIN_MARGIN; the timings persist per machine, so later starts route,
and round, the same way. A kernel named instead of "auto" is forced where it is available
(`small_linear` hands its batches to oneDNN, or aten). Why this is measured rather than fixed, and
what it measured: docs/cpu.md.

Layers routed to oneDNN keep a prepacked copy of their weight while the manager runs (bit for
bit the same products), where the copies of every candidate's weight fit in
PREPACK_RAM_FRACTION of the available RAM: packed at the layer's second multi-row call, and
again when its weight changed (a new tensor, or an in-place update: its version counter moved).
`panel` runs only on such a copy (its own layout, packed at the layer's first multi-row call):
where copies are not kept, it is not a candidate.

Only plain `nn.Linear` modules with float32, bfloat16 or float16 CPU weights and no forward of
their own already patched in (hooks, adapters) are touched. Only calls inside an engine step
are routed. A compiled step cannot read the engine's thread-local step while Dynamo traces it,
so the runner marks its compiled calls (`context.in_compiled_step()`), and routed layers traced then
call `contbatch_cpu::routed_linear` (which picks the route's kernel by row count when it runs:
one graph for every step size); without our library, or on a route with `upcast`, the kernel
is chosen while tracing (one graph per row regime), oneDNN and upcast through their custom ops.
The change is rounding only (another summation order, float32 accumulation).
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass

import psutil
import torch

from .. import linear_kernels, native, ops, probe
from ..knobs import LINEAR_KERNELS as KERNELS
from ..load import ForeignLoad
from ... import context
from .base import Router

logger = logging.getLogger("contbatch")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The row count each regime (`ops.row_regime`) is timed at, each with its own verdict per weight
# shape. The batch regime's is a batched decode step's (tens of streams), where the kernels differ
# most; prompt chunks (hundreds of rows) are compute-bound, where aten and oneDNN tie on some
# machines and part on others (docs/cpu.md), and `panel` does not run.
PROBE_ROWS = (1, 4, 32, 512)
BATCH, PROMPT = 2, 3  # their indices. Where no kernel beats aten clearly at 512 rows, prompt chunks keep
# the batch verdict's kernel where it runs there (oneDNN): timed on hot copies, aten's bfloat16
# product tied oneDNN's prepacked one, while in the engine oneDNN ran the prompts faster (docs/cpu.md).
WIN_MARGIN = 1.1  # a kernel must be this much faster than aten to be chosen: noise must not flip kernels
PREPACK_RAM_FRACTION = 0.25  # prepacked oneDNN weights only while their copies fit in this much free RAM

Shape = tuple[int, int, str]  # (out_features, in_features, weight dtype name): plain JSON in resolved_config


@dataclass(frozen=True)
class LinearPlan:
    """The kernel of each weight shape routed away from aten, per regime, and how the choice was made."""

    kernel: str  # what the user asked: auto, aten, onednn, small_linear, panel or upcast
    routes: tuple[tuple[Shape, tuple[str, ...]], ...]  # shape -> kernel per row regime (PROBE_ROWS)
    summary: str
    prepack: bool = False  # layers routed to oneDNN or panel keep a packed copy of their weight

    @property
    def routes_anything(self) -> bool:
        return bool(self.routes)

    def kernels_at(self, regime: int) -> dict[Shape, str]:
        """{shape: kernel} at one regime (0: one row, 1: a few, 2: a batch, 3: prompt chunks), aten left out."""
        return {shape: kernels[regime] for shape, kernels in self.routes if kernels[regime] != "aten"}


def candidates(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's linear layers a plan may route."""
    return [m for m in model.modules()
            if type(m) is torch.nn.Linear and m.weight.dtype in DTYPES and m.weight.device.type == "cpu"
            and "forward" not in m.__dict__]


def shape_of(m: torch.nn.Linear) -> Shape:
    return (m.out_features, m.in_features, str(m.weight.dtype).removeprefix("torch."))


def one_row_weights(model: torch.nn.Module, plan: LinearPlan) -> list[torch.Tensor]:
    """The float weights a lone request's decode step streams whole from memory: every candidate
    layer's, whichever kernel `plan` gives it at one row (aten's GEMV misses the TLB on 4 KiB
    pages as `small_linear` does: docs/cpu.md), none where the plan keeps PyTorch's linears
    everywhere (asked `aten`, or every CPU kernel off). Called before the plan is installed
    (`candidates` skips routed layers)."""
    return [] if plan.kernel == "aten" else [m.weight for m in candidates(model)]


def _prepack_verdict(layers: list[torch.nn.Linear], asked: bool, available: list[str]) -> tuple[bool, str]:
    """Whether oneDNN and panel layers keep packed weights, and why: asked, a kernel that packs
    here, trackable weights (inference tensors have no version counter), and copies of every
    candidate layer's weight (two where both kernels pack: a layer may run one on a few rows and
    the other on a batch) within PREPACK_RAM_FRACTION of the available RAM."""
    if not asked:
        return False, "oneDNN and panel weights not prepacked (as asked)"
    kinds = ("onednn" in available) + ("panel" in available)
    if not kinds:
        return False, ""
    if any(m.weight.is_inference() for m in layers):
        return False, "oneDNN and panel weights not prepacked (inference-mode weights: updates could not be seen)"
    nbytes = kinds * sum(m.weight.numel() * m.weight.element_size() for m in layers)
    budget = PREPACK_RAM_FRACTION * psutil.virtual_memory().available
    if nbytes > budget:
        return False, (f"oneDNN and panel weights not prepacked (copies would take {nbytes / 2**30:.2f} GiB, over "
                       f"{PREPACK_RAM_FRACTION:.0%} of the available RAM)")
    return True, ""


def _packs(route: tuple[str, ...] | None, kernel: str = "onednn") -> bool:
    """Whether a layer with this route runs `kernel` (oneDNN or panel) on two rows or more (one
    row keeps the plain weight)."""
    return route is not None and kernel in route[1:]


def _packed_note(model: torch.nn.Module, routes, prepack: bool, why: str) -> str:
    if not prepack:
        return f"; {why}" if why else ""
    by_shape = dict(routes)
    notes = []
    for kernel, what in (("onednn", "oneDNN weights prepacked"), ("panel", "panel weights packed")):
        nbytes = sum(m.weight.numel() * m.weight.element_size() for m in candidates(model)
                     if _packs(by_shape.get(shape_of(m)), kernel))
        if nbytes:
            notes.append(f"; {what} ({nbytes / 2**20:.0f} MiB of copies)")
    return "".join(notes)


def plan_linear(model: torch.nn.Module, kernel: str = "auto", prepack: bool = True) -> LinearPlan:
    if kernel not in KERNELS:
        raise ValueError(f"the linear kernel must be one of {KERNELS}, got {kernel!r}")
    layers = candidates(model)
    shapes = sorted({shape_of(m) for m in layers})
    if kernel == "aten" or not shapes:
        why = "as asked" if kernel == "aten" else "no float32, bfloat16 or float16 CPU nn.Linear layers"
        return LinearPlan(kernel, (), f"aten ({why})")
    if native.load()[0]:
        ops.register_linear_fakes()
    available = {name: sorted({k for rows in PROBE_ROWS
                               for k in linear_kernels.available_kernels(getattr(torch, name), rows)})
                 for name in sorted({s[2] for s in shapes})}  # at any row count probed
    prepack, why = _prepack_verdict(layers, prepack, [k for kernels in available.values() for k in kernels])
    missing = sorted(name for name, kernels in available.items() if "onednn" not in kernels)
    no_onednn = f"; oneDNN's linear does not run in {', '.join(missing)} here" if missing else ""
    if not prepack:  # the panel kernel runs on its packed copy only
        available = {name: [k for k in kernels if k != "panel"] for name, kernels in available.items()}
    if kernel != "auto":
        routes = []
        for s in shapes:
            if kernel in available[s[2]]:
                batch = kernel if kernel != "small_linear" else "onednn" if "onednn" in available[s[2]] else "aten"
                routes.append((s, ("aten" if kernel == "panel" else kernel, kernel, batch,
                                   "aten" if kernel == "panel" else batch)))
        if not routes:
            return LinearPlan(kernel, (), f"aten ({kernel} is not available here{no_onednn})")
        above = (f"; oneDNN or aten above {ops.SMALL_LINEAR_MAX_ROWS} rows" if kernel == "small_linear" else
                 f"; aten for one row and above {ops.PANEL_MAX_ROWS} rows" if kernel == "panel" else "")
        left = (f"; {len(shapes) - len(routes)} on aten ({kernel} is not available for them)"
                if len(routes) < len(shapes) else "")
        return LinearPlan(kernel, tuple(routes), f"{kernel} for {len(routes)} of {len(shapes)} weight shapes "
                          f"(as asked{above}){left}{no_onednn}" + _packed_note(model, routes, prepack, why), prepack)
    start = time.perf_counter()
    watch = ForeignLoad()
    store = probe.store
    hits, probed = store.hits, store.probed
    chosen: dict[Shape, list[str]] = {}
    gains: list[list[float]] = [[] for _ in PROBE_ROWS]
    for name in sorted({s[2] for s in shapes}):
        of_dtype = [s for s in shapes if s[2] == name]
        dtype = getattr(torch, name)
        nbytes = sum(m.weight.numel() * m.weight.element_size() for m in layers if m.weight.dtype == dtype)
        pool = probe.probe_pool(nbytes, max(o * i for o, i, _ in of_dtype), dtype)
        for shape in of_dtype:
            chosen[shape] = []
            packs = {}  # per timed shape: the pool's copies packed (probe.packed_pools), for every row count
            for regime, rows in enumerate(PROBE_ROWS):
                kernels = tuple(k for k in linear_kernels.available_kernels(dtype, rows) if k in available[name])
                timed = probe.timed_shape(shape[0], shape[1], rows)
                packed = packs.setdefault(timed, probe.packed_pools(pool, *timed)) if prepack and rows > 1 else {}
                times = probe.time_kernels(*timed, rows, pool, kernels, {k: packed[k] for k in kernels if k in packed})
                best = min(times, key=times.get)
                gains[regime].append(times["aten"] / times[best])
                verdict = best if times["aten"] > WIN_MARGIN * times[best] else "aten"
                if verdict == "aten" and regime == PROMPT and chosen[shape][BATCH] in kernels:
                    verdict = chosen[shape][BATCH]  # no clear winner: prompt chunks stay on the batch kernel
                chosen[shape].append(verdict)
            del packs  # the packed copies (up to POOL_BYTES each) go before the next shape's are made
        del pool
    routes = tuple((s, tuple(k)) for s, k in chosen.items() if set(k) != {"aten"})
    parts = []
    for regime, rows in enumerate(PROBE_ROWS):
        counts = {k: sum(v[regime] == k for v in chosen.values()) for k in KERNELS[1:]}
        parts.append(f"{rows} row{'s' * (rows > 1)}: " + ", ".join(f"{k} {n}" for k, n in counts.items() if n)
                     + f" of {len(shapes)} shapes (aten/best time {min(gains[regime]):.2f}-{max(gains[regime]):.2f}x)")
    # Ranks of one tensor-parallel job probe side by side: their load is the job's own.
    ranks = torch.distributed.is_available() and torch.distributed.is_initialized()
    foreign = None if ranks and torch.distributed.get_world_size() > 1 else watch.cores()
    quiet = store.save(foreign)
    how = f"probed in {time.perf_counter() - start:.2f} s"
    if not quiet:
        how += (f" while other processes kept {foreign:.1f} CPUs busy (timings not saved: the next start "
                f"probes again)")
        logger.warning("contbatch: linear kernels probed while other processes kept %.1f CPUs busy: the routes may "
                       "be slower than on a quiet machine; the timings are not saved, the next start probes again",
                       foreign)
    if store.hits > hits:
        how = f"{how}, other verdicts" if store.probed > probed else "probe verdicts"
        how += f" reused from {store.path} (delete it to probe again)"
    summary = "; ".join(parts) + f"; {how}, kept where >= {WIN_MARGIN}x{no_onednn}"
    return LinearPlan(kernel, routes, summary + _packed_note(model, routes, prepack, why), prepack)


def kernel_at(route: tuple[str, ...], rows: int) -> str:
    """The route's kernel for a call of `rows` rows."""
    return "aten" if rows == 0 else route[ops.row_regime(rows)]


def routed_codes(route: tuple[str, ...]) -> tuple[int, ...] | None:
    """The route as `routed_linear`'s codes, or None where it names a kernel the op lacks
    (`upcast`) or the C++ library is not loaded (no compiler here)."""
    if not native.load()[0] or any(k not in ops.ROUTED_CODES for k in route):
        return None
    ops.register_linear_fakes()
    return tuple(ops.ROUTED_CODES[k] for k in route)


def _routed_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    compiling = torch.compiler.is_compiling()  # Dynamo folds this to True and never traces the step context
    if (context.in_compiled_step() if compiling else self._contbatch_in_step()) and input.dtype == self.weight.dtype:
        codes = self.__dict__.get("_contbatch_codes") if compiling else None
        if codes is not None:
            return ops.routed_linear(input, self.weight, self.bias, codes)
        rows = input.numel() // self.in_features
        kernel = kernel_at(self._contbatch_route, rows)
        if kernel == "onednn":  # in a graph through its custom op (see the module docstring)
            if compiling:
                return torch.ops.contbatch.onednn_linear(input, self.weight, self.bias)
            packed = self.__dict__.get("_contbatch_packed")
            blocked = packed.fresh(self.weight) if packed is not None and rows > 1 else None  # see PACK_ROWS
            if blocked is not None:
                return linear_kernels.packed_linear(input, blocked, self.bias)
            return linear_kernels.onednn_linear(input, self.weight, self.bias)
        if kernel == "small_linear":  # traceable as is: its C++ op has a fake
            return ops.small_linear(input, self.weight, self.bias)
        if kernel == "panel":  # needs the library: never traced (compiled steps take `codes` above)
            return ops.panel_linear(input, self.weight, self._contbatch_panel.fresh(self.weight), self.bias)
        if kernel == "upcast":
            if compiling:
                return torch.ops.contbatch.upcast_linear(input, self.weight, self.bias)
            return linear_kernels.upcast_linear(input, self.weight, self.bias)
    return torch.nn.Linear.forward(self, input)


# The attribute holding a routed layer's packed copy (linear_kernels.PackedWeight), per kernel
# that packs: `install` sets it, `_routed_forward` and fused_layer.py read it.
HOLDER_OF = {"onednn": "_contbatch_packed", "panel": "_contbatch_panel"}
ATTRIBUTES = ("forward", "_contbatch_route", "_contbatch_codes", *HOLDER_OF.values(), "_contbatch_in_step")


class LinearRouter(Router):
    """Installs the plan on a model's layers for the life of a manager, and takes it back."""

    def __init__(self, model: torch.nn.Module, plan: LinearPlan) -> None:
        self.model = model
        self.plan = plan
        self.modules: list[torch.nn.Linear] = []

    def install(self) -> None:
        if not self.plan.routes_anything or self.modules:
            return
        routes = dict(self.plan.routes)
        for m in candidates(self.model):
            route = routes.get(shape_of(m))
            if route is not None:
                m._contbatch_route = route
                m._contbatch_codes = routed_codes(route)
                m._contbatch_in_step = context.in_step
                if self.plan.prepack and _packs(route):
                    m._contbatch_packed = linear_kernels.PackedWeight(None, -1, None)  # packed when first reused
                if _packs(route, "panel"):  # a plan routes panel only where it keeps copies
                    m._contbatch_panel = linear_kernels.PackedWeight.panel()
                m.forward = types.MethodType(_routed_forward, m)
                self.modules.append(m)

    def uninstall(self) -> None:
        for m in self.modules:
            for attr in ATTRIBUTES:
                m.__dict__.pop(attr, None)
        self.modules = []
