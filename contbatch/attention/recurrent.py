"""Recurrent sequence mixers in an engine step: what paged attention is to attention layers.

A step packs every request's tokens into one row. Attention reads each request's keys through
its block table; a recurrent mixer (Mamba, Gated DeltaNet, a short convolution) instead scans
its input in order, carrying a state, so it must see each request's tokens apart, starting
from that request's state. While a manager is attached, every module whose forward takes
transformers' recurrent cache API (`get_conv_state`, `update_recurrent_state`, ...) has its
forward wrapped (`install`): outside an engine step it runs unchanged; inside one, the
wrapper runs the module's own forward per group of rows, each group handed a `StateView` (a
cache with exactly that API) holding its requests' states from the `RecurrentStateCache`,
and writes the states back after. Groups: all continuing decode rows (one token each) in one
batch, and each prompt chunk (or a request's first token) alone. The layer's math is the
module's own, fed as `generate` feeds it (batch rows, its own cache object semantics:
transformers' `LinearAttentionLayer` does the padding and window updates), so tokens match.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass, field

import torch

from ..cache.recurrent_state import LayerStates, RecurrentStateCache
from ..context import active_step

# The cache API a recurrent mixer calls (transformers' Cache, linear-attention part).
STATE_API = ("get_conv_state", "update_conv_state", "get_recurrent_state", "update_recurrent_state",
             "get_linear_cache", "set_linear_cache")  # the last two: MiniMax's cache, one state per layer
RECURRENT_ONLY_TYPES = ("linear_attention", "conv")  # layer types without any attention
CACHE_PARAMS = ("cache", "cache_params", "past_key_values")
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "step_metadata")
# State indices a view offers per layer (transformers' layers keep one to three).
NUM_STATES = 8
_WRAPPED = "_contbatch_recurrent_forward"
_local = threading.local()  # inside a group's forward: nested mixers run as they are


@dataclass
class RecurrentStep:
    """A step's requests as the recurrent mixers need them: host-side row bounds in the
    packed step, each request's state slot, and the groups the mixers run."""

    store: RecurrentStateCache
    bounds: list[tuple[int, int]]  # per request: [start, end) rows of the packed step
    slots: list[int]
    continuing: list[bool]  # the request computed tokens before this step (its state is stored)
    groups: list[list[int]] = field(default_factory=list)  # request indices run together
    group_slots: list[torch.Tensor] = field(default_factory=list)  # per group, its slots (made once per step)
    group_rows: list[torch.Tensor | None] = field(default_factory=list)  # per batched group, its rows

    def __post_init__(self) -> None:
        decode = [i for i, (a, b) in enumerate(self.bounds) if b - a == 1 and self.continuing[i]]
        rest = [[i] for i, (a, b) in enumerate(self.bounds) if not (b - a == 1 and self.continuing[i]) and b > a]
        self.groups = ([decode] if decode else []) + rest
        device = self.store.device
        self.group_slots = [torch.tensor([self.slots[i] for i in g], dtype=torch.long, device=device)
                            for g in self.groups]
        self.group_rows = [torch.tensor([self.bounds[i][0] for i in g], dtype=torch.long, device=device)
                           if len(g) > 1 else None for g in self.groups]


def recurrent_step(store: RecurrentStateCache, batch) -> RecurrentStep:
    """The step's requests in row order (`batch`: a StepBatch): a request computing its first
    token gets a clean slot, one continuing keeps its own."""
    bounds, slots, continuing, row = [], [], [], 0
    for chunk in batch.chunks:
        state = chunk.state
        bounds.append((row, row + chunk.num_tokens))
        row += chunk.num_tokens
        fresh = state.num_computed_tokens == 0
        slots.append(store.assign(state.request_id) if fresh else store.slot(state.request_id))
        continuing.append(not fresh)
    return RecurrentStep(store, bounds, slots, continuing)


class StateView:
    """The cache a recurrent mixer sees for one group of requests: transformers' own
    `LinearAttentionLayer` per layer, seeded from the requests' stored rows."""

    def __init__(self, store: RecurrentStateCache, slots: torch.Tensor, continuing: bool) -> None:
        from transformers.cache_utils import LinearAttentionLayer

        self._layer_cls = LinearAttentionLayer
        self.store, self.slots, self.continuing = store, slots, continuing
        self.layers: dict[int, object] = {}

    def _layer(self, layer_idx: int):
        layer = self.layers.get(layer_idx)
        if layer is not None:
            return layer
        layer = self.layers[layer_idx] = self._layer_cls(number_of_states=NUM_STATES)
        if self.continuing:
            prev = self.store.read(layer_idx, self.slots)
            for i, t in prev.conv.items():
                layer.conv_states[i], layer.is_conv_states_initialized[i] = t, True
                layer.conv_kernel_size[i] = prev.kernel_size.get(i, t.shape[-1])
                layer.dtype, layer.device = t.dtype, t.device
            for i, t in prev.recurrent.items():
                layer.recurrent_states[i], layer.is_recurrent_states_initialized[i] = t, True
            layer.has_previous_state = dict.fromkeys(range(NUM_STATES), True)
        return layer

    # -- transformers' recurrent cache API ---------------------------------------------------
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        layer = self._layer(layer_idx)
        return layer.conv_states[state_idx] if layer.has_previous_state[state_idx] else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        layer = self._layer(layer_idx)
        return layer.recurrent_states[state_idx] if layer.has_previous_state[state_idx] else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          **kwargs) -> torch.Tensor:
        return self._layer(layer_idx).update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        return self._layer(layer_idx).update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is None or state_idx is None:
            return self.continuing
        return self._layer(layer_idx).has_previous_state[state_idx]

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        return self.get_recurrent_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        self.update_recurrent_state(state, layer_idx)

    def commit(self) -> None:
        """Store the group's new states, row for row."""
        for layer_idx, layer in self.layers.items():
            conv = {i: t for i, t in layer.conv_states.items() if t is not None}
            recurrent = {i: t for i, t in layer.recurrent_states.items() if t is not None}
            if conv or recurrent:
                kernel = {i: layer.conv_kernel_size[i] for i in conv}
                self.store.write(layer_idx, self.slots, LayerStates(conv, recurrent, kernel))


# -- finding and wrapping the mixers ---------------------------------------------------------
def is_recurrent_mixer(module: torch.nn.Module) -> bool:
    """Its forward calls transformers' recurrent cache API itself."""
    return any(f".{name}(" in forward_source(type(module)) for name in STATE_API)


@functools.lru_cache(maxsize=None)
def forward_source(cls: type) -> str:
    """The source of a module class's forward ("" when it has none to read), read once per
    class: a model has hundreds of modules of a few classes."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def recurrent_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if is_recurrent_mixer(m)]


def attention_free(model: torch.nn.Module) -> bool:
    """Every layer of the model is recurrent (Mamba): nothing to route through paged attention.
    The one rule for the support check and for attaching, so the two always agree."""
    try:
        text = model.config.get_text_config(decoder=True)
    except Exception:
        text = model.config
    types = list(getattr(text, "layer_types", None) or [])
    return bool(types) and all(t in RECURRENT_ONLY_TYPES for t in types) and bool(recurrent_mixers(model))


def install(model: torch.nn.Module) -> int:
    """Wrap every recurrent mixer's forward; returns how many. Idempotent."""
    mixers = recurrent_mixers(model)
    for module in mixers:
        if _WRAPPED not in module.__dict__:
            original = module.forward
            module.__dict__[_WRAPPED] = original
            module.forward = _wrapper(module, original)
    return len(mixers)


def remove(model: torch.nn.Module) -> None:
    for module in model.modules():
        if _WRAPPED in module.__dict__:
            del module.__dict__[_WRAPPED]
            module.__dict__.pop("forward", None)


def _wrapper(module: torch.nn.Module, original):
    signature = inspect.signature(original)
    names = list(signature.parameters)
    cache_name = next((n for n in CACHE_PARAMS if n in signature.parameters), None)
    if cache_name is None or not names:
        raise ValueError(f"{type(module).__name__}.forward takes no cache argument ({CACHE_PARAMS})")
    hidden_name = names[0]

    def forward(*args, **kwargs):
        meta = active_step()
        step = getattr(meta, "recurrent", None) if meta is not None else None
        if step is None or getattr(_local, "inside", False):
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        extra = dict(arguments.pop(next((n for n, p in signature.parameters.items()
                                         if p.kind is p.VAR_KEYWORD), "\0"), {}))
        for key in PACKED_KWARGS:
            extra.pop(key, None)
        hidden = arguments.pop(hidden_name)
        arguments.pop(cache_name, None)
        if "attention_mask" in signature.parameters:
            arguments["attention_mask"] = None
        return run_groups(original, step, hidden, hidden_name, cache_name, {**arguments, **extra})

    return forward


def run_groups(original, step: RecurrentStep, hidden: torch.Tensor, hidden_name: str, cache_name: str,
               kwargs: dict):
    """The mixer over a packed step `[1, T, H]`, group by group; rows of no request (padding)
    come out zero. The mixer may return a tensor `[rows, t, ...]` or a tuple of them: each is
    stitched back into the packed rows (anything else in the tuple comes back as None)."""
    outs: list | None = None
    single = True
    total = hidden.shape[1]
    for group, slots, index in zip(step.groups, step.group_slots, step.group_rows):
        if len(group) == 1:
            a, b = step.bounds[group[0]]
            rows, x = slice(a, b), hidden[:, a:b]
            view = StateView(step.store, slots, step.continuing[group[0]])
            args = {k: _rows(v, total, rows, batched=False) for k, v in kwargs.items()}
        else:
            rows, x = index, hidden[0].index_select(0, index).unsqueeze(1)
            view = StateView(step.store, slots, True)
            args = {k: _rows(v, total, index, batched=True) for k, v in kwargs.items()}
        _local.inside = True
        try:
                y = original(**{hidden_name: x, cache_name: view}, **args)
        finally:
            _local.inside = False
        view.commit()
        single = not isinstance(y, tuple)
        ys = (y,) if single else y
        shape = (x.shape[0], x.shape[1])
        per_token = [isinstance(t, torch.Tensor) and t.ndim >= 2 and tuple(t.shape[:2]) == shape for t in ys]
        if outs is None:  # what is not per token (a layer's final state, weights) is not returned
            outs = [hidden.new_zeros((1, total, *t.shape[2:]), dtype=t.dtype) if tok else None
                    for t, tok in zip(ys, per_token)]
        for out, t, tok in zip(outs, ys, per_token):
            if not tok or out is None:
                continue
            if len(group) == 1:
                out[:, rows] = t
            else:
                out[0].index_copy_(0, rows, t[:, 0])
    if outs is None:  # nothing but padding in this step
        return hidden.new_zeros(hidden.shape)
    return outs[0] if single else tuple(outs)


def _rows(value, total: int, rows, batched: bool):
    """A per-token argument (`[1, T, ...]` or `[T]`) cut to a group's rows; others as they are."""
    if isinstance(value, tuple):
        return tuple(_rows(v, total, rows, batched) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.ndim >= 2 and value.shape[0] == 1 and value.shape[1] == total:
        return value[0].index_select(0, rows).unsqueeze(1) if batched else value[:, rows]
    if value.ndim == 1 and value.shape[0] == total:
        return value.index_select(0, rows)[:1] if batched else value[rows]
    return value
