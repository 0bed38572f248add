"""Paged attention, plugged into `transformers` through its attention registry.

Each attention call of the model writes the step's new K/V into the paged cache and hands the
layer to the backend chosen at start-up (`select.py`), with the step's `StepMetadata`. A call
without it comes from outside the engine (a user's `model.generate` while a manager is
attached) and goes to the attention the model had before. Keys and values of different head
dims (latent attention) are padded to one (`equal_head_dims`) before anything sees them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import context
from . import ops  # noqa: F401  (registers torch.ops.contbatch.paged_attention)
from . import recurrent
from .metadata import StepMetadata, cache_layer
from .temperature import tempered_query

ATTENTION_NAME = "contbatch_paged"

# A 4-D mask makes `transformers` skip mask creation entirely (it returns 4-D masks as they
# are); the backends build what they need from the step metadata and ignore this one.
ENGINE_MASK = torch.empty(1, 1, 0, 0)

# While a manager is attached, the model's own attention implementation, per config: calls
# made outside the engine (a user's `model.generate`) are handed to it unchanged.
# Keyed by id(): configs are unhashable. Entries live exactly from attach() to detach().
_fallbacks: dict[int, str] = {}


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    step_metadata: StepMetadata | str | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query and key: [1, H, T, Dk] and [1, H_kv, T, Dk]; value: [1, H_kv, T, Dv]; returns
    ([1, T, H, Dv], None)."""
    if step_metadata is None and not torch.compiler.is_compiling():
        # Layers that drop `**kwargs` on the way down lose the kwarg: the step is on the thread.
        step_metadata = context.active_step()
    if step_metadata is None:  # a call from outside the engine: behave as the model did before
        extra = {k: v for k, v in (("sliding_window", sliding_window), ("softcap", softcap)) if v is not None}
        return _fallback_attention(module)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **extra, **kwargs
        )
    # Attention sinks (gpt-oss): one learned logit per query head, in every softmax denominator.
    sinks = kwargs.get("s_aux")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5  # before any padding
    value_dim = value.shape[-1]
    query, key, value = equal_head_dims(query, key, value)
    out = _attend_step(module, query, key, value, step_metadata, scaling, sliding_window, softcap, sinks)
    return (out if out.shape[-1] == value_dim else out[..., :value_dim]), None


def equal_head_dims(query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q/K and V at one head dim, the larger (the cache's `LayerKV.width`): latent attention's
    keys are wider than its values (zero value columns, sliced off the output, change nothing),
    and a value wider than the keys gets zero query and key columns (which add nothing to any
    score). Equal dims pass through untouched."""
    dk, dv = key.shape[-1], value.shape[-1]
    if dk == dv:
        return query, key, value
    width = max(dk, dv)
    pad = [F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (query, key, value)]
    return pad[0], pad[1], pad[2]


def _attend_step(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 step_metadata: StepMetadata | str, scaling: float, sliding_window: int | None,
                 softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The step's attention of one layer: `[1, T, H, D]` at the (equal) head dim of q, k, v."""
    if step_metadata is context.COMPILED_STEP:  # a compiled step: one opaque op; the step is in the context
        window = -1 if sliding_window is None else sliding_window
        layer = getattr(module, "_contbatch_layer", None)  # a tensor where layers are compile regions
        if layer is not None:
            return torch.ops.contbatch.paged_attention_region(query, key, value, layer, scaling, window,
                                                              softcap or 0.0, sinks)
        return torch.ops.contbatch.paged_attention(query, key, value, module.layer_idx, scaling, window,
                                                   softcap or 0.0, sinks)
    meta = step_metadata
    layer = cache_layer(meta, module.layer_idx)
    meta.cache.write(layer, meta.write_slots, key[0], value[0])
    query = tempered_query(query, meta, layer)
    return meta.backend.attend(query, key, value, meta, layer, scaling, sliding_window, softcap, sinks)


def _fallback_attention(module: torch.nn.Module) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = _fallbacks.get(id(module.config), "sdpa")
    if name == "eager":  # eager lives in each modeling file, not in the registry
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _fallback_mask(*args, config=None, **kwargs):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    name = _fallbacks.get(id(config), "sdpa")
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name, sdpa_mask)
    return mask_fn(*args, config=config, **kwargs)


def text_config(model: torch.nn.Module):
    """The config of the text decoder, whose attention the engine runs (the model's own
    config, but for composite models: a vision tower may keep its own attention)."""
    try:
        return model.config.get_text_config(decoder=True)
    except Exception:  # several candidates: the engine serves the model's own config
        return model.config


def is_attached(model: torch.nn.Module) -> bool:
    return ATTENTION_NAME in (model.config._attn_implementation, text_config(model)._attn_implementation) or \
        model.__dict__.get(_ATTACHED_FREE, False)


_ATTACHED_FREE = "_contbatch_attached"  # an attention-free model's mark while attached


def attach(model: torch.nn.Module) -> str:
    """Route the model's (text decoder's) attention through us; returns the implementation it had."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _fallback_mask)
    if is_attached(model):
        raise RuntimeError("this model is already attached to a running contbatch manager")
    original = model.config._attn_implementation
    if recurrent.attention_free(model):  # no attention to route: only its mixers take engine steps
        recurrent.install(model)
        model.__dict__[_ATTACHED_FREE] = True
        return original
    configs = {id(c): c for c in (model.config, text_config(model))}
    for key, config in configs.items():
        _fallbacks[key] = config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    if text_config(model)._attn_implementation != ATTENTION_NAME:
        for key in configs:
            _fallbacks.pop(key, None)
        raise RuntimeError(f"{type(model).__name__} does not accept a custom attention implementation")
    recurrent.install(model)
    return original


def detach(model: torch.nn.Module, original: str) -> None:
    recurrent.remove(model)
    if model.__dict__.pop(_ATTACHED_FREE, False):
        return
    model.set_attn_implementation(original)
    for config in (model.config, text_config(model)):
        _fallbacks.pop(id(config), None)
