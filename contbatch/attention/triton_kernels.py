"""Paged attention in Triton: a decode kernel and a variable-length (mixed-step) kernel.

Both read K/V straight from the paged cache through the block table, one key tile at a time,
with an online softmax, so no gathered copy of a request's keys is ever made. Every length
is read from device memory inside the kernel and each launch grid depends only on batch
shapes, so a launch can be captured in a CUDA graph and replayed for any lengths.

Attention sinks (one logit per query head that joins the softmax denominator and carries no
value) start each row's online softmax: running max = the sink, running sum = 1.
Chunked local attention (`chunk`: a query sees only keys of its own aligned chunk) narrows
each row's keys as a window does: a lower bound on the key tiles plus a mask.

Only long-standing Triton features are used (masked loads/stores, `tl.dot`, dynamic `range`
bounds, constexpr specialisation): the kernels must compile on older Triton releases than
the one they are tested with. Importing this module needs no GPU; under
`TRITON_INTERPRET=1` (set by the caller before importing triton) the kernels run on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Query rows per varlen program: large enough that each loaded key tile serves many queries
# of a long prompt chunk, small enough that a short chunk or a decode row wastes little.
VARLEN_BLOCK_M: int = 32
# Keys per inner-loop tile, for both kernels.
BLOCK_N: int = 32
# `tl.dot` needs every dimension of at least 16 on the GPU.
_MIN_DOT: int = 16


@triton.jit
def _tanh(x):
    """tanh from one exp of a non-positive argument: never overflows, and its absolute
    error (what the softmax sees after scaling by the cap) stays at float rounding level.
    Written out because tanh is not a core `tl` op on every supported Triton release."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Triton's CPU interpreter multiplies bf16 bit patterns in `tl.dot` (bf16 arithmetic is
    unsupported there, triton-lang/triton#11584), so under it the operands are widened to
    fp32 first: exact for bf16/fp16 values, so the result matches the GPU's fp32-accumulated
    half-precision product. Compiled kernels never take that branch."""
    if UPCAST:
        d = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        d = tl.dot(a, b, input_precision=DOT_PRECISION)
    return d


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, row_ok, start, hi, k_base, v_base, bt_row,
                 stride_ks, stride_vs, scale, softcap, window, chunk, BLOCK_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_CHUNK: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N), shared by both kernels.
    Slots are resolved per key because block_size need not divide (or be a multiple of)
    the tile. Masked scores are -inf while the running max starts finite, so a row that
    sees nothing in a tile (or at all) never produces inf - inf."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < hi
    d_ok = offs_d < HEAD_DIM
    block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
    k_t = tl.load(k_base + slot[None, :] * stride_ks + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    s = _dot(q, k_t, DOT_PRECISION, UPCAST) * scale
    if USE_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    visible = row_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
    if USE_CHUNK:  # the query's own aligned chunk only (Llama 4's chunked local attention)
        visible = visible & (offs_n[None, :] >= q_pos[:, None] - q_pos[:, None] % chunk)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, kv_lens_ptr, out_ptr, sink_ptr,
                   stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
                   stride_bt, stride_ob, stride_oh, scale, softcap, window, chunk,
                   BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
                   USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr, USE_CHUNK: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One program per (request, kv head). The GROUP query heads sharing the kv head are
    the rows of one `tl.dot`, padded to BLOCK_H >= 16: each K/V tile is loaded once for the
    whole group, and the products run on tensor cores for half-precision caches (for fp32,
    "ieee" precision keeps them exact). The padded rows are never stored."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    q_mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    kv_len = tl.load(kv_lens_ptr + b)
    q_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + (kv_len - 1)
    lo = 0
    if USE_WINDOW:
        lo = (tl.maximum(kv_len - window, 0) // BLOCK_N) * BLOCK_N
    if USE_CHUNK:
        last = tl.maximum(kv_len - 1, 0)
        lo = tl.maximum(lo, ((last - last % chunk) // BLOCK_N) * BLOCK_N)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if USE_SINKS:
        m_i = tl.load(sink_ptr + heads, mask=h_ok, other=-1.0e30).to(tl.float32)
        l_i = tl.where(h_ok, 1.0, 0.0)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for start in range(lo, kv_len, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, h_ok, start, kv_len, k_base, v_base, bt_row,
                                     stride_ks, stride_vs, scale, softcap, window, chunk, BLOCK_SIZE,
                                     HEAD_DIM, BLOCK_D, BLOCK_N, USE_WINDOW, USE_SOFTCAP, USE_CHUNK,
                                     DOT_PRECISION, UPCAST)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # kv_len == 0: acc is 0, so the row is 0
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _varlen_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, kv_lens_ptr, cu_q_ptr, tile_req_ptr, tile_start_ptr, out_ptr,
                   sink_ptr, stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
                   stride_bt, stride_ot, stride_oh, scale, softcap, window, chunk,
                   BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
                   USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr, USE_CHUNK: tl.constexpr,
                   DOT_PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr):
    """One program per (query tile, query head). The tile map is an input rather than
    derived from the program id so the grid stays fixed (padding tiles are -1 and exit)."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    if req < 0:
        return
    row0 = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(cu_q_ptr + req)
    q_end = tl.load(cu_q_ptr + req + 1)
    kv_len = tl.load(kv_lens_ptr + req)
    context = kv_len - (q_end - q_begin)  # keys cached before this step's rows
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = row0 + offs_m
    row_ok = rows < q_end
    q_pos = context + (rows - q_begin)
    hi = context + (tl.minimum(row0 + BLOCK_M, q_end) - q_begin)  # past the tile's last causal key
    lo = 0
    if USE_WINDOW:
        lo = (tl.maximum(context + (row0 - q_begin) - window + 1, 0) // BLOCK_N) * BLOCK_N
    if USE_CHUNK:  # the tile's first row sees the least
        first = context + (row0 - q_begin)
        lo = tl.maximum(lo, ((first - first % chunk) // BLOCK_N) * BLOCK_N)
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    row_off = rows.to(tl.int64)[:, None]
    q = tl.load(q_ptr + row_off * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sink_ptr + h).to(tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    kvh = (h // GROUP).to(tl.int64)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, row_ok, start, hi, k_base, v_base, bt_row,
                                     stride_ks, stride_vs, scale, softcap, window, chunk, BLOCK_SIZE,
                                     HEAD_DIM, BLOCK_D, BLOCK_N, USE_WINDOW, USE_SOFTCAP, USE_CHUNK,
                                     DOT_PRECISION, UPCAST)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + row_off * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def varlen_tiles(cu_seqlens_q: torch.Tensor, num_tiles: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Map each varlen program to (request, first row). Built on the host once per step
    (it reads the tile count, a device sync on GPU tensors); padding to a fixed `num_tiles`
    keeps the kernel's grid constant across steps for CUDA-graph replay."""
    cu = cu_seqlens_q.to(torch.int64)
    q_lens = cu[1:] - cu[:-1]
    per_req = (q_lens + VARLEN_BLOCK_M - 1) // VARLEN_BLOCK_M
    total = int(per_req.sum())
    if num_tiles is not None and total > num_tiles:
        raise ValueError(f"batch needs {total} varlen tiles, more than the {num_tiles} provided")
    req = torch.repeat_interleave(torch.arange(len(q_lens), device=cu.device), per_req, output_size=total)
    first_tile = torch.cumsum(per_req, 0) - per_req
    within = torch.arange(total, device=cu.device) - first_tile[req]
    start = cu[req] + within * VARLEN_BLOCK_M
    if num_tiles is not None and num_tiles > total:
        pad = num_tiles - total
        req = torch.cat([req, req.new_full((pad,), -1)])
        start = torch.cat([start, start.new_zeros(pad)])
    return req.to(torch.int32), start.to(torch.int32)


def max_varlen_tiles(num_tokens: int, num_requests: int) -> int:
    """Bound on `varlen_tiles` for any split of num_tokens rows among num_requests requests:
    the sum of the per-request floors is at most the floor of the sum, plus one partial
    tile per request."""
    return num_tokens // VARLEN_BLOCK_M + num_requests


def _check(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
           block_size: int, sliding_window: int | None, out: torch.Tensor | None,
           index: tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
    """Host-only checks (no device sync, so a launch stays capturable). The kernels assume
    unit stride on the head dim and int32, contiguous index tensors."""
    head_dim = q.shape[-1]
    num_heads = q.shape[1]
    kv_heads = key_cache.shape[0]
    if key_cache.shape != value_cache.shape or key_cache.shape[2] != head_dim:
        raise ValueError(f"cache shapes {tuple(key_cache.shape)}, {tuple(value_cache.shape)} "
                         f"do not fit head_dim {head_dim}")
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {kv_heads} kv heads")
    dtypes = (q.dtype, key_cache.dtype, value_cache.dtype)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or len(set(dtypes)) != 1:
        raise ValueError(f"q and caches must share one of float32/float16/bfloat16, got {dtypes}")
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on its last (head_dim) axis")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must match q: {tuple(out.shape)} {out.dtype} vs {tuple(q.shape)} {q.dtype}")
    if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        raise ValueError("block_table must be int32 with unit stride on its last axis")
    for t in index:
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError("kv_lens, cu_seqlens_q, tile_request and tile_start must be contiguous int32")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return num_heads // kv_heads, head_dim, max(_MIN_DOT, triton.next_power_of_2(head_dim))


def _sinks(q: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The sink logits as a contiguous [H] tensor (q itself stands in as an unread pointer)."""
    if sinks is None:
        return q
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [H] = [{q.shape[1]}], got {tuple(sinks.shape)}")
    return sinks.contiguous()


def _consts(q: torch.Tensor, sliding_window: int | None, softcap: float | None,
            sinks: torch.Tensor | None = None, chunk: int | None = None) -> dict:
    """Specialise on the features in use, so layers without a window or cap pay nothing for
    them (block_size is a constexpr too: fixed per engine, and slot arithmetic by a
    constant divisor compiles to shifts or multiplies). fp32 products run in "ieee"
    precision: TF32 would break token-exact fp32 output. For half types the precision is
    moot and "tf32" is the NVIDIA default, spelled out because a constexpr None is not
    treated as "default" by every Triton release."""
    return dict(BLOCK_N=BLOCK_N, USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
                USE_SINKS=sinks is not None, USE_CHUNK=chunk is not None,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                UPCAST=type(_decode_kernel).__name__ == "InterpretedFunction" and q.dtype != torch.float32)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, softcap: float | None = None,
                           out: torch.Tensor | None = None, *, block_size: int,
                           sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Attention of one query token per request (at position kv_lens[b] - 1) over its paged
    keys. q, out: [B, H, D]; caches: [H_kv, slots, D] views of any strides (unit last);
    sinks: [H] or None; chunk: keys of the query's own aligned chunk only (None: all).
    The grid is (B, H_kv) whatever the lengths, so the launch is CUDA-graph capturable."""
    if q.dim() != 3 or kv_lens.shape != (q.shape[0],) or block_table.shape[0] != q.shape[0]:
        raise ValueError("decode expects q [B, H, D], kv_lens [B] and block_table [B, max_blocks]")
    group, head_dim, block_d = _check(q, key_cache, value_cache, block_table, block_size, sliding_window, out,
                                      (kv_lens,))
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    _decode_kernel[(q.shape[0], key_cache.shape[0])](
        q, key_cache, value_cache, block_table, kv_lens, out, _sinks(q, sinks),
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), value_cache.stride(0),
        value_cache.stride(1), block_table.stride(0), out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(sliding_window or 0), int(chunk or 1),
        BLOCK_SIZE=int(block_size), GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=max(_MIN_DOT, triton.next_power_of_2(group)), BLOCK_D=block_d,
        **_consts(q, sliding_window, softcap, sinks, chunk))
    return out


def paged_varlen_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, kv_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           tile_request: torch.Tensor, tile_start: torch.Tensor, scale: float,
                           sliding_window: int | None = None, softcap: float | None = None,
                           out: torch.Tensor | None = None, *, block_size: int,
                           sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Causal attention of a flattened mixed step (prompt chunks and decode rows) over the
    paged cache, whose K/V already include this step's tokens. The tile map comes from
    `varlen_tiles`; rows owned by no tile (padding past cu_seqlens_q[-1]) are not written."""
    num_req = kv_lens.shape[0]
    if q.dim() != 3 or cu_seqlens_q.shape != (num_req + 1,) or block_table.shape[0] != num_req:
        raise ValueError("varlen expects q [T, H, D], kv_lens [B], cu_seqlens_q [B + 1], block_table [B, max_blocks]")
    if tile_request.shape != tile_start.shape or tile_request.dim() != 1:
        raise ValueError("tile_request and tile_start must be 1-D of equal length")
    group, head_dim, block_d = _check(q, key_cache, value_cache, block_table, block_size, sliding_window, out,
                                      (kv_lens, cu_seqlens_q, tile_request, tile_start))
    if out is None:
        out = torch.empty_like(q)
    if tile_request.shape[0] == 0 or q.shape[0] == 0:
        return out
    _varlen_kernel[(tile_request.shape[0], q.shape[1])](
        q, key_cache, value_cache, block_table, kv_lens, cu_seqlens_q, tile_request, tile_start, out, _sinks(q, sinks),
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), value_cache.stride(0),
        value_cache.stride(1), block_table.stride(0), out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(sliding_window or 0), int(chunk or 1),
        BLOCK_SIZE=int(block_size), GROUP=group, HEAD_DIM=head_dim, BLOCK_M=VARLEN_BLOCK_M, BLOCK_D=block_d,
        **_consts(q, sliding_window, softcap, sinks, chunk))
    return out
