"""Llama-family decoder layers as one C++ call inside engine steps (`csrc/decoder_layer_cpu.cpp`).

With the linears, norms, rotary and attention on our kernels, what a lone request's decode step
still spends beside reading the weights is Python: each decoder layer is ~12 module calls and
~40 small op calls, ~180 us a layer on the 2-core EPYC, ~5 ms of a ~20 ms step (a model of the
default one's structure with 64 hidden units ran its steps in 6 ms). The fused layer calls the
same kernels in the same order with the same arguments, so its output is bit-identical to the
layer's own forward under the other routers. That is checked, not assumed: the first time a
layer of each variant (class, window, routes, biases) runs fused in each kind of step (one row,
a few, many; decode rows, prompt chunks or both), it runs its own forward too and the two are
compared bit for bit; on any difference every layer goes back to its own forward for the life
of that manager, with a warning. (Checking every layer doubled a short-lived manager's first
prefill step: `generate_batch` on 12 prompts of 400 tokens ran 1.3x slower.)

Past one call per layer, the trips through Python between the layers (module call, argument
lists: ~1 ms of a lone request's bfloat16 step) go too: from each kind of step's second, the
first layer runs the whole stack as one call (`FusedStack`, `decoder_stack`: the same layer
function, layer after layer) and the others pass its output on. Only once a step of that kind
ran the layers one by one, every check passed, and showed the model's loop a plain chain (each
layer once, in order, on the previous one's output), and while no layer has hooks.

It covers the decoder layer classes whose forward is Llama's (norm, q/k/v projections, optional
per-head q/k norms, rotary, attention, output projection, residual, norm, gated SiLU MLP,
residual), in steps whose rows all take our C++ attention (the torch backend's decode kernel
and prefill kernel); other steps run the layer's own forward. A layer qualifies only where
every piece of it already runs on our kernels or as aten does (its norm class and its modeling
file's rotary fused, its linears routed or plain `nn.Linear`), and nothing else is attached to
it (hooks, adapters, a patched forward): the start-up line says which layers were left alone
and why. As with the other routers, only calls inside an engine step are routed, and compiled
steps trace the layer's own forward.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import native
from ..attention import ops
from ..attention.torch_backend import TorchBackend
from .compile import is_layer_region
from .cpu_linear import NATIVE_MAX_ROWS, ROUTED_CODES, LinearPlan, _routed_codes, _shape
from .cpu_linear import _candidates as _linear_candidates
from .cpu_norm import NormPlan, _eps
from .cpu_rotary import RotaryPlan

logger = logging.getLogger("contbatch")

KERNELS = ("auto", "layer", "aten")  # the stack as one call where it can be, each layer, per module
DTYPES = (torch.float32, torch.bfloat16)
ONEDNN = ROUTED_CODES["onednn"]
ATEN_CODES = (0, 0, 0)  # routed_linear's codes of a plain nn.Linear: aten at every row count


def _no_window(layer: torch.nn.Module) -> int | None:
    return None


def _config_window(layer: torch.nn.Module) -> int | None:
    return getattr(layer.self_attn.config, "sliding_window", None)  # MistralAttention passes this


def _attention_window(layer: torch.nn.Module) -> int | None:
    return layer.self_attn.sliding_window  # Qwen2/3: set per layer type


# Decoder layer classes whose forward is Llama's, with where their attention reads its sliding
# window, and whether the attention normalises each head's q and k before the rotation.
CLASSES: dict[str, tuple[Callable[[torch.nn.Module], int | None], bool]] = {
    "LlamaDecoderLayer": (_no_window, False),
    "MistralDecoderLayer": (_config_window, False),
    "Qwen2DecoderLayer": (_attention_window, False),
    "Qwen3DecoderLayer": (_attention_window, True),
}
LINEARS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
           ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


@dataclass(frozen=True)
class LayerPlan:
    kernel: str  # what the user asked: auto, layer or aten
    layers: tuple[int, ...]  # indices (in model.modules() order) of the layers run as one call
    summary: str
    stack: bool = False  # all of them as one call (FusedStack), once each kind of step proved a chain


@dataclass(eq=False)
class FusedLayer:
    """What a layer's one call needs besides the step: its modules (their weights are read at
    every call, so replaced or updated parameters are never stale), routes and constants."""

    layer_idx: int
    norms: list[torch.nn.Module]  # input, post-attention[, q, k]
    linears: list[torch.nn.Module]  # q, k, v, o, gate, up, down
    codes: list[int]
    eps: list[float]
    scale: float
    window: int
    head_dim: int
    dtype: torch.dtype
    shared: "_Shared"
    previous: Callable | None = None  # the forward the layer had in its __dict__ (a compile region)
    position: int = -1  # its place in the model's stack of fused layers (-1: no stack)

    @functools.cached_property
    def variant(self) -> tuple:
        """What makes layers run different code: layers alike here are checked once for all."""
        return (self.window, self.head_dim, self.dtype, tuple(self.codes), len(self.norms),
                tuple(m.bias is None for m in self.linears), self.scale, tuple(self.eps))

    def own(self, layer: torch.nn.Module, *args, **kwargs) -> torch.Tensor:
        """The layer's forward without us: what compiled steps trace and other steps run."""
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(layer).forward(layer, *args, **kwargs)

    def __post_init__(self) -> None:
        # Parameters are read from the modules' own dicts at every call (~0.1 us each, against
        # ~0.6 us through nn.Module.__getattr__), so a replaced parameter is never stale.
        self._weights = [m._parameters for m in (self.norms[0], *self.linears[:4], self.norms[1], *self.linears[4:],
                                                   *self.norms[2:])]
        self._biases = [m._parameters for m in self.linears]
        self.known: set[tuple] = set()  # kinds of step this layer's variant passed the check in

    def weights(self) -> list[torch.Tensor]:
        return [d["weight"] for d in self._weights]

    def biases(self) -> list[torch.Tensor | None]:
        return [d.get("bias") for d in self._biases]

    def packed(self, regime: int) -> list[torch.Tensor | None]:
        """oneDNN's prepacked copies, for the linears that run oneDNN at this many rows (more
        than one: engine/cpu_linear.py)."""
        packed = [None] * len(self.linears)
        if regime:
            for i, m in enumerate(self.linears):
                holder = m.__dict__.get("_contbatch_packed")
                if holder is not None and self.codes[3 * i + regime] == ONEDNN:
                    packed[i] = holder.fresh(m.weight)
        return packed

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: "_StepInputs") -> torch.Tensor:
        return _one_call([self], self.codes, self.eps, [self.scale], [self.window], hidden, cos, sin, step)


def _one_call(layers: list[FusedLayer], codes: list[int], eps: list[float], scales: list[float],
              windows: list[int], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              step: "_StepInputs") -> torch.Tensor:
    """`layers` (consecutive ones, one or all) as one `decoder_stack` call; `codes`, `eps`,
    `scales` and `windows` are theirs, laid end to end."""
    regime = step.kind[0]
    caches = [step.cache.kv(f.layer_idx) for f in layers]
    return torch.ops.contbatch_cpu.decoder_stack(
        hidden, [w for f in layers for w in f.weights()], [b for f in layers for b in f.biases()],
        [p for f in layers for p in f.packed(regime)], codes, eps, cos, sin, [k for k, _ in caches],
        [v for _, v in caches], step.slots, *step.decode, *step.chunks, step.block_size, scales, windows,
        layers[0].head_dim)


@dataclass(eq=False)
class FusedStack:
    """Every decoder layer of the model as one call (`decoder_stack`), from the second step of
    each kind on: the model's own loop still calls each layer, the first runs them all and the
    others pass its output on. Used for a kind of step only once a step of that kind ran the
    layers one by one with every layer's check passed (`known`) and showed the model's loop to
    be a plain chain: each layer called once, in order, on the previous layer's output (a model
    that scales, adds or reorders between layers never gets here). `decoder_stack` calls the
    same C++ layer function as one call per layer does, layer after layer: bit-identical by
    construction."""

    layers: list[FusedLayer]
    modules: list[torch.nn.Module]
    kinds: set[tuple] = field(default_factory=set)  # kinds of step proven a plain chain
    chain: tuple = (None, None, -1)  # (step, last output, position) of the step running one by one
    done: tuple = (None, None)  # (step, output) of the stack's call in the step running now

    def __post_init__(self) -> None:
        self.codes = [c for f in self.layers for c in f.codes]
        self.eps = [e for f in self.layers for e in f.eps]
        self.scales = [f.scale for f in self.layers]
        self.windows = [f.window for f in self.layers]

    def ready(self, step: "_StepInputs") -> bool:
        return step.kind in self.kinds and not any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: "_StepInputs") -> torch.Tensor:
        out = _one_call(self.layers, self.codes, self.eps, self.scales, self.windows, hidden, cos, sin, step)
        self.done = (step, out)
        return out

    def pass_on(self, position: int) -> torch.Tensor:
        """A later layer's share of the stack's call in this step: the output, unchanged."""
        out = self.done[1]
        if position == len(self.layers) - 1:
            self.done = (None, None)
        return out

    def changed(self) -> None:
        """A later layer of a step whose stack ran was given another hidden state than the
        stack's output: the model's loop is not the chain it was, and this step's output is
        lost. The step fails; the following ones run the layers one by one until a step proves
        a chain again."""
        self.kinds.clear()
        self.done = (None, None)
        raise RuntimeError("contbatch: the decoder stack ran in one call, but a later layer was given another hidden "
                           "state (the model's loop changed): the step fails, the next ones run the layers one by one")

    def track(self, position: int, hidden: torch.Tensor, out: torch.Tensor, step: "_StepInputs") -> None:
        """Follows a step run one by one: a plain chain through every layer proves its kind."""
        chained = position == 0 or (self.chain[0] is step and self.chain[1] is hidden
                                     and self.chain[2] == position - 1)
        self.chain = (step, out, position) if chained else (None, None, -1)
        if chained and position == len(self.layers) - 1:
            self.chain = (None, None, -1)
            if all(step.kind in f.known for f in self.layers):
                self.kinds.add(step.kind)


@dataclass(eq=False)
class _Shared:
    """State of one manager's fused layers together: the (layer variant, kind of step) pairs
    checked against a layer's own forward, whether every check passed, and the last position
    embeddings seen (every layer of a step gets the same)."""

    checked: set[tuple] = field(default_factory=set)
    enabled: bool = True
    last_emb: tuple = (None, False)  # (cos tensor, whether our rotary takes it)
    stack: FusedStack | None = None


@dataclass(frozen=True)
class _StepInputs:
    """The step's attention inputs, as the torch backend planned them (`TorchStep`), and its
    kind: what decides the kernels it runs (the linears' row regime, the attention's parts)."""

    cache: object
    slots: torch.Tensor
    decode: tuple  # (block_table, kv_lens) of the leading decode rows, or (None, None)
    chunks: tuple  # (block_table, q_start, q_lens, kv_lens) of the prompt chunks, or four None
    block_size: int
    kind: tuple  # (row regime: 0 one row, 1 a few, 2 more; has decode rows; has prompt chunks)


def _step_inputs(meta) -> _StepInputs | None:
    """The step's attention inputs where every row takes our C++ attention (decode rows, then
    prompt chunks), else None; made once per step (kept on its metadata)."""
    cached = meta.__dict__.get("_contbatch_fused", False)
    if cached is not False:
        return cached
    inputs = None
    step = meta.prepared
    if (isinstance(meta.backend, TorchBackend) and not step.decode_groups and not step.prefill_rows
            and meta.write_slots.numel() == step.num_tokens and meta.cache.native_write
            and meta.cache.layout.calls_per_layer == 1):
        d, c, rows = step.decode_rows, step.prefill_chunks, step.num_tokens
        kind = (0 if rows == 1 else 1 if rows <= NATIVE_MAX_ROWS else 2, d is not None, c is not None)
        inputs = _StepInputs(meta.cache, meta.write_slots, (None, None) if d is None else (d.block_table, d.kv_lens),
                             (None,) * 4 if c is None else (c.block_table, c.q_start, c.q_lens, c.kv_lens),
                             meta.cache.block_size, kind)
    meta.__dict__["_contbatch_fused"] = inputs
    return inputs


def _hooked(m: torch.nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or getattr(m, "_backward_hooks", None))


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in CLASSES]


def _refusal(layer: torch.nn.Module, norm: NormPlan, rotary: RotaryPlan, linear: LinearPlan | None) -> str | None:
    """Why `layer` cannot run as one call (None: it can)."""
    name = type(layer).__name__
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    if CLASSES[name][1]:
        norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    parts = [attn, mlp, *norms, *(getattr(getattr(layer, a, None), n, None) for a, n in LINEARS)]
    if any(p is None for p in parts):
        return "a module is missing"
    act = getattr(mlp, "act_fn", None)
    if any(_hooked(m) for m in (layer, *parts, act) if m is not None) or any(
            "forward" in m.__dict__ for m in (attn, mlp, act, *norms) if m is not None) or (
            "forward" in layer.__dict__ and not is_layer_region(layer)):
        return "hooks or a patched forward"
    if type(act).__name__ not in ("SiLUActivation", "SiLU") or getattr(
            attn, "head_dim", None) is None or getattr(attn, "layer_idx", None) is None:
        return "not a gated SiLU MLP with a Llama attention"
    if any(type(n).__name__ not in norm.classes for n in norms):
        return "its norms are not fused"
    if type(layer).__module__ not in rotary.modules:
        return "its rotary is not fused"
    dtype = layer.input_layernorm.weight.dtype
    if dtype not in DTYPES or any(p.dtype != dtype or p.device.type != "cpu" for p in layer.parameters()):
        return "not float32 or bfloat16 CPU weights throughout"
    routes = dict(linear.routes) if linear is not None else {}
    candidates = set(map(id, _linear_candidates(layer)))
    for a, n in LINEARS:
        m = getattr(getattr(layer, a), n)
        if type(m) is not torch.nn.Linear or id(m) not in candidates:
            return f"{a}.{n} is not a plain nn.Linear"
        route = routes.get(_shape(m))
        if route is not None and _routed_codes(route) is None:
            return f"{a}.{n} runs the {'/'.join(route)} route"
    return None


def plan_layer(model: torch.nn.Module, kernel: str, linear: LinearPlan | None, norm: NormPlan | None,
               rotary: RotaryPlan | None, decode_kernel: bool,
               eager_paths: list[str] | tuple[str, ...] = ("decode", "varlen")) -> LayerPlan:
    """`eager_paths`: the step paths not compiled (compiled steps trace the layers' own forward)."""
    if kernel not in KERNELS:
        raise ValueError(f"cpu_layer_kernel must be one of {KERNELS}, got {kernel!r}")
    layers = _layers(model)
    if kernel == "aten" or not layers or not eager_paths:
        why = ("as asked" if kernel == "aten" else f"no {'/'.join(CLASSES)}" if not layers
               else "every step is compiled: Inductor compiles the layers' own forward")
        return LayerPlan(kernel, (), f"per module ({why})")
    ok, how = native.load()
    missing = ("C++ kernels " + how if not ok else "the decode fast path is off" if not decode_kernel
               else "the norms are not fused" if norm is None or not norm.classes
               else "the rotary is not fused" if rotary is None or not rotary.modules else None)
    if missing:
        return LayerPlan(kernel, (), f"per module ({missing})")
    index = {id(m): i for i, m in enumerate(model.modules())}
    fused, refused = [], {}
    for layer in layers:
        why = _refusal(layer, norm, rotary, linear)
        if why is None:
            fused.append(index[id(layer)])
        else:
            refused.setdefault(why, []).append(type(layer).__name__)
    names = sorted({type(m).__name__ for m in layers})
    where = "steps on our attention" if len(eager_paths) == 2 else f"eager {eager_paths[0]} steps on our attention"
    stack = kernel == "auto" and len(fused) > 1 and not refused and len(
        {(type(m), m.self_attn.head_dim, m.input_layernorm.weight.dtype) for m in layers}) == 1
    summary = (f"{len(fused)} {'/'.join(names)} as one call in {where} (checked bit-identical on each kind of "
               "step's first)" if fused else "per module") + "".join(
        f"; {len(v)} left to their own forward ({k})" for k, v in refused.items()) + (
        "; the whole stack as one call from each kind of step's second, once its first showed the model's loop a "
        "plain chain" if stack else "")
    return LayerPlan(kernel, tuple(fused), summary, stack)


def _fused_layer(layer: torch.nn.Module, linear: LinearPlan | None, shared: _Shared) -> FusedLayer:
    attn = layer.self_attn
    window_of, qk_norm = CLASSES[type(layer).__name__]
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([attn.q_norm, attn.k_norm] if qk_norm else [])
    linears = [getattr(getattr(layer, a), n) for a, n in LINEARS]
    routes = dict(linear.routes) if linear is not None else {}
    codes = []
    for m in linears:
        route = routes.get(_shape(m))
        codes += _routed_codes(route) if route is not None else ATEN_CODES
    window = window_of(layer)
    return FusedLayer(attn.layer_idx, norms, linears, codes, [_eps(n) for n in norms], float(attn.scaling),
                      int(window or 0), attn.head_dim, layer.input_layernorm.weight.dtype, shared)


def _routed_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    fused: FusedLayer = self._contbatch_fused
    shared = fused.shared
    stack = shared.stack
    if stack is not None and fused.position > 0 and stack.done[1] is hidden_states and ops.in_step():
        return stack.pass_on(fused.position)  # the stack's output, as this step's first layer returned it
    if not torch.compiler.is_compiling() and shared.enabled and ops.in_step():
        meta = kwargs.get("step_metadata")
        step = _step_inputs(meta if meta is not None and not isinstance(meta, str) else ops.active_step())
        emb = kwargs.get("position_embeddings")
        if step is not None and not args and hidden_states.dtype == fused.dtype and _plain_rotary(emb, fused):
            if stack is not None and fused.position > 0 and stack.done[0] is step:
                stack.changed()  # this step's stack ran, and this layer was given something else
            try:
                if stack is not None and fused.position == 0 and stack.ready(step):
                    return stack.run(hidden_states, emb[0], emb[1], step)
                out = fused.run(hidden_states, emb[0], emb[1], step)
            except RuntimeError as exc:  # a shape or layout the op refuses: never fail the step for it
                shared.enabled = False
                logger.error("contbatch: the one-call %s (layer %d) failed (%s): decoder layers run their own "
                             "forward for the rest of this manager", type(self).__name__, fused.layer_idx, exc)
                return fused.own(self, hidden_states, *args, **kwargs)
            if step.kind not in fused.known:
                kind = (type(self), fused.variant, step.kind)
                if kind in shared.checked:  # another layer of this variant passed it
                    fused.known.add(step.kind)
                else:
                    out = _check(self, fused, kind, out, hidden_states, kwargs)
            if stack is not None:
                stack.track(fused.position, hidden_states, out, step)
            return out
    return fused.own(self, hidden_states, *args, **kwargs)


def _plain_rotary(emb, fused: FusedLayer) -> bool:
    """Position embeddings as our rotary op takes them (what `cpu_rotary` fuses): [1, T, D]
    cos/sin over the whole head in the layer's dtype. Others (a partial rotary) run the layer's
    own forward. Every layer of a step gets the same tensors: decided once per step."""
    if not isinstance(emb, tuple) or len(emb) != 2:
        return False
    cos, sin = emb
    last, verdict = fused.shared.last_emb
    if cos is not last:
        verdict = (cos.dim() == 3 and cos.shape[0] == 1 and cos.shape[-1] == fused.head_dim
                   and cos.dtype == fused.dtype and sin.shape == cos.shape and sin.dtype == fused.dtype)
        fused.shared.last_emb = (cos, verdict)
    return verdict and cos.shape[-1] == fused.head_dim


def _check(layer: torch.nn.Module, fused: FusedLayer, kind: tuple, out: torch.Tensor, hidden: torch.Tensor,
           kwargs) -> torch.Tensor:
    """The first fused call of the layer's variant in a kind of step, against the layer's own
    forward: they must agree bit for bit. The own forward runs second, so the K/V it writes are
    what the cache keeps."""
    want = fused.own(layer, hidden, **kwargs)
    fused.shared.checked.add(kind)
    fused.known.add(kind[-1])
    if not torch.equal(out, want):
        diff = (out.float() - want.float()).abs().max().item()
        fused.shared.enabled = False
        logger.warning("contbatch: the one-call %s (layer %d) differs from its own forward (max |diff| %.3g): "
                       "decoder layers run their own forward for the rest of this manager",
                       type(layer).__name__, fused.layer_idx, diff)
    return want


class LayerRouter:
    """Installs the plan on a model's decoder layers for the life of a manager (after the
    linear, norm and rotary routers, whose kernels the fused layers call), and takes it back."""

    def __init__(self, model: torch.nn.Module, plan: LayerPlan, linear: LinearPlan | None) -> None:
        self.model = model
        self.plan = plan
        self.linear = linear
        self.modules: list[torch.nn.Module] = []
        self.shared = _Shared()

    def install(self) -> None:
        if not self.plan.layers or self.modules:
            return
        chosen = set(self.plan.layers)
        self.shared = _Shared()
        for i, m in enumerate(self.model.modules()):
            if i in chosen:
                m._contbatch_fused = _fused_layer(m, self.linear, self.shared)
                m._contbatch_fused.previous = m.__dict__.get("forward")  # a compile region stays one
                m.forward = types.MethodType(_routed_forward, m)
                self.modules.append(m)
        if self.plan.stack:
            for position, m in enumerate(self.modules):
                m._contbatch_fused.position = position
            self.shared.stack = FusedStack([m._contbatch_fused for m in self.modules], list(self.modules))

    @property
    def active(self) -> bool:
        """False once the first-step check found a difference."""
        return bool(self.modules) and self.shared.enabled

    def uninstall(self) -> None:
        for m in self.modules:
            previous = m.__dict__.pop("_contbatch_fused").previous
            m.__dict__.pop("forward", None)
            if previous is not None:
                m.forward = previous
        self.modules = []

