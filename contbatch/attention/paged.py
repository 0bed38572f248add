"""Paged attention, plugged into `transformers` through its attention registry.

Each attention call of the model writes the step's new K/V into the paged cache and hands the
layer to the backend chosen at start-up (`kernels.py`), with the step's `StepMetadata`. A call
without it comes from outside the engine (a user's `model.generate` while a manager is
attached) and goes to the attention the model had before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from . import ops  # noqa: F401  (registers torch.ops.contbatch.paged_attention)
from .metadata import StepMetadata

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
        step_metadata = ops.active_step()
    if step_metadata is None:  # a call from outside the engine: behave as the model did before
        extra = {k: v for k, v in (("sliding_window", sliding_window), ("softcap", softcap)) if v is not None}
        return _fallback_attention(module)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **extra, **kwargs
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("contbatch paged attention does not support attention sinks (s_aux) yet")
    if step_metadata is ops.COMPILED_STEP:  # a compiled step: one opaque op; the step is in `current_step`
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        window = -1 if sliding_window is None else sliding_window
        return torch.ops.contbatch.paged_attention(query, key, value, module.layer_idx, scaling, window,
                                                   softcap or 0.0), None
    meta = step_metadata
    layer = module.layer_idx
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    meta.cache.write(layer, meta.write_slots, key[0], value[0])
    return meta.backend.attend(query, key, value, meta, layer, scaling, sliding_window, softcap), None


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


def attach(model: torch.nn.Module) -> str:
    """Route the model's attention through us; returns the implementation it had."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _fallback_mask)
    original = model.config._attn_implementation
    if original == ATTENTION_NAME:
        raise RuntimeError("this model is already attached to a running contbatch manager")
    _fallbacks[id(model.config)] = original
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        _fallbacks.pop(id(model.config), None)
        raise RuntimeError(f"{type(model).__name__} does not accept a custom attention implementation")
    return original


def detach(model: torch.nn.Module, original: str) -> None:
    model.set_attn_implementation(original)
    _fallbacks.pop(id(model.config), None)
