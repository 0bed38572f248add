"""A step's rows grouped by adapter slot: what the segmented low-rank product walks.

Built once per step, in bulk (NumPy), from the per-token slot array the step batch carries
(`-1`: the base model alone). Each group is one slot's rows, padded to the largest group, or,
where padding would more than double the rows (a prompt chunk of one adapter beside a few
decode rows of others), laid end to end and taken one group at a time; rows of no adapter
appear in no group, so they get the base output untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoraStep:
    """How the hooks (and the fused CPU layer, which runs the same ops: `lora_products`) take the
    groups. Padded (`bounds` None): every group at once, as two batched products over the
    groups padded to the largest: `rows` holds each group's row indices then row 0 as filler
    ([G * m]), `drop` marks the filler entries ([G, m, 1]), whose products are zeroed, so they
    are exact zeros; one op sequence whatever the mix. Segmented (`bounds`, G + 1 offsets):
    `rows` holds the groups' rows end to end ([n]) and each group is two products of its own,
    with no filler; an extra zero entry n follows them. Either way the products go back to their
    rows by a gather, not a scatter: `inverse` ([num_tokens]) gives each row's entry, a row of
    no adapter a zero one, and the layer's output adds the gathered rows (a base row adds +0)."""

    num_tokens: int  # rows of every linear input in this step (padding included)
    slots: tuple[int, ...]  # the groups' adapter slots, ascending
    rows: torch.Tensor  # [G * m] (padded) or [n] (segmented) int64
    drop: torch.Tensor | None  # [G, m, 1] bool (padded), None (segmented)
    inverse: torch.Tensor  # [num_tokens] int64: each row's entry in `rows`' order
    bounds: tuple[int, ...] | None = None  # segmented: group g is rows[bounds[g]:bounds[g + 1]]


def lora_products(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, step: LoraStep) -> torch.Tensor:
    """Each row's adapter contribution [num_tokens, out] for x [num_tokens, in] and a layer's
    stacked factors (a [G, R, in], bt [G, R, out] with the scale folded in): the ops the fused
    CPU layer's `add_lora` runs in C++, in the same order (so the two agree bit for bit)."""
    if step.bounds is None:
        xs = x.index_select(0, step.rows).view(len(step.slots), -1, x.shape[1])
        h = torch.bmm(xs, a.transpose(1, 2)).masked_fill_(step.drop, 0)
        return torch.bmm(h, bt).view(-1, bt.shape[2]).index_select(0, step.inverse)
    xs = x.index_select(0, step.rows)
    n, bounds = xs.shape[0], step.bounds
    h = xs.new_empty(n, a.shape[1])
    y = xs.new_empty(n + 1, bt.shape[2])
    y[n].zero_()
    for g in range(len(step.slots)):
        torch.mm(xs[bounds[g]:bounds[g + 1]], a[g].t(), out=h[bounds[g]:bounds[g + 1]])
        torch.mm(h[bounds[g]:bounds[g + 1]], bt[g], out=y[bounds[g]:bounds[g + 1]])
    return y.index_select(0, step.inverse)


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
    if len(present) * width > 2 * len(rows):  # padding would more than double the rows: segmented
        inverse = np.full(num_tokens, len(rows), np.int64)
        inverse[rows] = np.arange(len(rows))
        return LoraStep(num_tokens, tuple(int(s) for s in present), torch.from_numpy(rows).to(device), None,
                        torch.from_numpy(inverse).to(device), tuple(int(b) for b in (*starts, len(rows))))
    if base_rows and (sizes == width).all():
        width += 1  # a filler entry for the rows of no adapter to read
    keep = np.arange(width)[None, :] < sizes[:, None]  # [G, m]
    padded = np.zeros(keep.shape, np.int64)
    padded[keep] = rows
    inverse = np.full(num_tokens, int(np.flatnonzero(~keep.reshape(-1))[0]) if base_rows else 0, np.int64)
    inverse[rows] = np.flatnonzero(keep.reshape(-1))
    return LoraStep(num_tokens, tuple(int(s) for s in present), torch.from_numpy(padded.reshape(-1)).to(device),
                    torch.from_numpy(~keep[..., None]).to(device), torch.from_numpy(inverse).to(device))
