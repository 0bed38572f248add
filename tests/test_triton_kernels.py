"""Triton paged-attention kernels against the PyTorch reference, and the reference against a
dense float64 computation written independently of both.

Without a GPU the kernels run in Triton's interpreter, which is slow per program and per
op, so the shapes are tiny and the parameters are a covering set rather than a product:
each case mixes several features (block size, grouping, window, cap, layout, dtype).
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

# `@triton.jit` picks interpreter or compiler when a function is decorated, and triton's own
# helpers (tl.sum, tl.max, ...) are decorated when triton is first imported: the variable
# must be set before that, or the interpreter cannot run them.
_INTERPRET = not torch.cuda.is_available()
_SAVED = os.environ.get("TRITON_INTERPRET")
if _INTERPRET and "triton" in sys.modules and _SAVED != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; set it in the environment or conftest.py",
                allow_module_level=True)
if _INTERPRET:
    # Process-wide from here on, and it must stay set: triton reads it again lazily.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from contbatch.attention import triton_kernels as tk  # noqa: E402
from contbatch.attention.varlen_reference import reference_decode_attention, reference_varlen_attention  # noqa: E402

from conftest import dense_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _cache(kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype, layout: str, gen: torch.Generator):
    """Both layouts the engine uses, as [H_kv, slots, D] views."""
    if layout == "heads":
        k = torch.randn(kv_heads, slots, head_dim, generator=gen)
    else:
        k = torch.randn(slots, kv_heads, head_dim, generator=gen).permute(1, 0, 2)
    return k.to(DEVICE, dtype)


def _setup(kv_lens: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int, dtype, layout: str,
           seed: int):
    """Caches with shuffled, non-contiguous block tables, plus an all-zero trash block 0 that
    padding rows point at (as the engine's CUDA-graph padding does)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(1, -(-max(kv_lens) // block_size))
    num_blocks = len(kv_lens) * max_blocks + 1
    k = _cache(kv_heads, num_blocks * block_size, head_dim, dtype, layout, gen)
    v = _cache(kv_heads, num_blocks * block_size, head_dim, dtype, layout, gen)
    k[:, :block_size] = 0
    v[:, :block_size] = 0
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = perm.view(len(kv_lens), max_blocks).to(DEVICE, torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    return k, v, table, lens, gen


# (block_size, heads, kv_heads, head_dim, window, softcap, layout, dtype)
CASES = [
    (4, 4, 4, 16, None, None, "heads", torch.float32),
    (6, 4, 2, 32, 5, None, "tokens", torch.float32),
    (16, 6, 2, 16, None, 2.0, "tokens", torch.float32),
    (6, 4, 2, 24, 3, 2.0, "heads", torch.float32),  # head_dim not a power of two
    (6, 6, 2, 32, 3, 2.0, "heads", torch.bfloat16),
    (4, 4, 2, 16, None, None, "tokens", torch.bfloat16),
]


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,window,softcap,layout,dtype", CASES)
def test_decode(block_size, heads, kv_heads, head_dim, window, softcap, layout, dtype):
    # The first visible key of the 5th row is the last key of a key tile: an off-by-one in
    # the window's tile skip would drop it. The last row is CUDA-graph padding (trash block).
    kv_lens = [0, 1, 5, 37, 2 * tk.BLOCK_N - 1 + (window or 0), 1]
    k, v, table, lens, gen = _setup(kv_lens, block_size, heads, kv_heads, head_dim, dtype, layout, seed=block_size)
    table[-1] = 0
    q = torch.randn(len(kv_lens), heads, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim**-0.5
    args = (q, k, v, table, lens, scale, window, softcap)
    out = tk.paged_decode_attention(*args, block_size=block_size)
    with torch.inference_mode():
        ref = reference_decode_attention(*args, block_size=block_size)
    assert out.dtype == ref.dtype == dtype
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and (out[-1] == 0).all()
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for b, n in enumerate(kv_lens):
        if n:
            dense = dense_attention(q[b : b + 1], k, v, table[b].cpu(), n, block_size, scale, window, softcap)
            torch.testing.assert_close(ref[b : b + 1].double(), dense, **TOL[dtype])


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,window,softcap,layout,dtype", CASES)
def test_varlen(block_size, heads, kv_heads, head_dim, window, softcap, layout, dtype):
    # (q_len, kv_len): decode rows, a padding request, a first chunk spanning two query
    # tiles, and chunks with earlier context; the second one's first visible key is the
    # last of a key tile (see test_decode).
    m = tk.VARLEN_BLOCK_M
    reqs = [(1, 1), (20, 20 + 2 * tk.BLOCK_N - 2 + (window or 0)), (0, 5), (1, 40), (m + 5, m + 5), (3, 9)]
    kv_lens = [kv for _, kv in reqs]
    k, v, table, lens, gen = _setup(kv_lens, block_size, heads, kv_heads, head_dim, dtype, layout, seed=7 + block_size)
    cu_list = [0]
    for n, _ in reqs:
        cu_list.append(cu_list[-1] + n)
    total, extra = cu_list[-1], 3  # rows past cu[-1]: a padded batch, left untouched
    cu = torch.tensor(cu_list, dtype=torch.int32, device=DEVICE)
    q = torch.randn(total + extra, heads, head_dim, generator=gen).to(DEVICE, dtype)
    tiles = tk.varlen_tiles(cu.cpu(), tk.max_varlen_tiles(total + extra, len(reqs)))
    assert (tiles[0] == -1).any()  # padding programs are exercised
    tile_request, tile_start = (t.to(DEVICE) for t in tiles)
    # A strided `out`: the kernel writes through its strides.
    out = torch.full((total + extra, heads, 2 * head_dim), 7.0, dtype=dtype, device=DEVICE)[..., :head_dim]
    scale = head_dim**-0.5
    tk.paged_varlen_attention(q, k, v, table, lens, cu, tile_request, tile_start, scale, window, softcap, out,
                              block_size=block_size)
    with torch.inference_mode():
        ref = reference_varlen_attention(q, k, v, table, lens, cu, tile_request, tile_start, scale, window, softcap,
                                         block_size=block_size)
    assert (out[total:] == 7.0).all()
    torch.testing.assert_close(out[:total], ref[:total], **TOL[dtype])
    for b, (n, kv) in enumerate(reqs):
        if n:
            rows = slice(cu_list[b], cu_list[b + 1])
            dense = dense_attention(q[rows], k, v, table[b].cpu(), kv, block_size, scale, window, softcap)
            torch.testing.assert_close(ref[rows].double(), dense, **TOL[dtype])


def test_varlen_tiles_layout_and_padding():
    m = tk.VARLEN_BLOCK_M
    q_lens = [0, 1, m, 2 * m + 3, 0]
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    expected = [(b, int(cu[b]) + i) for b, n in enumerate(q_lens) for i in range(0, n, m)]
    req, start = tk.varlen_tiles(cu)
    assert req.dtype == start.dtype == torch.int32
    assert list(zip(req.tolist(), start.tolist())) == expected
    req, start = tk.varlen_tiles(cu, len(expected) + 2)
    assert req.tolist()[-2:] == [-1, -1] and len(start) == len(expected) + 2
    assert tk.varlen_tiles(cu, len(expected))[0].tolist() == [b for b, _ in expected]
    with pytest.raises(ValueError):
        tk.varlen_tiles(cu, len(expected) - 1)


def test_max_varlen_tiles_is_an_upper_bound():
    rng = random.Random(0)
    for _ in range(300):
        num_req = rng.randint(1, 6)
        q_lens = [rng.choice([0, 1, rng.randint(0, 3 * tk.VARLEN_BLOCK_M)]) for _ in range(num_req)]
        cu = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(num_req)], dtype=torch.int32)
        tk.varlen_tiles(cu, tk.max_varlen_tiles(sum(q_lens), num_req))  # raises if the bound is short


def test_launchers_reject_bad_inputs():
    k, v, table, lens, gen = _setup([3], 4, 2, 2, 16, torch.float32, "heads", seed=0)
    q = torch.randn(1, 2, 16, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        tk.paged_decode_attention(q[..., :8], k, v, table, lens, 1.0, block_size=4)
    with pytest.raises(ValueError, match="int32"):
        tk.paged_decode_attention(q, k, v, table, lens.long(), 1.0, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        tk.paged_decode_attention(q, k, v, table, lens, 1.0, block_size=0)
    with pytest.raises(ValueError, match="sliding_window"):
        tk.paged_decode_attention(q, k, v, table, lens, 1.0, sliding_window=0, block_size=4)
    with pytest.raises(ValueError, match="multiple"):
        tk.paged_decode_attention(torch.randn(1, 3, 16, device=DEVICE), k, v, table, lens, 1.0, block_size=4)
