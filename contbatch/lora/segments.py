"""A step's rows grouped by adapter slot: what the segmented low-rank product walks.

Built once per step, in bulk (NumPy), from the per-token slot array the step batch carries
(`-1`: the base model alone). Each group is one slot's rows, padded to the largest group;
rows of no adapter appear in no group, so they get the base output untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoraStep:
    """The hooks (and the fused CPU layer, which runs the same ops) take every group at once, as
    two batched products over the groups padded to the largest: `rows` holds each group's row
    indices then row 0 as filler ([G * m]), `drop` marks the filler entries ([G, m, 1]), whose
    products are zeroed, so they are exact zeros. The products go back to their rows by a
    gather, not a scatter: `inverse` ([num_tokens]) gives each row's entry, a row of no adapter
    a filler's (one is added where no group has any), and the layer's output adds the gathered
    rows (a base row adds +0). One op sequence whatever the mix: one adapter or eight cost the
    same count of calls."""

    num_tokens: int  # rows of every linear input in this step (padding included)
    slots: tuple[int, ...]  # the groups' adapter slots, ascending
    rows: torch.Tensor  # [G * m] int64
    drop: torch.Tensor  # [G, m, 1] bool
    inverse: torch.Tensor  # [num_tokens] int64: each row's entry in `rows`' order


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
    sizes = np.append(starts[1:], len(slots)) - starts
    width = int(sizes.max())
    base_rows = len(rows) < num_tokens
    if base_rows and (sizes == width).all():
        width += 1  # a filler entry for the rows of no adapter to read
    keep = np.arange(width)[None, :] < sizes[:, None]  # [G, m]
    padded = np.zeros(keep.shape, np.int64)
    padded[keep] = rows
    inverse = np.full(num_tokens, int(np.flatnonzero(~keep.reshape(-1))[0]) if base_rows else 0, np.int64)
    inverse[rows] = np.flatnonzero(keep.reshape(-1))
    return LoraStep(num_tokens, tuple(int(s) for s in present), torch.from_numpy(padded.reshape(-1)).to(device),
                    torch.from_numpy(~keep[..., None]).to(device), torch.from_numpy(inverse).to(device))
