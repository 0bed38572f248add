"""Our C++ decode attention for the CPU (`csrc/paged_decode_cpu.cpp`, built by `native.py`).

The torch backend's decode rows used to gather each request's keys and values into a fresh
tensor per layer (`index_select`), then attend with batched matmuls: on a 64-request batch
the gather alone was ~7% of the engine's time and the matmuls another ~5%. The kernel reads
K/V in place through the block tables instead, one task per request and KV head. With
AVX-512 and head dims of 32, 64, 128 or 256 it holds a tile of query heads (scores) or their
running sums (values) in registers over all the request's keys, reduces sixteen keys' dot
products at once and takes exp sixteen at a time: 1.8-2.6x the first version's speed on
caches read from memory (`benchmarks/RESULTS.md`). Where the library cannot be built (no
compiler) the backend keeps the gather path and says so at start-up.
"""

from __future__ import annotations

import torch

from .. import native


def load() -> tuple[bool, str]:
    """(available, how); never raises."""
    ok, how = native.load()
    return ok, how if ok else f"{how}; decode rows gather K/V instead"


def paged_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
                 kv_lens: torch.Tensor, sinks: torch.Tensor | None, block_size: int, scale: float,
                 window: int | None, softcap: float | None) -> torch.Tensor:
    """query [rows, H, D] contiguous; key/value `[H_kv, slots, D]` views of one layer's cache;
    block_table [rows, W] and kv_lens [rows] int32. Returns [rows, H, D]."""
    empty = query.new_empty(0, dtype=torch.float32)
    return torch.ops.contbatch_cpu.paged_decode(
        query, key, value, block_table, kv_lens, empty if sinks is None else sinks.float(), block_size, scale,
        window or 0, softcap or 0.0)
