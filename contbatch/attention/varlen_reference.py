"""Plain-PyTorch paged attention with the signatures of the Triton kernels in `triton_kernels`.

It is both the oracle the kernels are tested against and the CPU backend of the engine, so
it computes in float32 throughout (whatever the cache dtype: the reference must not round
scores to bf16) and avoids per-token Python work: decode rows are batched in groups of
similar key length, prompt chunks run one request at a time in bounded query chunks.
Attention sinks (`sinks`, one logit per query head) join each softmax as one more column
that is dropped afterwards. `chunk` (Llama 4's chunked local attention: a query sees only the
keys of its own aligned chunk) narrows the keys as a window does. Needs no triton.
"""

from __future__ import annotations

import torch

from .metadata import first_visible, visible_keys

# Decode rows whose key spans are within this factor of a group's shortest (or of
# _MIN_SPAN) share one padded batched matmul: bounded padding, few Python iterations.
_GROUP_SPREAD = 2
_MIN_SPAN = 64
# Query rows per matmul of a prompt chunk: bounds the [H, rows, keys] score tensor.
_QUERY_CHUNK = 512


def _slots(block_table_rows: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of key positions `pos` ([n, W] or [W] with one table row)."""
    blocks = torch.gather(block_table_rows, -1, pos // block_size).long()
    return blocks * block_size + pos % block_size


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Keys (or values) at `slots` ([n, W]) as a `[H_kv, n, W, D]` float32 view. The copy runs
    along whichever axis is outer in memory (a token-major cache gathers whole tokens): on a
    CPU a strided gather or re-layout costs several times the matmuls, so per-head slices of
    the result are fed to bmm as they are (any row stride is fine there)."""
    n, width = slots.shape
    flat = slots.flatten()
    if cache.stride(1) > cache.stride(0):  # token-major [slots, H_kv, D] underneath
        g = cache.transpose(0, 1).index_select(0, flat).float()
        return g.view(n, width, cache.shape[0], cache.shape[2]).permute(2, 0, 1, 3)
    return cache.index_select(1, flat).float().view(cache.shape[0], n, width, cache.shape[2])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
            softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """n independent requests of c query rows each: q [n, c, H, D], k and v [H_kv, n, W, D],
    visible [n, c, W]; returns [n, c, H, D] in float32. One bmm per kv head, its query heads
    folded into the rows, so K/V are never repeated for grouped-query attention."""
    kv_heads, n, width, head_dim = k.shape
    rows, num_heads = q.shape[1], q.shape[2]
    group = num_heads // kv_heads
    scores = q.new_empty(kv_heads, n, rows * group, width, dtype=torch.float32)
    qg = q.float().view(n, rows, kv_heads, group, head_dim)
    for h in range(kv_heads):
        torch.bmm(qg[:, :, h].reshape(n, rows * group, head_dim), k[h].transpose(1, 2), out=scores[h])
    scores *= scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(kv_heads, n, rows, group, width)
    scores.masked_fill_(~visible[None, :, :, None, :], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(kv_heads, 1, 1, group, 1).expand(kv_heads, n, rows, group, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].contiguous()
    probs = probs.view(kv_heads, n, rows * group, width)
    out = q.new_empty(n, rows, kv_heads, group, head_dim, dtype=torch.float32)
    for h in range(kv_heads):
        out[:, :, h] = torch.bmm(probs[h], v[h]).view(n, rows, group, head_dim)
    return out.view(n, rows, num_heads, head_dim)


def _decode_rows(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                 kv_lens: list[int], scale: float, sliding_window: int | None, softcap: float | None,
                 block_size: int, out: torch.Tensor, sinks: torch.Tensor | None = None,
                 chunk: int | None = None) -> None:
    """Single-query rows, written into out ([N, H, D]). Rows with no keys become zeros."""
    n_rows = q.shape[0]
    starts = [first_visible(n - 1, sliding_window, chunk) if n > 0 else 0 for n in kv_lens]
    spans = [n - s for n, s in zip(kv_lens, starts)]
    order = sorted((i for i in range(n_rows) if spans[i] > 0), key=spans.__getitem__)
    empty = [i for i in range(n_rows) if spans[i] <= 0]
    if empty:
        out[empty] = 0
    i = 0
    while i < len(order):
        limit = _GROUP_SPREAD * max(spans[order[i]], _MIN_SPAN)
        j = i
        while j < len(order) and spans[order[j]] <= limit:
            j += 1
        rows = order[i:j]
        i = j
        idx = torch.tensor(rows, device=q.device)
        lens = torch.tensor([kv_lens[r] for r in rows], device=q.device)
        pos = torch.tensor([starts[r] for r in rows], device=q.device)[:, None]
        pos = pos + torch.arange(spans[rows[-1]], device=q.device)
        visible = visible_keys(lens[:, None] - 1, pos, sliding_window, chunk)
        pos = torch.minimum(pos, lens[:, None] - 1)  # padding keys re-read a real slot, masked
        slots = _slots(block_table[idx], pos, block_size)
        o = _attend(q[idx][:, None], _gather(key_cache, slots), _gather(value_cache, slots), visible[:, None],
                    scale, softcap, sinks)
        out[idx] = o[:, 0].to(out.dtype)


def _chunk_rows(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table_row: torch.Tensor,
                kv_len: int, scale: float, sliding_window: int | None, softcap: float | None,
                block_size: int, sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """All query rows ([n, H, D]) of one request, the last n of its kv_len positions, in
    chunks of at most _QUERY_CHUNK rows (each over only the keys it can see)."""
    n = q.shape[0]
    context = kv_len - n
    result = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for c0 in range(0, n, _QUERY_CHUNK):
        c1 = min(n, c0 + _QUERY_CHUNK)
        lo = first_visible(context + c0, sliding_window, chunk)  # the chunk's first query sees the least
        q_pos = torch.arange(context + c0, context + c1, device=q.device)
        k_pos = torch.arange(lo, context + c1, device=q.device)
        slots = _slots(table_row, k_pos, block_size)[None]
        visible = visible_keys(q_pos[:, None], k_pos[None, :], sliding_window, chunk)
        result[c0:c1] = _attend(q[None, c0:c1], _gather(key_cache, slots), _gather(value_cache, slots),
                                visible[None], scale, softcap, sinks)[0]
    return result


def reference_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_table: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None, softcap: float | None = None,
                               out: torch.Tensor | None = None, *, block_size: int,
                               sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Same contract as `triton_kernels.paged_decode_attention`."""
    if out is None:
        out = torch.empty_like(q)
    _decode_rows(q, key_cache, value_cache, block_table, kv_lens.tolist(), scale, sliding_window, softcap,
                 block_size, out, sinks, chunk)
    return out


def reference_varlen_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_table: torch.Tensor, kv_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               tile_request: torch.Tensor | None = None, tile_start: torch.Tensor | None = None,
                               scale: float | None = None, sliding_window: int | None = None,
                               softcap: float | None = None, out: torch.Tensor | None = None, *,
                               block_size: int, sinks: torch.Tensor | None = None,
                               chunk: int | None = None) -> torch.Tensor:
    """Same contract as `triton_kernels.paged_varlen_attention`; the tile map is accepted
    (so the two are interchangeable) but not needed. Rows past cu_seqlens_q[-1] are left
    as they are (zeros when out is allocated here). Single-row requests take the batched
    decode path, so a mixed step costs one Python iteration per prompt chunk only."""
    if scale is None:
        raise TypeError("reference_varlen_attention() needs scale")
    if out is None:
        out = torch.zeros_like(q)
    lens = kv_lens.tolist()
    cu = cu_seqlens_q.tolist()
    single = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    if single:
        rows = torch.tensor([cu[b] for b in single], device=q.device)
        dec = torch.empty(len(single), *q.shape[1:], dtype=q.dtype, device=q.device)
        _decode_rows(q[rows], key_cache, value_cache, block_table[single], [lens[b] for b in single], scale,
                     sliding_window, softcap, block_size, dec, sinks, chunk)
        out[rows] = dec
    for b in range(len(lens)):
        if cu[b + 1] - cu[b] > 1:
            out[cu[b]:cu[b + 1]] = _chunk_rows(q[cu[b]:cu[b + 1]], key_cache, value_cache, block_table[b], lens[b],
                                               scale, sliding_window, softcap, block_size, sinks,
                                               chunk).to(out.dtype)
    return out
