"""Attention sinks (gpt-oss's `s_aux`) in every backend that takes them: the Triton kernels (in
Triton's interpreter without a GPU) and their PyTorch reference against a dense float64
computation written out here, and the torch backend through a whole model (see
`test_model_support.py`). A sink is one logit per query head that joins the softmax
denominator and contributes no value, so a row's output is shrunk by 1 / (1 + e^(s - lse)).
"""

from __future__ import annotations

import pytest
import torch

from test_triton_kernels import DEVICE, TOL, _setup  # also sets TRITON_INTERPRET before triton loads

pytest.importorskip("triton")

from contbatch.attention import triton_kernels as tk  # noqa: E402
from contbatch.attention.varlen_reference import reference_decode_attention, reference_varlen_attention  # noqa: E402

from conftest import dense_attention  # noqa: E402


# (block_size, heads, kv_heads, head_dim, window, softcap, dtype)
CASES = [
    (4, 4, 2, 16, None, None, torch.float32),
    (6, 4, 2, 24, 5, None, torch.float32),
    (4, 6, 2, 16, 3, 2.0, torch.bfloat16),
]


def _sinks(heads: int, gen: torch.Generator) -> torch.Tensor:
    # Large enough that dropping or misplacing a sink changes outputs far beyond tolerance.
    return (torch.randn(heads, generator=gen) * 2).to(DEVICE)


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,window,softcap,dtype", CASES)
def test_decode_with_sinks(block_size, heads, kv_heads, head_dim, window, softcap, dtype):
    kv_lens = [0, 1, 5, 2 * tk.BLOCK_N + 3]
    k, v, table, lens, gen = _setup(kv_lens, block_size, heads, kv_heads, head_dim, dtype, "heads", seed=3)
    q = torch.randn(len(kv_lens), heads, head_dim, generator=gen).to(DEVICE, dtype)
    sinks = _sinks(heads, gen)
    scale = head_dim**-0.5
    args = (q, k, v, table, lens, scale, window, softcap)
    out = tk.paged_decode_attention(*args, block_size=block_size, sinks=sinks)
    ref = reference_decode_attention(*args, block_size=block_size, sinks=sinks)
    plain = reference_decode_attention(*args, block_size=block_size)
    assert (out[0] == 0).all() and (ref[0] == 0).all()  # no keys: nothing but the sink
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert not torch.allclose(ref[1:].float(), plain[1:].float(), atol=1e-3)  # the sinks mattered
    for b, n in enumerate(kv_lens):
        if n:
            dense = dense_attention(q[b : b + 1], k, v, table[b].cpu(), n, block_size, scale, window, softcap,
                                    sinks=sinks)
            torch.testing.assert_close(ref[b : b + 1].double(), dense, **TOL[dtype])


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,window,softcap,dtype", CASES)
def test_varlen_with_sinks(block_size, heads, kv_heads, head_dim, window, softcap, dtype):
    m = tk.VARLEN_BLOCK_M
    reqs = [(1, 1), (m + 5, m + 5), (1, 40), (3, 9)]
    kv_lens = [kv for _, kv in reqs]
    k, v, table, lens, gen = _setup(kv_lens, block_size, heads, kv_heads, head_dim, dtype, "tokens", seed=11)
    cu_list = [0]
    for n, _ in reqs:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=DEVICE)
    q = torch.randn(cu_list[-1], heads, head_dim, generator=gen).to(DEVICE, dtype)
    tile_request, tile_start = (t.to(DEVICE) for t in tk.varlen_tiles(cu.cpu()))
    sinks = _sinks(heads, gen)
    scale = head_dim**-0.5
    args = (q, k, v, table, lens, cu, tile_request, tile_start, scale, window, softcap)
    out = tk.paged_varlen_attention(*args, block_size=block_size, sinks=sinks)
    ref = reference_varlen_attention(*args, block_size=block_size, sinks=sinks)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for b, (n, kv) in enumerate(reqs):
        rows = slice(cu_list[b], cu_list[b + 1])
        dense = dense_attention(q[rows], k, v, table[b].cpu(), kv, block_size, scale, window, softcap, sinks=sinks)
        torch.testing.assert_close(ref[rows].double(), dense, **TOL[dtype])


def test_sinks_must_be_one_per_query_head():
    k, v, table, lens, gen = _setup([3], 4, 4, 2, 16, torch.float32, "heads", seed=0)
    q = torch.randn(1, 4, 16, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="sinks"):
        tk.paged_decode_attention(q, k, v, table, lens, 1.0, block_size=4, sinks=torch.zeros(2, device=DEVICE))
