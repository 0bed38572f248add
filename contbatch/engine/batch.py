"""Ragged step inputs: every scheduled token of a step flattened into one `[1, T]` row.

Built in bulk from the plan: Python touches each request once (to slice its tokens and block
table); positions, write slots and gather indices are computed with tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..attention.metadata import BatchMetadata, DecodeGroup, PrefillRow
from ..cache.paged_cache import PagedAttentionCache
from ..requests import RequestState
from ..scheduling.scheduler import ScheduledChunk, StepPlan
from .flat_batch import step_tokens


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [S]: one per request that samples this step
    sampled: list[RequestState]  # the S requests, in logits order
    chunks: list[ScheduledChunk]  # in batch order
    meta: BatchMetadata

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def build_batch(plan: StepPlan, cache: PagedAttentionCache) -> ModelInputs:
    # Single-token rows first, shortest first: they form the batched decode groups.
    chunks = sorted(plan.chunks, key=lambda c: (c.num_tokens != 1, c.state.num_computed_tokens))
    device = cache.device
    bs = cache.block_size
    tables = [cache.block_manager.table(c.state.request_id) for c in chunks]
    width = max(len(t) for t in tables)
    trash_block = cache.num_blocks  # first reserved block: reads land on the read-trash slot
    table = torch.tensor([t + [trash_block] * (width - len(t)) for t in tables], dtype=torch.long)

    step = step_tokens(chunks)
    token_ids, q_lens, starts, cu_q, positions = step.token_ids, step.q_lens, step.starts, step.cu_q, step.positions
    write_slots = step.write_slots(table.numpy(), bs)

    num_decode = sum(1 for c in chunks if c.num_tokens == 1)
    kv_lens = starts + q_lens
    decode_groups = [
        _decode_group(cache, table, kv_lens, lo, hi, device) for lo, hi in _split_decode_rows(num_decode)
    ]

    prefill_rows = []
    for i in range(num_decode, len(chunks)):
        start, kv_len = int(starts[i]), int(kv_lens[i])
        kv_index = None
        if start > 0:
            key_pos = torch.arange(kv_len)
            kv_index = cache.gather_index(table[i, key_pos // bs] * bs + key_pos % bs).to(device)
        prefill_rows.append(PrefillRow(int(cu_q[i]), chunks[i].num_tokens, kv_len, kv_index))

    sampled_rows = np.flatnonzero(step.samples).tolist()
    logits_indices = cu_q[1:][sampled_rows] - 1 if sampled_rows else torch.zeros(0, dtype=torch.long)
    meta = BatchMetadata(
        cache=cache,
        write_slots=write_slots.to(device),
        decode_groups=decode_groups,
        prefill_rows=prefill_rows,
    )
    return ModelInputs(
        input_ids=torch.tensor([token_ids], dtype=torch.long, device=device),
        position_ids=positions.unsqueeze(0).to(device),
        logits_indices=logits_indices.to(device),
        sampled=[chunks[i].state for i in sampled_rows],
        chunks=chunks,
        meta=meta,
    )


MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP_ROWS = 8


def _split_decode_rows(num_decode: int) -> list[tuple[int, int]]:
    """Equal-count groups over the length-sorted decode rows: few enough that per-group
    overhead stays small, enough that padding to each group's maximum stays modest."""
    if num_decode == 0:
        return []
    groups = max(1, min(MAX_DECODE_GROUPS, num_decode // MIN_DECODE_GROUP_ROWS))
    size = -(-num_decode // groups)
    return [(lo, min(lo + size, num_decode)) for lo in range(0, num_decode, size)]


def _decode_group(
    cache: PagedAttentionCache, table: torch.Tensor, kv_lens: torch.Tensor, lo: int, hi: int, device
) -> DecodeGroup:
    bs = cache.block_size
    lens = kv_lens[lo:hi]
    length = int(lens.max())
    key_pos = torch.arange(length)
    slots = table[lo:hi, key_pos // bs] * bs + key_pos % bs
    slots = torch.where(key_pos[None, :] < lens[:, None], slots, cache.read_trash_slot)
    return DecodeGroup(lo, hi - lo, length, lens.to(device), cache.gather_index(slots).to(device))
