"""Our C++ attention for the CPU (`csrc/paged_decode_cpu.cpp`, `csrc/paged_prefill_cpu.cpp`,
built by `native.py`).

The torch backend's decode rows used to gather each request's keys and values into a fresh
tensor per layer (`index_select`), then attend with batched matmuls: on a 64-request batch
the gather alone was ~7% of the engine's time and the matmuls another ~5%. The kernel reads
K/V in place through the block tables instead, one task per request and KV head. With
AVX-512 and head dims of 32, 64, 128 or 256 it holds a tile of query heads (scores) or their
running sums (values) in registers over all the request's keys, reduces sixteen keys' dot
products at once and takes exp sixteen at a time: 1.8-2.6x the first version's speed on
caches read from memory (`benchmarks/RESULTS.md`). Where the library cannot be built (no
compiler) the backend keeps the gather path and says so at start-up.

Prompt chunks had run aten's SDPA one request at a time, at a quarter of the machine's matmul
rate on the default model (9 query heads are too few tasks for two cores, and at a few hundred
tokens its causal mask saved nothing). The prefill kernel takes every chunk of the step in one
call per layer: one task per (request, KV head, tile of ~32 positions), flash attention over
float32 tiles of 64 keys read in place, tasks handed out largest first: 2.1-3.8x SDPA on
prompts of 128-2,000 tokens (`benchmarks/RESULTS.md`).
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


def paged_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
                  q_start: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor, sinks: torch.Tensor | None,
                  block_size: int, scale: float, window: int | None, softcap: float | None, out: torch.Tensor) -> None:
    """Attention for prompt chunks, written into their rows of `out` ([T, H, D], contiguous).
    query [T, H, D] (rows contiguous); key/value `[H_kv, slots, D]` views of one layer's cache,
    this step's keys already written; block_table [chunks, W], q_start / q_lens / kv_lens
    [chunks] int32: each chunk's first row in `query`, its length, and the keys it sees."""
    empty = query.new_empty(0, dtype=torch.float32)
    torch.ops.contbatch_cpu.paged_prefill(
        query, key, value, block_table, q_start, q_lens, kv_lens, empty if sinks is None else sinks.float(),
        block_size, scale, window or 0, softcap or 0.0, out)
