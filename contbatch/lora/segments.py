"""A step's rows grouped by adapter slot: what the segmented low-rank product walks.

Built once per step, in bulk (NumPy), from the per-token slot array the step batch carries
(`-1`: the base model alone). Each group is one slot and the index tensor of its rows, on the
model's device; rows of no adapter appear in no group, so they get the base output untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoraStep:
    """With several groups, the hooks run them as one batched product over the groups padded
    to the largest: `padded` holds each group's rows then row 0 as filler ([G * m]), `keep`
    says which entries are real ([G, m, 1]); filler entries contribute exact zeros."""

    num_tokens: int  # rows of every linear input in this step (padding included)
    groups: tuple[tuple[int, torch.Tensor], ...]  # (slot, row indices [n] int64), slots ascending
    slots: tuple[int, ...] = ()
    padded: torch.Tensor | None = None
    keep: torch.Tensor | None = None


def group_rows(token_slots: np.ndarray | None, num_tokens: int, device: torch.device) -> LoraStep | None:
    """Rows per slot for a step of `num_tokens` rows (the first `len(token_slots)` are the
    batch's tokens, the rest padding); None when no row uses an adapter."""
    if token_slots is None:
        return None
    used = token_slots >= 0
    if not used.any():
        return None
    rows = np.flatnonzero(used)
    slots = token_slots[rows]
    order = np.argsort(slots, kind="stable")
    rows, slots = rows[order], slots[order]
    present, starts = np.unique(slots, return_index=True)
    ends = np.append(starts[1:], len(slots))
    all_rows = torch.from_numpy(rows.astype(np.int64)).to(device)
    groups = tuple((int(s), all_rows[a:b]) for s, a, b in zip(present, starts, ends))
    if len(groups) == 1:
        return LoraStep(num_tokens, groups, (groups[0][0],))
    width = int((ends - starts).max())
    keep = np.arange(width)[None, :] < (ends - starts)[:, None]  # [G, m]
    padded = np.zeros(keep.shape, np.int64)
    padded[keep] = rows
    return LoraStep(num_tokens, groups, tuple(int(s) for s in present),
                    torch.from_numpy(padded.reshape(-1)).to(device), torch.from_numpy(keep[..., None]).to(device))
