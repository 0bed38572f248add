"""Llama-family decoder layers as one C++ call inside engine steps (`ops.decoder_stack`).

The fused layer calls the same kernels in the same order with the same arguments as the layer's
own forward under the other routers, so its output is bit-identical. That is checked, not
assumed: the first time a layer of each variant (class, window, routes, biases) runs fused in
each kind of step (one row, a few, many; decode rows, prompt chunks or both), it runs its own
forward too and the two are compared bit for bit; on any difference, or an op that refuses its
arguments, every layer goes back to its own forward for the life of that manager, with a
warning. From each kind of step's second, the whole stack can run as one call (`FusedStack`,
fused_layer.py), where the plan allows it ("auto") and no layer has hooks.

It covers the decoder layer classes whose forward is Llama's (CLASSES: norm, q/k/v projections,
optional per-head q/k norms, rotary, attention, output projection, residual, norm, gated SiLU
MLP, residual), in steps whose rows all take our C++ attention (the torch backend's decode and
prefill kernels); other steps run the layer's own forward. A layer qualifies only where every
piece of it already runs on our kernels or as aten does (its norm class and its modeling file's
rotary fused, its linears routed through `routed_linear`, plain `nn.Linear` or packed
`QuantLinear`, run by `quant_linear` as its forward does), and nothing
else is attached to it (hooks, a patched forward other than its compile region): the start-up
line says which layers were left alone and why. LoRA adapters are the exception: the call asks
each linear's LoRA hook for its factors and adds the contribution by the hook's own ops
(a step with adapter rows is a kind of step of its own, checked as the others). Compiled steps
trace the layer's own forward.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import native, ops
from ... import context
from ..quant.linear import QuantLinear
from . import model_forward
from .base import Router
from .fused_layer import FusedLayer, FusedStack, Held, SharedState, step_inputs
from .linear import LinearPlan, candidates as linear_candidates, routed_codes, shape_of
from .norm import NormPlan, eps_of
from .rotary import RotaryPlan

logger = logging.getLogger("contbatch")

KERNELS = ("auto", "layer", "off")  # the stack as one call where it can be, each layer, per module
DTYPES = (torch.float32, torch.bfloat16)
ATEN_CODES = (0,) * ops.ROW_REGIMES  # routed_linear's codes of a plain nn.Linear: aten at every row count
QUANT_CODES = (ops.QUANT_CODE,) * ops.ROW_REGIMES  # a packed linear: quant_linear at every row count, as QuantLinear runs
# Set by the engine's compile code on the function it puts in a decoder layer's `forward` to make
# it a compile region: the layer class whose forward the region wraps.
LAYER_REGION = "_contbatch_layer_region"


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


def _hooked(m: torch.nn.Module) -> bool:
    """Whether something the one call would skip is attached (LoRA hooks are not: it runs them)."""
    return bool(not _lora_only(m) or m._forward_pre_hooks or getattr(m, "_backward_hooks", None))


def _lora_only(m: torch.nn.Module) -> bool:
    """Whether every forward hook of `m` is a LoRA hook (lora/hooks.py): one whose contribution
    the one call adds itself, from the factors the hook gives (`lora_factors`)."""
    return all(hasattr(hook, "lora_factors") for hook in m._forward_hooks.values())


def _compile_region(layer: torch.nn.Module) -> bool:
    """Whether the layer's own forward was replaced by its compile region (LAYER_REGION)."""
    current = layer.__dict__.get("forward")
    return getattr(getattr(current, "__func__", None), LAYER_REGION, None) is type(layer)


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
            "forward" in layer.__dict__ and not _compile_region(layer)):
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
    candidates = set(map(id, linear_candidates(layer)))
    for a, n in LINEARS:
        m = getattr(getattr(layer, a), n)
        if type(m) is QuantLinear:
            if not m.native or m.codes.device.type != "cpu":
                return f"{a}.{n} is a packed linear without our C++ kernels"
            continue
        if type(m) is not torch.nn.Linear or id(m) not in candidates:
            return f"{a}.{n} is not a plain nn.Linear"
        route = routes.get(shape_of(m))
        if route is not None and routed_codes(route) is None:
            return f"{a}.{n} runs the {'/'.join(route)} route"
    return None


def plan_layer(model: torch.nn.Module, kernel: str, linear: LinearPlan | None, norm: NormPlan | None,
               rotary: RotaryPlan | None, decode_kernel: bool,
               eager_paths: Sequence[str] = ("decode", "varlen")) -> LayerPlan:
    """`decode_kernel`: decode rows take our C++ attention; `eager_paths`: the step paths not
    compiled (compiled steps trace the layers' own forward)."""
    if kernel not in KERNELS:
        raise ValueError(f"the layer kernel must be one of {KERNELS}, got {kernel!r}")
    layers = _layers(model)
    if kernel == "off" or not layers or not eager_paths:
        why = ("as asked" if kernel == "off" else f"no {'/'.join(CLASSES)}" if not layers
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


def _fused_layer(layer: torch.nn.Module, linear: LinearPlan | None, shared: SharedState) -> FusedLayer:
    attn = layer.self_attn
    window_of, qk_norm = CLASSES[type(layer).__name__]
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([attn.q_norm, attn.k_norm] if qk_norm else [])
    linears = [getattr(getattr(layer, a), n) for a, n in LINEARS]
    routes = dict(linear.routes) if linear is not None else {}
    codes = []
    for m in linears:
        if type(m) is QuantLinear:
            codes += QUANT_CODES
            continue
        route = routes.get(shape_of(m))
        codes += routed_codes(route) if route is not None else ATEN_CODES
    window = window_of(layer)
    return FusedLayer(attn.layer_idx, norms, linears, codes, [eps_of(n) for n in norms], float(attn.scaling),
                      int(window or 0), attn.head_dim, layer.input_layernorm.weight.dtype, shared)


def _routed_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    fused: FusedLayer = self._contbatch_fused
    shared = fused.shared
    stack = shared.stack
    if stack is not None and fused.position > 0 and stack.done[1] is hidden_states and shared.in_step():
        return stack.pass_on(fused.position)  # the stack's output, as this step's first layer returned it
    if not torch.compiler.is_compiling() and shared.enabled and shared.in_step():
        meta = kwargs.get("step_metadata")
        step = step_inputs(meta if meta is not None and not isinstance(meta, str) else shared.active_step())
        emb = kwargs.get("position_embeddings")
        # A linear with a forward hook other than a LoRA one (lora/hooks.py, run by the call) must run:
        # its layer takes its own forward.
        plain = not args and all(_lora_only(m) for m in fused.linears)
        if step is not None and plain and hidden_states.dtype == fused.dtype and _plain_rotary(emb, fused):
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
    """Position embeddings as our rotary op takes them (what the rotary router fuses): [1, T, D]
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


class LayerRouter(Router):
    """Installs the plan on a model's decoder layers for the life of a manager (after the
    linear, norm and rotary routers, whose kernels the fused layers call), and takes it back."""

    def __init__(self, model: torch.nn.Module, plan: LayerPlan, linear: LinearPlan | None) -> None:
        self.model = model
        self.plan = plan
        self.linear = linear
        self.modules: list[torch.nn.Module] = []
        self.forwards: list[torch.nn.Module] = []  # the decoder and causal LM given a step forward
        self.shared = self._new_shared()

    def _new_shared(self) -> SharedState:
        return SharedState(context.in_step, context.active_step)

    def install(self) -> None:
        if not self.plan.layers or self.modules:
            return
        chosen = set(self.plan.layers)
        self.shared = self._new_shared()
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
            self.forwards = model_forward.install(self.model, self.shared, self.modules[0])

    def uninstall(self) -> None:
        model_forward.uninstall(self.forwards)
        self.forwards = []
        if self.shared.stack is not None:  # its C++ lists hold the manager's cache: let it go with it
            self.shared.stack.held = Held()
        for m in self.modules:
            previous = m.__dict__.pop("_contbatch_fused").previous
            m.__dict__.pop("forward", None)
            if previous is not None:
                m.forward = previous
        self.modules = []
