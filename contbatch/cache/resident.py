"""KV cache memory made resident before the first step that writes into it.

On the CPU the cache lives in private anonymous mappings (`paged_cache._zeros`): the OS hands
out their pages zeroed on first touch, so memory nobody uses is never touched. The price is
paid inside the steps: a step whose rows land in blocks never used before takes a page fault
for every 4 KiB it writes, in every layer, K and V and KV head, in the middle of the forward,
with every thread faulting at once. `madvise(MADV_POPULATE_WRITE)` (Linux 5.14) makes a whole
range resident in one call, for a fraction of what the faults cost (docs/cpu.md has both), and
leaves what the range holds as it is: populating memory already in use is harmless.

Blocks never used before are handed out in ascending order (`BlockManager.frontier`: every
block below it has been handed out at least once), so the memory never touched is the blocks
from the frontier on. Before each step the engine makes every block below the frontier
resident (`upto`): most steps find nothing to do, and a step that takes fresh blocks populates
them there, whole, before its forward. While the engine has nothing to run, it populates up to
AHEAD_BYTES past the frontier, a block at a time (`ahead`), so that the next requests find
their blocks ready. Memory is still taken only as requests come: at most AHEAD_BYTES more, and
none before the first request.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

logger = logging.getLogger("contbatch")

MADV_POPULATE_WRITE = 23  # <linux/mman.h>
PAGE = 4096
AHEAD_BYTES = 256 << 20  # populated past the frontier while the engine is idle


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


@functools.cache
def availability() -> tuple[bool, str]:
    """Whether memory can be populated ahead here, and if not, why (tried once, on a small buffer)."""
    if _MADVISE is None:
        return False, "no madvise(2) here (not Linux)"
    buffer = (ctypes.c_char * (3 * PAGE))()
    start = -ctypes.addressof(buffer) % PAGE + ctypes.addressof(buffer)
    if _MADVISE(start, 2 * PAGE, MADV_POPULATE_WRITE) != 0:
        return False, f"madvise(MADV_POPULATE_WRITE) failed (Linux before 5.14?): errno {ctypes.get_errno()}"
    return True, ""


def window_blocks(block_bytes: int) -> int:
    """Blocks populated past the frontier while the engine is idle: AHEAD_BYTES of them, at least one."""
    return max(1, AHEAD_BYTES // max(1, block_bytes))


def describe_populate(block_bytes: int) -> str:
    """What the start-up line says of it: in force, with its window, or off and why."""
    ok, why = availability()
    if not block_bytes:
        return "off (no layer keeps KV)"
    if not ok:
        return f"off ({why}: pages arrive on first write)"
    blocks = window_blocks(block_bytes)
    return (f"on (fresh blocks resident before their step; {blocks} blocks, {blocks * block_bytes / 2**20:.0f} MiB, "
            "past the last one handed out while idle)")


class ResidentKV:
    """Which blocks of a CPU cache are resident, and the calls that make more of them so.

    `tensors`: the cache's per-layer K and V tensors, `[kv_heads, rows, width]` (heads first)
    or `[rows, kv_heads, width]` (token-major), rows `block_size` per block from block 0."""

    def __init__(self, tensors: list[torch.Tensor], num_blocks: int, block_size: int, token_major: bool) -> None:
        self.planes: list[tuple[int, int]] = []  # (address of block 0, bytes of a block) per contiguous plane
        for t in tensors:
            if t.numel() == 0:
                continue
            per_row = t.element_size() * (t.shape[1] * t.shape[2] if token_major else t.shape[2])
            heads = [t] if token_major else [t[h] for h in range(t.shape[0])]
            self.planes += [(h.data_ptr(), per_row * block_size) for h in heads]
        self.block_bytes = sum(size for _, size in self.planes)
        self.num_blocks = num_blocks
        self.ready = 0  # blocks [0, ready) are resident
        self.window = window_blocks(self.block_bytes)
        self.failed: str | None = None  # why populating stopped (then pages arrive by faults, as before)

    def upto(self, frontier: int) -> None:
        """Make blocks [0, frontier) resident: called before a step writes into any of them."""
        if frontier > self.ready:
            self._populate(self.ready, min(frontier, self.num_blocks))

    def ahead(self, frontier: int) -> bool:
        """One more block past the frontier resident, if the window is not full yet; returns
        whether it populated one (the engine calls again until it says False, or work comes).
        Nothing before the first block is handed out: a manager that never gets a request
        takes no memory."""
        target = min(self.num_blocks, frontier + self.window)
        if self.failed is not None or not frontier or self.ready >= target:
            return False
        self._populate(self.ready, max(self.ready, frontier) + 1)
        return True

    def _populate(self, first: int, end: int) -> None:
        for base, size in self.planes if self.failed is None else ():
            start = base + first * size
            aligned = start - start % PAGE
            if _MADVISE(aligned, start - aligned + (end - first) * size, MADV_POPULATE_WRITE) != 0:
                self.failed = f"madvise(MADV_POPULATE_WRITE) failed: errno {ctypes.get_errno()}"
                logger.warning("contbatch: KV cache pages arrive on first write from now on (%s)", self.failed)
                break
        self.ready = max(self.ready, end)  # after a failure too: those pages arrive by faults
