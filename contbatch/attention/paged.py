"""Paged attention, plugged into `transformers` through its attention registry.

Each attention call of the model writes the step's new K/V into the paged cache and hands the
layer to the backend chosen at start-up (`select.py`), with the step's `StepMetadata`. A call
without it comes from outside the engine (a user's `model.generate` while a manager is
attached) and goes to the attention the model had before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from .. import context
from . import ops  # noqa: F401  (registers torch.ops.contbatch.paged_attention)
from .metadata import StepMetadata, cache_layer

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
    """query: [1, H, T, D]; key/value: [1, H_kv, T, D]; returns ([1, T, H, D], None)."""
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
    if step_metadata is context.COMPILED_STEP:  # a compiled step: one opaque op; the step is in the context
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        window = -1 if sliding_window is None else sliding_window
        layer = getattr(module, "_contbatch_layer", None)  # a tensor where layers are compile regions
        if layer is not None:
            return torch.ops.contbatch.paged_attention_region(query, key, value, layer, scaling, window,
                                                              softcap or 0.0, sinks), None
        return torch.ops.contbatch.paged_attention(query, key, value, module.layer_idx, scaling, window,
                                                   softcap or 0.0, sinks), None
    meta = step_metadata
    layer = cache_layer(meta, module.layer_idx)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    meta.cache.write(layer, meta.write_slots, key[0], value[0])
    return meta.backend.attend(query, key, value, meta, layer, scaling, sliding_window, softcap, sinks), None


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
    return ATTENTION_NAME in (model.config._attn_implementation, text_config(model)._attn_implementation)


def attach(model: torch.nn.Module) -> str:
    """Route the model's (text decoder's) attention through us; returns the implementation it had."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _fallback_mask)
    if is_attached(model):
        raise RuntimeError("this model is already attached to a running contbatch manager")
    original = model.config._attn_implementation
    configs = {id(c): c for c in (model.config, text_config(model))}
    for key, config in configs.items():
        _fallbacks[key] = config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    if text_config(model)._attn_implementation != ATTENTION_NAME:
        for key in configs:
            _fallbacks.pop(key, None)
        raise RuntimeError(f"{type(model).__name__} does not accept a custom attention implementation")
    return original


def detach(model: torch.nn.Module, original: str) -> None:
    model.set_attn_implementation(original)
    for config in (model.config, text_config(model)):
        _fallbacks.pop(id(config), None)
