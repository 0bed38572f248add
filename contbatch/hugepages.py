"""Private anonymous memory advised for 2 MiB pages (the kernel's transparent huge pages).

Two users: the KV cache (`cache/paged_cache.py`), whose decode rows read blocks scattered
over gigabytes, and the weights a lone request's decode step streams (`cpu/weight_pages.py`).
On 4 KiB pages both keep missing the TLB; figures in docs/cpu.md.

Private, not shared: `mmap.mmap(-1, n)` maps shared memory, which the kernel gives huge pages
only where `shmem_enabled` allows (often `never`); a private anonymous mapping gets them where
`enabled` is `always` or `madvise`. Pages are zero on first touch either way, and touched only
as they are written. A leaf module (standard library only).
"""

from __future__ import annotations

import ctypes
import mmap
import re
from pathlib import Path

HUGE_PAGE = 2 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def availability() -> tuple[bool, str]:
    """Whether private anonymous memory can be advised onto huge pages here, and if not, why."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return False, "no madvise(MADV_HUGEPAGE) on this platform"
    try:
        found = re.search(r"\[(\w+)\]", THP_ENABLED.read_text())
    except OSError:
        return False, "no transparent huge pages on this system"
    mode = found.group(1) if found else "unknown"
    if mode not in ("always", "madvise"):
        return False, f"transparent huge pages are {mode}"
    return True, ""


def zeroed_buffer(nbytes: int, huge: bool = True) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping with `nbytes` of zeros from the returned offset on: that
    offset is a 2 MiB boundary, and with `huge` the range is advised for huge pages where the
    system has them (else ordinary pages, silently: the memory is the same)."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a boundary
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -_address(buffer) % HUGE_PAGE
    if huge and availability()[0]:
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE, start, size - start)
        except OSError:
            pass
    return buffer, start


def _address(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
