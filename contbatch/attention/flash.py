"""flash-attn's paged kernels behind the kernel backend's calls (see base.py).

flash-attn reads a token-major cache, `[num_blocks, block_size, H_kv, D]`, with block_size a
multiple of 256; the backend choice sets both. Its window is `(left, right)` with a key
visible when `q - k <= left`: our rule `q - k < window` is `left = window - 1`.
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from .metadata import StepMetadata


def _paged(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """Logical `[H_kv, slots, D]` view of a token-major tensor -> flash-attn's paged shape."""
    heads, _, dim = cache.shape
    return cache.transpose(0, 1).view(-1, block_size, heads, dim)


def _window(sliding_window: int | None) -> tuple[int, int]:
    return (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)


def flash_decode(q, k, v, meta: StepMetadata, scale: float, sliding_window: int | None, softcap: float | None):
    bs = meta.cache.block_size
    out = flash_attn_with_kvcache(
        q.unsqueeze(1), _paged(k, bs), _paged(v, bs), cache_seqlens=meta.kv_lens, block_table=meta.block_table,
        softmax_scale=scale, causal=True, window_size=_window(sliding_window), softcap=softcap or 0.0,
    )
    return out.squeeze(1)


def flash_varlen(q, k, v, meta: StepMetadata, scale: float, sliding_window: int | None, softcap: float | None):
    bs = meta.cache.block_size
    return flash_attn_varlen_func(
        q, _paged(k, bs), _paged(v, bs), meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_q_len, meta.max_kv_len,
        softmax_scale=scale, causal=True, window_size=_window(sliding_window), softcap=softcap or 0.0,
        block_table=meta.block_table,
    )
