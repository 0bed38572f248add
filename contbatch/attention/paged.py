"""Paged attention, plugged into `transformers` through its attention registry.

With flat metadata (`FlatMetadata`, the GPU layout) the call hands the step to the chosen
backend's kernels (`kernels.py`). With the torch path's metadata (`BatchMetadata`), two paths
share one call:
- decode rows (one query token each) run as one batched matmul against keys gathered from
  the paged cache through the block tables, with grouped-query heads folded so K/V are never
  repeated;
- prefill rows (prompt chunks) run through `scaled_dot_product_attention` one request at a
  time, so each attends only to its own keys and the work is real matrix work.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..cache.paged_cache import PagedAttentionCache
from .metadata import BatchMetadata, DecodeGroup, FlatMetadata, visible_keys

ATTENTION_NAME = "contbatch_paged"

# A 4-D mask makes `transformers` skip mask creation entirely (it returns 4-D masks as they
# are); the paged kernels build their own from the batch metadata and ignore this one.
ENGINE_MASK = torch.empty(1, 1, 0, 0)

# While a manager is attached, the model's own attention implementation, per config: calls
# made outside the engine (a user's `model.generate`) are handed to it unchanged.
# Keyed by id(): configs are unhashable. Entries live exactly from attach() to detach().
_fallbacks: dict[int, str] = {}


def _softmax_scores(scores: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    """Scale (and soft-cap, Gemma-2 style) raw scores in float32, before the mask."""
    scores = scores.float() * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def _decode_attention(
    query: torch.Tensor, group: DecodeGroup, cache: PagedAttentionCache, layer: int, scaling: float,
    sliding_window: int | None, softcap: float | None,
) -> torch.Tensor:
    """query: [H, B, D] for the B rows of a decode group; returns [B, H, D]."""
    num_heads, batch, head_dim = query.shape
    kv_heads = cache.layout.num_kv_heads
    keys, values = cache.gather(layer, group.kv_index)
    keys = keys.view(batch, kv_heads, group.kv_len, head_dim)
    values = values.view(batch, kv_heads, group.kv_len, head_dim)
    # Fold the query heads that share a KV head into one matrix: K/V are never repeated.
    q = query.transpose(0, 1).reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    scores = _softmax_scores(torch.matmul(q, keys.transpose(-1, -2)), scaling, softcap)
    scores = scores + group.mask(sliding_window)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).reshape(batch, num_heads, head_dim)


def _prefill_mask(q_len: int, kv_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return visible_keys(q_pos, torch.arange(kv_len, device=device)[None, :], sliding_window)


def _grouped_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scaling: float, softcap: float | None
) -> torch.Tensor:
    """Attention in plain matmuls, for what SDPA cannot express (soft-capping).
    q: [1, H, n, D]; k, v: [1, H_kv, L, D]; visible: [n, L]. Returns [1, H, n, D]."""
    _, num_heads, n, head_dim = q.shape
    kv_heads = k.shape[1]
    qg = q[0].reshape(kv_heads, num_heads // kv_heads, n, head_dim)
    scores = _softmax_scores(torch.matmul(qg, k[0].unsqueeze(1).transpose(-1, -2)), scaling, softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v[0].unsqueeze(1)).reshape(1, num_heads, n, head_dim)


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
    cb_meta: BatchMetadata | FlatMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query: [1, H, T, D]; key/value: [1, H_kv, T, D]; returns ([1, T, H, D], None)."""
    if cb_meta is None:  # a call from outside the engine: behave as the model did before
        extra = {k: v for k, v in (("sliding_window", sliding_window), ("softcap", softcap)) if v is not None}
        return _fallback_attention(module)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **extra, **kwargs
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("contbatch paged attention does not support attention sinks (s_aux) yet")
    meta = cb_meta
    layer = module.layer_idx
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    meta.cache.write(layer, meta.write_slots, key[0], value[0])
    if isinstance(meta, FlatMetadata):
        return _flat_attention(query, meta, layer, scaling, sliding_window, softcap), None

    _, num_heads, total, head_dim = query.shape
    out = query.new_empty(total, num_heads, head_dim)
    for group in meta.decode_groups:
        rows = slice(group.row_start, group.row_start + group.num_rows)
        out[rows] = _decode_attention(query[0, :, rows], group, meta.cache, layer, scaling, sliding_window, softcap)
    for row in meta.prefill_rows:
        s, n = row.q_start, row.q_len
        q = query[:, :, s : s + n]
        if row.kv_index is None:
            k, v = key[:, :, s : s + n], value[:, :, s : s + n]
        else:
            k, v = meta.cache.gather(layer, row.kv_index)
            k, v = k.view(1, -1, row.kv_len, head_dim), v.view(1, -1, row.kv_len, head_dim)
        if softcap is None and row.kv_index is None and sliding_window is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            mask = _prefill_mask(n, row.kv_len, sliding_window, query.device)
            if softcap is not None:
                o = _grouped_prefill(q, k, v, mask, scaling, softcap)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[s : s + n] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _flat_attention(
    query: torch.Tensor, meta: FlatMetadata, layer: int, scaling: float, sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Keys come from the cache only (this step's were just written): `[1, T, H, D]` out."""
    q = query[0].transpose(0, 1)  # [T, H, D]; contiguous, as the projections lay it out
    k_cache, v_cache = meta.cache.kv(layer)
    kernel = meta.kernels.decode if meta.decode_only and meta.kernels.decode is not None else meta.kernels.varlen
    return kernel(q, k_cache, v_cache, meta, scaling, sliding_window, softcap).unsqueeze(0)


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
