"""The support probe's checks of each layer's attention against the KV layout (`cache/layout.py`).

Each check returns the reason the engine cannot serve the model exactly, or None; the support
probe (`support.py`) words the refusal. Three kinds of layer need more than "every layer is
alike":
- per-layer shapes (Gemma 4, MiMo-V2-Flash, a hybrid's layers without KV): every attention
  call must receive the KV heads and the key and value head dims its cache layer is laid out
  for;
- latent attention (DeepSeek-V2/V3 and kin): keys and values of different head dims, which the
  cache stores at one width (the attention function pads the narrower);
- chunked local attention (Llama 4): the attention call carries no chunk, the model applies it
  through its own mask, which the engine replaces. So the chunk comes from the config, and the
  check evaluates transformers' own chunked mask function at that chunk size across chunk
  boundaries against the rule every backend applies (`attention/metadata.py`'s
  `visible_keys`). Llama 4's temperature tuning of its no-rope layers scales queries by
  their position as counted by its own cache, which the engine does not pass (a step's rows
  count from 0): the engine scales them itself from the true positions
  (`attention/temperature.py`), which is exact while the model's own count leaves them
  unscaled, i.e. while a step holds fewer than `floor_scale` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..attention.metadata import visible_keys
from ..cache.layout import CHUNKED_LAYER_TYPE, KVLayout


def call_shape_mismatch(layer_idx: int, cache_layer: int, kv_heads: int, key_dim: int, value_dim: int,
                        layout: KVLayout) -> str | None:
    """Why an attention call of `layer_idx` does not fit its cache layer's shape (None: it fits)."""
    shape = layout.layer(cache_layer)
    if (kv_heads, key_dim, value_dim) == (shape.kv_heads, shape.key_dim, shape.value_dim):
        return None
    return (f"layer {layer_idx} attends with {kv_heads} KV heads of key dim {key_dim} and value dim {value_dim}, "
            f"but its config says {shape.kv_heads} of key dim {shape.key_dim} and value dim {shape.value_dim} "
            "(the cache would be laid out wrong)")


def chunk_mismatch(text, layer_types: Sequence[str], layout: KVLayout) -> str | None:
    """Why the chunked layers cannot be served as the layout chunks them (None: they can)."""
    chunked = [i for i, kind in enumerate(layer_types) if kind == CHUNKED_LAYER_TYPE]
    if not chunked:
        return None
    size = getattr(text, "attention_chunk_size", None)
    if not isinstance(size, int) or size < 1:
        return f"its chunked-attention layers have no usable config.attention_chunk_size ({size!r})"
    calls = layout.calls_per_layer
    for i in chunked:
        got = {layout.layer(i * calls + n).chunk for n in range(calls)}
        if got != {size}:
            return f"layer {i} is chunked by {size} positions in its config, but the cache layout chunks it by {got}"
    return _mask_mismatch(size)


def _mask_mismatch(size: int) -> str | None:
    """transformers' chunked causal mask at `size`, on queries around the first chunk borders,
    against `visible_keys`."""
    from transformers.masking_utils import chunked_causal_mask_function

    mask_fn = chunked_causal_mask_function(size, torch.zeros(1, dtype=torch.long))
    q = torch.tensor(sorted({0, size - 1, size, size + 1, 2 * size - 1, 2 * size}))[:, None]
    k = torch.arange(2 * size + 1)[None, :]
    theirs = mask_fn(0, 0, q, k)
    ours = visible_keys(q, k, None, size)
    if not torch.equal(theirs.expand_as(ours), ours):
        return (f"transformers' chunked mask at attention_chunk_size={size} differs from the chunks the engine "
                "applies (a query sees the keys of its own aligned chunk)")
    return None


def temperature_tuning_mismatch(text, layout: KVLayout, max_step_tokens: int) -> str | None:
    """Llama 4's query temperature on no-rope layers (module docstring): None when the layout
    tempers exactly the config's no-rope layers and a step's rows stay below `floor_scale`."""
    if not getattr(text, "attn_temperature_tuning", False):
        return None
    no_rope = [i for i, rope in enumerate(getattr(text, "no_rope_layers", None) or []) if not rope]
    if not no_rope:
        return None
    floor = getattr(text, "floor_scale", None)
    calls = layout.calls_per_layer
    tempered = sorted({i // calls for i, s in enumerate(layout.layers) if s.temperature})
    if not isinstance(floor, int) or floor < 1 or tempered != no_rope:
        return (f"its no-rope layers {no_rope[:4]} scale queries by position (config.attn_temperature_tuning), "
                f"but the cache layout tempers layers {tempered[:4]} with floor_scale {floor!r}")
    if max_step_tokens < floor:
        return None
    return (f"its no-rope layers ({no_rope[:4]}) scale queries by a temperature of the position its own cache "
            f"counts (config.attn_temperature_tuning), which an engine step cannot pass; the engine applies it "
            f"itself while a step's own count leaves queries unscaled, below floor_scale={floor} tokens, but a "
            f"step may hold {max_step_tokens} (set max_batch_tokens below {floor})")
