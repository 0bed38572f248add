"""Padding a step to a shape a CUDA graph was (or will be) captured for.

A graph replays fixed kernels on fixed addresses, so a step must be padded to one of a few
shapes: decode-only steps to a power-of-two request count (up to `max_requests_per_batch`),
varlen steps to a multiple of `q_padding_interval_size` query tokens (and, for a backend
whose launch takes the longest key length from the host, a multiple of
`kv_padding_interval_size` keys). Padding rows read the read-trash block, which holds zeros,
and write the write-trash block, which nothing reads: they cannot touch a real request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .step_batch import StepBatch


@dataclass(frozen=True)
class StepShape:
    """Every size a captured forward depends on; equal shapes share a graph."""

    decode_only: bool
    num_tokens: int
    num_requests: int
    num_tiles: int  # query tiles of the varlen kernel (0 where the backend does not tile)
    max_kv_len: int  # key-length bucket (0 where the backend does not take it from the host)
    num_logits: int  # rows the lm-head runs over: every request in a graph, the sampled ones eagerly


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, interval: int) -> int:
    return -(-n // interval) * interval


def decode_bucket(num_requests: int, max_requests: int) -> int:
    """Powers of two, and `max_requests` itself as the last bucket when it is not one."""
    return max(num_requests, min(next_power_of_two(num_requests), max_requests))


@dataclass(frozen=True)
class Bucketing:
    max_requests: int
    q_interval: int
    kv_interval: int
    tiles_for: Callable[[int, int], int] | None  # (tokens, requests) -> tile bound, if tiled
    kv_keyed: bool  # the backend's launch takes the key-length bound from the host
    fast_decode: bool = True  # decode-only steps take the decode kernel (else the varlen one)
    graph_max_tokens: int = 1 << 62  # varlen steps padded past this run eagerly, unpadded

    def count(self, max_tokens: int) -> int:
        """How many padded shapes there are: decode buckets, then varlen token buckets."""
        decode = max(1, self.max_requests).bit_length() + 1
        return decode + -(-max_tokens // self.q_interval)

    def graphable(self, batch: StepBatch) -> bool:
        return batch.decode_only or round_up(batch.num_tokens, self.q_interval) <= self.graph_max_tokens

    def _tiles(self, decode_only: bool, tokens: int, requests: int) -> int:
        if self.tiles_for is None or (decode_only and self.fast_decode):
            return 0
        return self.tiles_for(tokens, requests)

    def exact(self, batch: StepBatch) -> StepShape:
        """No padding: the eager path runs the step as it is."""
        t, b = batch.num_tokens, batch.num_requests
        tiles = self._tiles(batch.decode_only, t, b)
        return StepShape(batch.decode_only, t, b, tiles, batch.max_kv_len if self.kv_keyed else 0,
                         batch.num_logits)

    def padded(self, batch: StepBatch) -> StepShape:
        if batch.decode_only:
            b = decode_bucket(batch.num_requests, self.max_requests)
            kv = round_up(batch.max_kv_len, self.kv_interval) if self.kv_keyed and not self.fast_decode else 0
            return StepShape(True, b, b, self._tiles(True, b, b), kv, b)
        t = round_up(batch.num_tokens, self.q_interval)
        b = min(t, self.max_requests)  # every request has a token: never more requests than tokens
        tiles = self._tiles(False, t, b)
        kv = round_up(batch.max_kv_len, self.kv_interval) if self.kv_keyed else 0
        # Speculative verification samples several rows per request: then every token row may.
        return StepShape(False, t, b, tiles, kv, b if batch.num_logits <= b else t)


def pad_batch(
    batch: StepBatch, shape: StepShape, table_width: int, trash_block: int, write_trash_slot: int
) -> dict[str, torch.Tensor]:
    """Host tensors of exactly `shape`: the real step first, then padding rows.

    Decode padding rows are one-token requests that read one zero key from the read-trash
    block; varlen padding requests have no query tokens (padding tokens belong to none).
    """
    t, b = batch.num_tokens, batch.num_requests
    pad_t, pad_b = shape.num_tokens - t, shape.num_requests - b
    if pad_t < 0 or pad_b < 0 or shape.num_logits < batch.num_logits or batch.block_table.shape[1] > table_width:
        raise ValueError(f"a step of {t} tokens, {b} requests does not fit {shape} (table width {table_width})")

    def extend(x: torch.Tensor, n: int, value: int) -> torch.Tensor:
        return torch.cat([x, torch.full((n,), value, dtype=x.dtype)]) if n else x

    table = torch.full((shape.num_requests, table_width), trash_block, dtype=torch.int32)
    table[:b, : batch.block_table.shape[1]] = batch.block_table
    if shape.decode_only:
        cu_q = torch.arange(shape.num_requests + 1, dtype=torch.int32)
        kv_lens = extend(batch.kv_lens, pad_b, 1)
    else:
        cu_q = extend(batch.cu_seqlens_q, pad_b, t)
        kv_lens = extend(batch.kv_lens, pad_b, 0)
    cu_k = torch.zeros(shape.num_requests + 1, dtype=torch.int32)
    torch.cumsum(kv_lens, 0, out=cu_k[1:])
    logits = batch.logits_indices
    return {
        "input_ids": extend(batch.input_ids, pad_t, 0),
        "carry": extend(batch.carry, pad_t, -1),
        "positions": extend(batch.positions, pad_t, 0),
        "write_slots": extend(batch.write_slots, pad_t, write_trash_slot),
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
        "kv_lens": kv_lens,
        "block_table": table,
        # In a graph every request row may sample: the lm-head runs over a fixed number of rows.
        "logits_indices": extend(logits, shape.num_logits - logits.shape[0], 0),
    }
