"""One step's inputs, in the one layout every backend and device takes.

The step's tokens are one flat `[T]` row; plain index tensors say how they split into
requests: cumulative query lengths, key lengths, block tables, cache slots for the new K/V,
and the rows whose logits are sampled. Kernels and CUDA graphs walk these themselves; a
backend that wants more (the CPU's batched decode groups) derives it from the host copies in
its `prepare`. Built in bulk from the plan, on the host, then padded (`buckets.py`) and
copied to the device in one go (`step_runner.py`).

Single-token rows come first, shortest first, then short rows (speculative verification runs,
short chunks), then the rest: the order costs nothing to kernels that walk the tables, and
lets the CPU backend take the leading rows in its decode kernel, token by token.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from ..attention.torch_backend import KERNEL_MAX_QUERY
from ..cache.block_manager import BlockManager
from ..requests import PLACEHOLDER, RequestState
from ..scheduling.scheduler import ScheduledChunk, StepPlan


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T] int64; tokens still being sampled are 0 here...
    carry: torch.Tensor  # [T] int64: ...and name the previous step's sampled row to take (-1: none)
    positions: torch.Tensor  # [T] int64
    write_slots: torch.Tensor  # [T] int64: cache slot of each token's new K/V
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    kv_lens: torch.Tensor  # [B] int32: keys each request attends to, this step's included
    block_table: torch.Tensor  # [B, W] int32
    logits_indices: torch.Tensor  # [L] int64: last row of each request that samples (k + 1 rows with k drafts)
    sampled: list[RequestState]  # the S requests, in logits order
    chunks: list[ScheduledChunk]
    drafts: list[list[int]] | None = None  # per sampled request, its proposals; None: no request proposed
    lora_slots: np.ndarray | None = None  # [T] int64: each token's LoRA adapter slot (-1: none); None: no adapter row

    @property
    def num_logits(self) -> int:
        return self.logits_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_requests(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def decode_only(self) -> bool:
        """Every request computes one token: the decode fast path can take the step."""
        return self.num_tokens == self.num_requests

    @property
    def max_kv_len(self) -> int:
        return int(self.kv_lens.max()) if self.num_requests else 0


@dataclass
class StepTokens:
    """The tokens a plan computes, flattened in chunk order."""

    token_ids: list[int]
    q_lens: torch.Tensor  # [B]
    starts: torch.Tensor  # [B]: tokens each request had computed before the step
    cu_q: torch.Tensor  # [B + 1]
    rows: torch.Tensor  # [T]: the chunk of each token
    positions: torch.Tensor  # [T]
    samples: np.ndarray  # [B] bool: the chunk reaches the end of the sequence, so it samples

    def write_slots(self, table: np.ndarray, block_size: int) -> torch.Tensor:
        return write_slots(table, self.rows.numpy(), self.positions.numpy(), block_size)


def write_slots(table: np.ndarray, requests: np.ndarray, positions: np.ndarray, block_size: int) -> torch.Tensor:
    """Cache slot of each token's new K/V (`requests`: each token's row of `table`), in NumPy
    like the rest of the step's index math."""
    return torch.from_numpy(table[requests, positions // block_size].astype(np.int64) * block_size
                            + positions % block_size)


def step_tokens(chunks: list[ScheduledChunk]) -> StepTokens:
    """Host-side index math in NumPy: for the few dozen to thousand elements of a step it
    runs in microseconds, where each torch op costs several (this runs every step). One
    pass of plain Python over the chunks, then array operations only."""
    token_ids: list[int] = []
    q_lens: list[int] = []
    starts: list[int] = []
    lengths: list[int] = []
    for c in chunks:
        ids, start, n = c.state.all_token_ids, c.state.num_computed_tokens, c.num_tokens
        if n == 1:
            token_ids.append(ids[start])
        elif c.draft:  # the last known token, then the proposals to verify
            token_ids.extend(ids[start : start + n - len(c.draft)])
            token_ids.extend(c.draft)
        else:
            token_ids.extend(ids[start : start + n])
        q_lens.append(n)
        starts.append(start)
        lengths.append(len(ids) + len(c.draft))
    q, st = np.array(q_lens, np.int64), np.array(starts, np.int64)
    cu_q = np.zeros(len(chunks) + 1, np.int64)
    np.cumsum(q, out=cu_q[1:])
    rows = np.repeat(np.arange(len(chunks)), q)
    positions = st[rows] + np.arange(len(token_ids)) - cu_q[rows]
    samples = st + q == np.array(lengths, np.int64)  # the chunk reaches the end: it samples
    return StepTokens(token_ids, *(torch.from_numpy(x) for x in (q, st, cu_q, rows, positions)), samples)


def table_array(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one int32 array, rows padded with block 0 (never read: lengths bound
    every read)."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    table = np.zeros((len(tables), int(lens.max())), np.int32)
    table[np.arange(table.shape[1]) < lens[:, None]] = list(chain.from_iterable(tables))
    return table


def build_step_batch(
    plan: StepPlan, block_manager: BlockManager, prev_rows: dict[str, int] | None = None
) -> StepBatch:
    """The plan's chunks as one batch; `prev_rows` maps a request id to its row among the
    sampled tokens of the step still in flight, for its placeholder."""
    if all(c.num_tokens == 1 and not c.draft for c in plan.chunks):
        return _one_token_batch(plan, block_manager, prev_rows)
    return _any_batch(plan, block_manager, prev_rows)


def _carry(ids: np.ndarray, requests: np.ndarray, chunks: list[ScheduledChunk],
           prev_rows: dict[str, int] | None) -> np.ndarray:
    """Each token's row among the in-flight step's sampled tokens where it is a placeholder
    (-1 elsewhere; the placeholder's id becomes 0); `requests`: each token's chunk."""
    carry = np.full_like(ids, -1)
    waiting = ids == PLACEHOLDER
    if waiting.any():
        prev_rows = prev_rows or {}
        prev = np.fromiter((prev_rows.get(c.state.request_id, -1) for c in chunks), np.int64, len(chunks))
        carry[waiting] = prev[requests[waiting]]
        if (carry[waiting] < 0).any():
            raise RuntimeError("a placeholder token has no step in flight to take its value from")
        ids[waiting] = 0
    return carry


def _one_token_batch(plan: StepPlan, block_manager: BlockManager, prev_rows: dict[str, int] | None) -> StepBatch:
    """`_any_batch` for a plan whose every chunk computes one token and proposes none (a decode
    step, the steady state of every stream): the same batch from one pass over the requests and
    a few array operations, where the general path's index math runs ~30 (the test suite holds
    the two equal)."""
    # _any_batch's order for one-token chunks: by tokens computed (a stable sort, as there).
    chunks = sorted(plan.chunks, key=lambda c: c.state.num_computed_tokens)
    n = len(chunks)
    states = [c.state for c in chunks]
    starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, n)
    ids = np.fromiter((s.all_token_ids[s.num_computed_tokens] for s in states), np.int64, n)
    lengths = np.fromiter((len(s.all_token_ids) for s in states), np.int64, n)
    adapter_slots = np.fromiter((s.lora_slot for s in states), np.int64, n)
    table = table_array([block_manager.table(s.request_id) for s in states])
    requests = np.arange(n)
    carry = _carry(ids, requests, chunks, prev_rows)
    sampled_rows = np.flatnonzero(starts + 1 == lengths)  # the token is the sequence's last: it samples
    return StepBatch(
        input_ids=torch.from_numpy(ids),
        carry=torch.from_numpy(carry),
        positions=torch.from_numpy(starts),
        write_slots=write_slots(table, requests, starts, block_manager.block_size),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        kv_lens=torch.from_numpy((starts + 1).astype(np.int32)),
        block_table=torch.from_numpy(table),
        logits_indices=torch.from_numpy(sampled_rows.astype(np.int64)),
        sampled=[states[i] for i in sampled_rows.tolist()],
        chunks=chunks,
        lora_slots=adapter_slots if (adapter_slots >= 0).any() else None,
    )


def _any_batch(plan: StepPlan, block_manager: BlockManager, prev_rows: dict[str, int] | None) -> StepBatch:
    """Any plan: prompt chunks, speculative runs and decode rows together."""
    # Decode rows, then short rows (speculative runs, short chunks), then the rest, each by length.
    chunks = sorted(plan.chunks, key=lambda c: (c.num_tokens != 1, c.num_tokens > KERNEL_MAX_QUERY, c.state.num_computed_tokens))
    table = table_array([block_manager.table(c.state.request_id) for c in chunks])
    block_size = block_manager.block_size
    step = step_tokens(chunks)
    rows, cu_q = step.rows.numpy(), step.cu_q.numpy()
    adapter_slots = np.fromiter((c.state.lora_slot for c in chunks), np.int64, len(chunks))
    lora_slots = adapter_slots[rows] if (adapter_slots >= 0).any() else None
    ids = np.array(step.token_ids, np.int64)
    carry = _carry(ids, rows, chunks, prev_rows)
    sampled_rows = np.flatnonzero(step.samples)
    last_rows = cu_q[1:][sampled_rows] - 1
    drafts = None
    if any(c.draft for c in chunks):
        # Speculation: a request with k proposals has logits on its last k + 1 rows.
        drafts = [chunks[i].draft for i in sampled_rows.tolist()]
        rows = np.fromiter(map(len, drafts), np.int64, len(drafts)) + 1
        within = np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)  # 0 .. k per request
        last_rows = np.repeat(last_rows + 1 - rows, rows) + within
    return StepBatch(
        input_ids=torch.from_numpy(ids),
        carry=torch.from_numpy(carry),
        positions=step.positions,
        write_slots=step.write_slots(table, block_size),
        cu_seqlens_q=torch.from_numpy(cu_q.astype(np.int32)),
        kv_lens=torch.from_numpy((step.starts.numpy() + step.q_lens.numpy()).astype(np.int32)),
        block_table=torch.from_numpy(table),
        logits_indices=torch.from_numpy(last_rows),
        sampled=[chunks[i].state for i in sampled_rows.tolist()],
        chunks=chunks,
        drafts=drafts,
        lora_slots=lora_slots,
    )


def apply_carry(input_ids: torch.Tensor, carry: torch.Tensor, prev_tokens: torch.Tensor | None) -> None:
    """Fill placeholders in place from the previous step's sampled tokens, on the device,
    without the host ever seeing those tokens (so step N+1 can start before N is read)."""
    if prev_tokens is None or prev_tokens.numel() == 0:
        return
    taken = prev_tokens[carry.clamp(min=0)]
    input_ids.copy_(torch.where(carry >= 0, taken, input_ids))
