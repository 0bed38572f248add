"""The attention functions of a flat-metadata backend, loaded once at start-up.

Each backend provides the same two calls, `(q, k_cache, v_cache, meta, scale, window,
softcap) -> [T, H, D]`, with `q: [T, H, D]` and caches as logical `[H_kv, slots, D]` views:
`decode` for decode-only steps (the fast path; None when it is off) and `varlen` for any
step. Their modules are imported here only, so a machine without Triton or flash-attn never
imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .metadata import FlatMetadata

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, FlatMetadata, float, int | None, float | None], torch.Tensor]


@dataclass(frozen=True)
class AttentionKernels:
    name: str
    decode: Kernel | None
    varlen: Kernel
    # Triton's varlen kernel runs one program per query tile; these size and fill the tile map.
    varlen_tiles: Callable[[torch.Tensor, int | None], tuple[torch.Tensor, torch.Tensor]] | None = None
    max_varlen_tiles: Callable[[int, int], int] | None = None
    kv_keyed: bool = False  # the launch takes the longest key length from the host


def _paged_adapters(decode_fn: Callable, varlen_fn: Callable, block_size: int) -> tuple[Kernel, Kernel]:
    """Our Triton kernels and their PyTorch reference share one signature: one adapter."""

    def decode(q, k, v, meta, scale, window, softcap):
        return decode_fn(q, k, v, meta.block_table, meta.kv_lens, scale, window, softcap, block_size=block_size)

    def varlen(q, k, v, meta, scale, window, softcap):
        return varlen_fn(
            q, k, v, meta.block_table, meta.kv_lens, meta.cu_seqlens_q, meta.tile_request, meta.tile_start,
            scale, window, softcap, out=torch.zeros_like(q), block_size=block_size,
        )  # zeros: padding rows past the last request stay finite

    return decode, varlen


def load_kernels(name: str, decode_fast_path: bool, block_size: int) -> AttentionKernels:
    if name == "triton":
        from . import triton_kernels as tk

        decode, varlen = _paged_adapters(tk.paged_decode_attention, tk.paged_varlen_attention, block_size)
        return AttentionKernels(name, decode if decode_fast_path else None, varlen, tk.varlen_tiles, tk.max_varlen_tiles)
    if name == "reference":
        from . import varlen_reference as ref

        decode, varlen = _paged_adapters(ref.reference_decode_attention, ref.reference_varlen_attention, block_size)
        return AttentionKernels(name, decode if decode_fast_path else None, varlen)
    if name == "flash":
        from .flash import flash_decode, flash_varlen

        return AttentionKernels(name, flash_decode if decode_fast_path else None, flash_varlen, kv_keyed=True)
    raise ValueError(f"{name!r} is not a flat-metadata attention backend")
