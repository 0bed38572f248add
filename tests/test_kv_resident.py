"""Fresh KV cache blocks made resident before the steps that write them (cache/resident.py).

Residency is read back from the kernel (`mincore(2)`), page by page: what the engine populated
is in memory, what it has not reached is not, and what a block held stays as it was."""

from __future__ import annotations

import ctypes
import logging
import sys

import pytest
import torch

from contbatch.cache import resident
from contbatch.cache.block_manager import BlockManager
from contbatch.cache.paged_cache import KVLayout, PagedAttentionCache

pytestmark = pytest.mark.skipif(not resident.availability()[0], reason="no MADV_POPULATE_WRITE here")

PAGE = resident.PAGE
HEAD_DIM, BLOCK = 64, 16  # a block of one head: 16 x 64 float32 = one 4 KiB page


def test_blocks_given_back_are_handed_out_before_never_used_ones():
    bm = BlockManager(8, 4)
    assert bm.frontier == 0
    assert bm.ensure("a", 12) and bm.ensure("b", 4)
    assert bm.table("a") == [0, 1, 2] and bm.table("b") == [3] and bm.frontier == 4
    bm.free("a")  # never hashed (sharing off): back to the free list, ahead of blocks 4..7
    assert bm.ensure("c", 8)
    assert set(bm.table("c")) <= {0, 1, 2} and bm.frontier == 4
    assert bm.ensure("d", 12)  # the last block given back, then fresh ones in order
    assert bm.table("d")[1:] == [4, 5] and bm.frontier == 6


def _resident_pages(address: int, length: int) -> list[bool]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    start = address - address % PAGE
    pages = -(-(address + length - start) // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, address + length - start, vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


def _block_resident(cache: PagedAttentionCache, block: int) -> bool:
    """Whether every layer's K and V pages of `block`, every head, are in memory."""
    ok = True
    for t in cache.key_cache + cache.value_cache:
        for h in range(t.shape[0]):
            plane = t[h, block * BLOCK : (block + 1) * BLOCK]
            ok &= all(_resident_pages(plane.data_ptr(), plane.numel() * plane.element_size()))
    return ok


def _cache(num_blocks: int = 300) -> PagedAttentionCache:
    # 2 heads x (300 + 2) x 16 rows x 64 x 4 bytes: ~4.9 MB a tensor, a private anonymous mapping
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=HEAD_DIM, dtype=torch.float32)
    return PagedAttentionCache(layout, num_blocks=num_blocks, block_size=BLOCK)


def _thp_always() -> bool:
    from contbatch.hugepages import THP_ENABLED

    try:
        return "[always]" in THP_ENABLED.read_text()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_always(),
                    reason="mincore(2) is read on Linux, page by page (not where every mapping gets 2 MiB pages)")
def test_blocks_handed_out_are_resident_before_the_step_and_the_rest_only_ahead(monkeypatch):
    monkeypatch.setattr(resident, "AHEAD_BYTES", 3 * 2 * 2 * 2 * BLOCK * HEAD_DIM * 4)  # three blocks
    cache = _cache()
    bm = cache.block_manager
    assert cache.resident is not None and cache.resident.window == 3
    assert not any(_block_resident(cache, b) for b in range(6))
    assert not cache.populate_ahead()  # no request yet: nothing taken ahead
    assert bm.ensure("a", 2 * BLOCK + 1)  # blocks 0, 1, 2
    cache.make_resident()
    assert all(_block_resident(cache, b) for b in range(3)) and not _block_resident(cache, 3)
    populated = 0
    while cache.populate_ahead():  # the engine's idle loop
        populated += 1
    assert populated == 3 and all(_block_resident(cache, b) for b in range(6)) and not _block_resident(cache, 6)
    assert not cache.populate_ahead()  # the window is full until the frontier moves
    assert bm.ensure("b", BLOCK)  # block 3: resident already, nothing to do
    cache.make_resident()
    assert cache.resident.ready == 6 and cache.populate_ahead() and _block_resident(cache, 6)


def test_populating_leaves_what_blocks_hold_as_it_is():
    cache = _cache()
    cache.key_cache[0][:, : 2 * BLOCK].fill_(3.0)
    cache.value_cache[1][1, BLOCK : 2 * BLOCK].fill_(-1.5)
    cache.block_manager.ensure("a", 4 * BLOCK)
    cache.make_resident()
    while cache.populate_ahead():
        pass
    assert torch.all(cache.key_cache[0][:, : 2 * BLOCK] == 3.0)
    assert torch.all(cache.value_cache[1][1, BLOCK : 2 * BLOCK] == -1.5)
    assert cache.value_cache[1][0].abs().sum() == 0 and cache.key_cache[1].abs().sum() == 0
    assert cache.resident.ready == cache.num_blocks  # the whole small cache fits the window


def test_a_workers_step_makes_its_blocks_resident_from_the_block_table():
    """A tensor-parallel worker's blocks are handed out by rank 0: the step's block table says
    which; the reserved blocks that padding points at are not the frontier."""
    cache = _cache()
    pad = cache.num_blocks  # the read-trash block
    cache.make_resident(torch.tensor([[4, 1, pad], [2, pad, pad]], dtype=torch.int32))
    assert cache.resident.ready == 5
    cache.make_resident(torch.full((2, 3), pad, dtype=torch.int32))
    assert cache.resident.ready == 5


def test_a_failed_populate_is_said_once_and_leaves_pages_to_arrive_by_faults(monkeypatch, caplog):
    cache = _cache()
    monkeypatch.setattr(resident, "_MADVISE", lambda *args: -1)
    cache.block_manager.ensure("a", 3 * BLOCK)
    with caplog.at_level(logging.WARNING, logger="contbatch"):
        cache.make_resident()
        assert not cache.populate_ahead()
        cache.block_manager.ensure("b", 3 * BLOCK)
        cache.make_resident()
    assert cache.resident.failed is not None
    assert [r.getMessage() for r in caplog.records].count(
        f"contbatch: KV cache pages arrive on first write from now on ({cache.resident.failed})") == 1
    cache.key_cache[0][:, : 6 * BLOCK].fill_(1.0)  # still an ordinary, writable cache
    assert cache.key_cache[0][:, : 6 * BLOCK].sum() == 2 * 6 * BLOCK * HEAD_DIM
