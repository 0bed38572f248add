"""A step in the GPU layout: flat index tensors only, nothing the forward must read on the host.

The torch path (`batch.py`) groups rows on the host; the kernels and CUDA graphs want plain
tensors instead: cumulative query lengths, key lengths and block tables, which the kernels
walk themselves. Built in bulk from the plan, on the host, then padded (`buckets.py`) and
copied to the device in one go (`flat_runner.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..requests import PLACEHOLDER, RequestState
from ..scheduling.scheduler import ScheduledChunk, StepPlan


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T] int64; tokens still being sampled are 0 here...
    carry: torch.Tensor  # [T] int64: ...and name the previous step's sampled row to take (-1: none)
    positions: torch.Tensor  # [T] int64
    write_slots: torch.Tensor  # [T] int64: cache slot of each token's new K/V
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    kv_lens: torch.Tensor  # [B] int32: keys each request attends to, this step's included
    block_table: torch.Tensor  # [B, W] int32
    logits_indices: torch.Tensor  # [S] int64: last row of each request that samples
    sampled: list[RequestState]  # the S requests, in logits order
    chunks: list[ScheduledChunk]

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
    """The tokens a plan computes, flattened in chunk order: shared by both layouts."""

    token_ids: list[int]
    q_lens: torch.Tensor  # [B]
    starts: torch.Tensor  # [B]: tokens each request had computed before the step
    cu_q: torch.Tensor  # [B + 1]
    rows: torch.Tensor  # [T]: the chunk of each token
    positions: torch.Tensor  # [T]

    def write_slots(self, table: torch.Tensor, block_size: int) -> torch.Tensor:
        return table[self.rows, self.positions // block_size].long() * block_size + self.positions % block_size


def step_tokens(chunks: list[ScheduledChunk]) -> StepTokens:
    token_ids: list[int] = []
    for c in chunks:
        start = c.state.num_computed_tokens
        token_ids.extend(c.state.all_token_ids[start : start + c.num_tokens])
    q_lens = torch.tensor([c.num_tokens for c in chunks], dtype=torch.long)
    starts = torch.tensor([c.state.num_computed_tokens for c in chunks], dtype=torch.long)
    cu_q = torch.zeros(len(chunks) + 1, dtype=torch.long)
    torch.cumsum(q_lens, 0, out=cu_q[1:])
    rows = torch.repeat_interleave(torch.arange(len(chunks)), q_lens)
    positions = starts[rows] + torch.arange(len(token_ids)) - cu_q[rows]
    return StepTokens(token_ids, q_lens, starts, cu_q, rows, positions)


def build_flat_batch(
    plan: StepPlan, tables: list[list[int]], block_size: int, prev_rows: dict[str, int] | None = None
) -> FlatBatch:
    """`tables[i]` is the block table of `plan.chunks[i]`; `prev_rows` maps a request id to its
    row among the sampled tokens of the step still in flight, for its placeholder."""
    chunks = plan.chunks
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    step = step_tokens(chunks)
    ids = torch.tensor(step.token_ids, dtype=torch.long)
    rows, cu_q = step.rows, step.cu_q

    waiting = ids == PLACEHOLDER
    carry = torch.full_like(ids, -1)
    if bool(waiting.any()):
        prev_rows = prev_rows or {}
        prev = torch.tensor([prev_rows.get(c.state.request_id, -1) for c in chunks], dtype=torch.long)
        carry = torch.where(waiting, prev[rows], carry)
        if bool((carry[waiting] < 0).any()):
            raise RuntimeError("a placeholder token has no step in flight to take its value from")
        ids = ids.masked_fill(waiting, 0)

    sampled_rows = [i for i, c in enumerate(chunks) if c.samples]
    return FlatBatch(
        input_ids=ids,
        carry=carry,
        positions=step.positions,
        write_slots=step.write_slots(table, block_size),
        cu_seqlens_q=cu_q.to(torch.int32),
        kv_lens=(step.starts + step.q_lens).to(torch.int32),
        block_table=table,
        logits_indices=cu_q[1:][sampled_rows] - 1 if sampled_rows else torch.zeros(0, dtype=torch.long),
        sampled=[chunks[i].state for i in sampled_rows],
        chunks=list(chunks),
    )


def apply_carry(input_ids: torch.Tensor, carry: torch.Tensor, prev_tokens: torch.Tensor | None) -> None:
    """Fill placeholders in place from the previous step's sampled tokens, on the device,
    without the host ever seeing those tokens (so step N+1 can start before N is read)."""
    if prev_tokens is None or prev_tokens.numel() == 0:
        return
    taken = prev_tokens[carry.clamp(min=0)]
    input_ids.copy_(torch.where(carry >= 0, taken, input_ids))
