"""Weights that every decode step reads whole, moved once into memory on 2 MiB pages.

A lone request's decode step streams each linear weight from memory once.
On 4 KiB pages a 1 GB model spans a quarter of a million pages, and the reads of a step keep
missing the TLB; on 2 MiB pages (the kernel's transparent huge pages, asked for with
`madvise(MADV_HUGEPAGE)`) the same reads ran at a higher bandwidth (figures in docs/cpu.md).
The KV cache lives on such pages for the same reason (`cache/paged_cache.py`).

`plan_pages` says, once per manager start, which weights those are and whether they move: every
float linear weight the linear router may route (`routers.linear.one_row_weights`: at one row
each is read whole, by `small_linear` or by aten's GEMV alike) and every packed
weight (`cpu/quant`: codes, scales and mins of quantized linears and embeddings, which their
one-row kernels stream the same way); `CpuRouters.install` moves them. `move_to_huge_pages`
copies the given tensors, back to back, into one private anonymous mapping advised for huge
pages (`hugepages.zeroed_buffer`), and points each tensor at its copy (`tensor.data = copy`):
the modules keep the same Parameter objects, so tied weights stay tied, `update_weights` and
an optimizer see them, and every value is the same bit for bit. Each copy is a storage of its
own (exactly the tensor's bytes), so checkpoint writers see no shared memory. A tensor is moved
once: a second manager on the same model finds it moved. Where the OS has no transparent huge
pages (off, or no madvise), nothing moves and `hugepages.availability()` says why.

Only whole storages move: a tensor that is a view of a larger storage, or whose storage other
tensors of the model view differently, stays where it is (moving it would split memory that
the model shares). Code holding a tensor that aliases a moved weight's old storage (a `.data`
taken earlier) keeps the old values' memory, no longer shared with the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .. import hugepages
from .quant.embedding import QuantEmbedding
from .quant.linear import QuantLinear

ALIGN = 64  # each copy starts on a cache line
MARK = "_contbatch_huge_page_ptr"  # set on a moved tensor: its copy's address


@dataclass(frozen=True)
class PagesPlan:
    """Whether the decode-streamed weights move onto huge pages, and the start-up line's words."""

    move: bool
    nbytes: int  # bytes of those weights
    summary: str


def decode_weights(model: torch.nn.Module, one_row: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a lone request's decode step streams whole: `one_row` (the float linears'
    weights: `routers.linear.one_row_weights`) and every packed weight's buffers."""
    out = list(one_row)
    for m in model.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            out += [t for t in (m.codes, m.scales, m.mins) if t is not None]
    return list({id(t): t for t in out}.values())


def plan_pages(weights: list[torch.Tensor]) -> PagesPlan:
    """The plan for `decode_weights(...)`."""
    nbytes = sum(t.numel() * t.element_size() for t in weights)
    if not weights:
        return PagesPlan(False, 0, "no weights read whole at one row by our kernels")
    ok, why = hugepages.availability()
    if not ok:
        return PagesPlan(False, nbytes, f"one-row weights on ordinary pages ({why})")
    return PagesPlan(True, nbytes, f"one-row weights on 2 MiB pages ({nbytes / 2**20:.0f} MiB)")


def _by_storage(model: torch.nn.Module) -> dict[int, list[torch.Tensor]]:
    """Every CPU parameter and buffer of `model` (a shared one as often as modules hold it),
    grouped by the address of its storage."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    groups: dict[int, list[torch.Tensor]] = {}
    for _, t in named:
        if t is not None and t.device.type == "cpu":
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    return groups


def is_moved(tensor: torch.Tensor) -> bool:
    return getattr(tensor, MARK, None) == tensor.data_ptr()


def movable(tensors: Iterable[torch.Tensor], model: torch.nn.Module,
            groups: dict[int, list[torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """The tensors among `tensors` that `move_to_huge_pages` would move: CPU, contiguous, their
    storage's only bytes, not yet moved, not inference tensors, and every tensor of `model` on
    the same storage the same whole view. Each storage once (the first tensor on it). `groups`:
    `_by_storage(model)`, where the caller has it."""
    groups = _by_storage(model) if groups is None else groups
    out, seen = [], set()
    for t in tensors:
        ptr = t.untyped_storage().data_ptr() if t.device.type == "cpu" else None
        views = {(s.storage_offset(), tuple(s.shape), tuple(s.stride()), s.dtype) for s in groups.get(ptr, ())}
        if (ptr is None or ptr in seen or not t.numel() or t.is_inference() or not t.is_contiguous()
                or t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size() or is_moved(t)
                or len(views) > 1):
            continue
        seen.add(ptr)
        out.append(t)
    return out


def move_to_huge_pages(tensors: list[torch.Tensor], model: torch.nn.Module) -> int:
    """Move `movable(tensors, model)` onto huge pages; every tensor of `model` that shares a
    moved storage is pointed at the copy too. Returns the bytes moved (0 where huge pages are
    not available)."""
    if not hugepages.availability()[0]:
        return 0
    groups = _by_storage(model)
    todo = movable(tensors, model, groups)
    if not todo:
        return 0
    offsets, total = [], 0
    for t in todo:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buffer, start = hugepages.zeroed_buffer(total)
    for t, offset in zip(todo, offsets):
        copy = torch.frombuffer(buffer, dtype=t.dtype, count=t.numel(), offset=start + offset).view(t.shape)
        copy.copy_(t.detach())
        for same in {id(s): s for s in [t, *groups.get(t.untyped_storage().data_ptr(), [])]}.values():
            same.data = copy
            setattr(same, MARK, copy.data_ptr())
    return total
