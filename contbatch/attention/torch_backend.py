"""The CPU backend: paged attention in plain PyTorch, planned once per step on the host.

From the step's host copies, `prepare` derives two kinds of work that every layer then reuses:
- decode rows (one query token each; they come first in the batch, shortest first) are
  attended in one call of our C++ kernel (`cpu/ops.py`), which reads K/V in place through
  the block tables. Without it (decode fast path off) they are split into a few groups of
  similar key length, each attended in one batched matmul against keys gathered from the
  paged cache, with grouped-query heads folded so K/V are never repeated: the reference the
  kernel is tested against;
- prefill rows (prompt chunks) are attended in one call of our C++ prefill kernel
  (`cpu/ops.py`), which reads every chunk's keys in place, the step's own included (they
  are in the cache before attention runs): 2-4x aten's SDPA on the default model's prompts.
  Without it (the `prefill` CPU kernel "off", no compiler) they run through
  `scaled_dot_product_attention` one request at a time, so each attends only to its own keys:
  a first chunk to the step's fresh K/V directly, a later one to its gathered earlier keys.
  That path is the reference the kernel is tested against.

Attention sinks (gpt-oss's `s_aux`: one learned logit per query head that joins every
softmax denominator and contributes no value) take the plain-matmul paths, which append the
sink as one more score column and drop it after the softmax, as the models' eager code does.

Layers may differ in KV heads (`cache/layout.py`): gather indices are made per head count, on
first use in a step. Layers of chunked local attention (Llama 4: a query sees only its own
aligned chunk of keys), which our C++ kernels do not implement, take the kernels' PyTorch
reference (`varlen_reference.py`), which reads the same block tables and masks the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..cache.paged_cache import PagedAttentionCache
from ..cpu import ops as cpu_ops
from .metadata import StepMetadata, layer_chunk, visible_keys
from .varlen_reference import reference_varlen_attention

MAX_DECODE_GROUPS = 4
# Rows of up to this many query tokens (speculative verification, short chunks) go through the
# decode kernel token by token: for so few queries, reading K/V in place beats gathering every
# key for SDPA (a verification step through SDPA was several times slower: benchmarks/RESULTS.md).
KERNEL_MAX_QUERY = 16
MIN_DECODE_GROUP_ROWS = 8


@dataclass
class PrefillRow:
    """A request computing several query tokens this step (a prompt chunk)."""

    q_start: int  # first row of this request in the flattened query
    q_len: int
    kv_len: int  # keys it attends to: everything cached before plus this chunk
    # Cache slots of all kv_len keys; None when the chunk is the whole sequence so far (a
    # first chunk): its keys are the step's fresh K/V.
    slots: torch.Tensor | None
    _indices: dict[int, torch.Tensor] = field(default_factory=dict)

    def kv_index(self, cache: PagedAttentionCache, kv_heads: int) -> torch.Tensor:
        """Gather index (`PagedAttentionCache.gather_index`) of the keys, for a layer of `kv_heads`."""
        return _index_for(self._indices, self.slots, cache, kv_heads)


@dataclass
class DecodeGroup:
    """Decode rows of similar length, attended in one batched matmul, padded only to the
    group's own longest row: far less gathered padding than one group for the batch."""

    row_start: int  # first decode row of the group (decode rows are the first of the batch)
    num_rows: int
    kv_len: int  # padded key length of the group
    kv_lens: torch.Tensor  # [num_rows]: real key count of each row
    slots: torch.Tensor  # [num_rows, kv_len] cache slots (the read-trash slot past a row's keys)
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _indices: dict[int, torch.Tensor] = field(default_factory=dict)

    def kv_index(self, cache: PagedAttentionCache, kv_heads: int) -> torch.Tensor:
        """Gather index, `[num_rows, kv_heads, kv_len]` flattened, for a layer of `kv_heads`."""
        return _index_for(self._indices, self.slots, cache, kv_heads)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """Additive mask `[rows, 1, 1, kv_len]`, per sliding window, built once per step."""
        mask = self._masks.get(sliding_window)
        if mask is None:
            key_pos = torch.arange(self.kv_len, device=self.kv_lens.device)[None, :]
            visible = visible_keys(self.kv_lens[:, None] - 1, key_pos, sliding_window)
            mask = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            mask.masked_fill_(~visible, float("-inf"))
            mask = mask[:, None, None, :]
            self._masks[sliding_window] = mask
        return mask


@dataclass
class DecodeRows:
    """Every decode row of the step, for the in-place kernel: its block tables and key counts."""

    num_rows: int
    block_table: torch.Tensor  # [rows, W] int32
    kv_lens: torch.Tensor  # [rows] int32


@dataclass
class PrefillChunks:
    """Every prefill chunk of the step, for the in-place kernel: where each starts among the
    step's query rows, its length, the keys it attends to, and its block table."""

    q_start: torch.Tensor  # [chunks] int32
    q_lens: torch.Tensor  # [chunks] int32
    kv_lens: torch.Tensor  # [chunks] int32
    block_table: torch.Tensor  # [chunks, W] int32


@dataclass
class TorchStep:
    decode_groups: list[DecodeGroup]
    prefill_rows: list[PrefillRow]
    num_tokens: int  # tokens of real requests; rows past it are padding (compiled steps)
    decode_rows: DecodeRows | None = None  # set instead of decode_groups when the kernel runs
    prefill_chunks: PrefillChunks | None = None  # set instead of prefill_rows when the kernel runs


def _index_for(indices: dict[int, torch.Tensor], slots: torch.Tensor, cache: PagedAttentionCache,
               kv_heads: int) -> torch.Tensor:
    """The gather index of `slots` for layers of `kv_heads` heads, made once per step."""
    index = indices.get(kv_heads)
    if index is None:
        index = indices[kv_heads] = cache.gather_index(slots, kv_heads).to(cache.device)
    return index


def _leading_short_rows(q_lens: torch.Tensor) -> int:
    """How many leading requests compute at most KERNEL_MAX_QUERY tokens (padding requests, with
    none, end the run): the kernel attends those token by token, reading K/V in place."""
    short = (q_lens >= 1) & (q_lens <= KERNEL_MAX_QUERY)
    return int(short.long().cumprod(0).sum()) if short.numel() else 0


def _one_token_rows(host: dict[str, torch.Tensor], cache: PagedAttentionCache) -> TorchStep | None:
    """The kernel's plan of a step whose every request computes one token (a decode step, the
    common one): each row its request, all its keys; what `prepare`'s general path makes of
    such a step, in a few operations. None for any other step."""
    cu_q = host["cu_seqlens_q"].numpy()
    n = cu_q.shape[0] - 1
    if n == 0 or cu_q[0] != 0 or cu_q[n] != n or not (np.diff(cu_q) == 1).all():
        return None
    return TorchStep([], [], n, _leading_decode_rows(host, n, cache.device))


def _leading_decode_rows(host: dict[str, torch.Tensor], n: int, device: torch.device) -> DecodeRows:
    """The first `n` requests as decode rows, each computing one token over all its keys."""
    return DecodeRows(n, host["block_table"][:n].to(device, torch.int32),
                      host["kv_lens"][:n].to(device, torch.int32).contiguous())


def _split_decode_rows(num_decode: int) -> list[tuple[int, int]]:
    """Equal-count groups over the length-sorted decode rows: few enough that per-group
    overhead stays small, enough that padding to each group's maximum stays modest."""
    if num_decode == 0:
        return []
    groups = max(1, min(MAX_DECODE_GROUPS, num_decode // MIN_DECODE_GROUP_ROWS))
    size = -(-num_decode // groups)
    return [(lo, min(lo + size, num_decode)) for lo in range(0, num_decode, size)]


def _softmax_scores(scores: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    """Scale (and soft-cap, Gemma-2 style) raw scores in float32, before the mask."""
    scores = scores.float() * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


class TorchBackend:
    name = "torch"
    kv_keyed = False
    varlen_tiles = None
    max_varlen_tiles = None

    def __init__(self, decode_kernel: bool = False, prefill_kernel: bool = False) -> None:
        self.fast_decode = decode_kernel  # decode rows read K/V in place (C++ kernel)
        self.prefill_kernel = prefill_kernel  # so do prefill chunks (C++ kernel), else SDPA

    def prepare(self, host: dict[str, torch.Tensor], cache: PagedAttentionCache) -> TorchStep:
        """Decode groups and prefill rows from the step's host tensors (an unpadded step)."""
        if self.fast_decode:
            step = _one_token_rows(host, cache)
            if step is not None:
                return step
        bs, device = cache.block_size, cache.device
        cu_q = host["cu_seqlens_q"].long()
        q_lens = cu_q[1:] - cu_q[:-1]
        kv_lens = host["kv_lens"].long()
        table = host["block_table"].long()
        # The kernel takes every query token of the leading short rows (decode rows, then
        # speculative verification runs and short chunks, which the batch orders next), each
        # token as a row of its own that sees the keys up to its position.
        num_decode = _leading_short_rows(q_lens) if self.fast_decode else int((q_lens == 1).sum())
        groups = []
        decode_rows = None
        if self.fast_decode and num_decode and int(cu_q[num_decode] - cu_q[0]) == num_decode:
            # one query token a row (a decode step's rows): each row is its request, all its keys
            decode_rows = _leading_decode_rows(host, num_decode, device)
        elif self.fast_decode and num_decode:
            lens = q_lens[:num_decode]
            rows = torch.repeat_interleave(torch.arange(num_decode), lens)
            offset = torch.arange(int(lens.sum())) - (cu_q[:num_decode] - cu_q[0])[rows]
            token_kv = kv_lens[rows] - lens[rows] + offset + 1
            decode_rows = DecodeRows(len(rows), host["block_table"][rows].to(device, torch.int32),
                                     token_kv.to(device, torch.int32).contiguous())
        for lo, hi in ([] if decode_rows else _split_decode_rows(num_decode)):
            lens = kv_lens[lo:hi]
            length = int(lens.max())
            key_pos = torch.arange(length)
            slots = table[lo:hi, key_pos // bs] * bs + key_pos % bs
            slots = torch.where(key_pos[None, :] < lens[:, None], slots, cache.read_trash_slot)
            groups.append(DecodeGroup(lo, hi - lo, length, lens.to(device), slots))
        if self.prefill_kernel:
            chunks = torch.arange(num_decode, len(q_lens))
            chunks = chunks[q_lens[chunks] > 0]  # padding requests (a compiled step's bucket) have none
            prefill = None
            if len(chunks):
                as_int = {"device": device, "dtype": torch.int32}
                prefill = PrefillChunks(cu_q[chunks].to(**as_int), q_lens[chunks].to(**as_int),
                                        kv_lens[chunks].to(**as_int), host["block_table"][chunks].to(**as_int))
            return TorchStep(groups, [], int(cu_q[-1]), decode_rows, prefill)
        rows = []
        for i in range(num_decode, len(q_lens)):
            q_len, kv_len = int(q_lens[i]), int(kv_lens[i])
            if q_len == 0:  # a padding request (a compiled step's bucket): nothing to attend
                continue
            slots = None
            if kv_len > q_len:
                key_pos = torch.arange(kv_len)
                slots = table[i, key_pos // bs] * bs + key_pos % bs
            rows.append(PrefillRow(int(cu_q[i]), q_len, kv_len, slots))
        return TorchStep(groups, rows, int(cu_q[-1]), decode_rows)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: StepMetadata, layer: int,
               scaling: float, sliding_window: int | None, softcap: float | None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query: [1, H, T, D]; key/value: [1, H_kv, T, D] (already in the cache); sinks: [H]
        or None; -> [1, T, H, D]."""
        step: TorchStep = meta.prepared
        chunk = layer_chunk(meta, layer)
        if chunk is not None:
            return _chunked(query, meta, layer, scaling, sliding_window, softcap, sinks, chunk)
        _, num_heads, total, head_dim = query.shape
        out = query.new_empty(total, num_heads, head_dim)
        if step.num_tokens < total:
            out[step.num_tokens :] = 0  # padding tokens belong to no request: keep them finite
        if step.decode_rows is not None:
            n = step.decode_rows.num_rows
            k_cache, v_cache = meta.cache.kv(layer)
            q = query[0, :, :n].transpose(0, 1).contiguous()
            out[:n] = cpu_ops.paged_decode(q, k_cache, v_cache, step.decode_rows.block_table,
                                           step.decode_rows.kv_lens, sinks, meta.cache.block_size, scaling,
                                              sliding_window, softcap)
        for group in step.decode_groups:
            rows = slice(group.row_start, group.row_start + group.num_rows)
            out[rows] = _decode(query[0, :, rows], group, meta.cache, layer, scaling, sliding_window, softcap,
                                sinks)
        if step.prefill_chunks is not None:
            c = step.prefill_chunks
            k_cache, v_cache = meta.cache.kv(layer)
            q = query[0].transpose(0, 1)  # [T, H, D]: the projections' layout, no copy
            q = q if q.stride(-1) == 1 else q.contiguous()
            cpu_ops.paged_prefill(q, k_cache, v_cache, c.block_table, c.q_start, c.q_lens, c.kv_lens, sinks,
                                  meta.cache.block_size, scaling, sliding_window, softcap, out)
        for row in step.prefill_rows:
            s, n = row.q_start, row.q_len
            q = query[:, :, s : s + n]
            if row.slots is None:
                k, v = key[:, :, s : s + n], value[:, :, s : s + n]
            else:
                k, v = meta.cache.gather(layer, row.kv_index(meta.cache, key.shape[1]))
                k, v = k.view(1, -1, row.kv_len, head_dim), v.view(1, -1, row.kv_len, head_dim)
            if softcap is None and sinks is None and row.slots is None and sliding_window is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
            else:
                q_pos = torch.arange(row.kv_len - n, row.kv_len, device=query.device)[:, None]
                mask = visible_keys(q_pos, torch.arange(row.kv_len, device=query.device)[None, :], sliding_window)
                if softcap is not None or sinks is not None:
                    o = _grouped_prefill(q, k, v, mask, scaling, softcap, sinks)
                else:
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
            out[s : s + n] = o[0].transpose(0, 1)
        return out.unsqueeze(0)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of `[..., kv_heads, group, rows, keys]`-shaped scores; with
    sinks ([H] = kv_heads * group), each head's sink logit joins the denominator only."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    kv_heads, group = scores.shape[-4], scores.shape[-3]
    sink = sinks.float().view(kv_heads, group, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _decode(query: torch.Tensor, group: DecodeGroup, cache: PagedAttentionCache, layer: int, scaling: float,
            sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query: [H, B, D] for the B rows of a decode group; returns [B, H, D]."""
    num_heads, batch, head_dim = query.shape
    kv_heads = cache.layout.layer(layer).kv_heads
    keys, values = cache.gather(layer, group.kv_index(cache, kv_heads))
    keys = keys.view(batch, kv_heads, group.kv_len, head_dim)
    values = values.view(batch, kv_heads, group.kv_len, head_dim)
    # Fold the query heads that share a KV head into one matrix: K/V are never repeated.
    q = query.transpose(0, 1).reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    scores = _softmax_scores(torch.matmul(q, keys.transpose(-1, -2)), scaling, softcap)
    scores = scores + group.mask(sliding_window)  # [B, KV, G, L]
    probs = _softmax(scores.unsqueeze(-2), sinks).squeeze(-2).to(values.dtype)
    return torch.matmul(probs, values).reshape(batch, num_heads, head_dim)


def _grouped_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scaling: float, softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in plain matmuls, for what SDPA cannot express (soft-capping, sinks).
    q: [1, H, n, D]; k, v: [1, H_kv, L, D]; visible: [n, L]. Returns [1, H, n, D]."""
    _, num_heads, n, head_dim = q.shape
    kv_heads = k.shape[1]
    qg = q[0].reshape(kv_heads, num_heads // kv_heads, n, head_dim)
    scores = _softmax_scores(torch.matmul(qg, k[0].unsqueeze(1).transpose(-1, -2)), scaling, softcap)
    scores = scores.masked_fill(~visible, float("-inf"))  # [KV, G, n, L]
    probs = _softmax(scores, sinks).to(v.dtype)
    return torch.matmul(probs, v[0].unsqueeze(1)).reshape(1, num_heads, n, head_dim)


def _chunked(query: torch.Tensor, meta: StepMetadata, layer: int, scaling: float, sliding_window: int | None,
             softcap: float | None, sinks: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """A layer of chunked local attention, every row of the step, through the kernels' PyTorch
    reference (float32 scores), which masks each query to its own chunk. query: [1, H, T, D]."""
    k_cache, v_cache = meta.cache.kv(layer)
    q = query[0].transpose(0, 1)
    out = reference_varlen_attention(q, k_cache, v_cache, meta.block_table, meta.kv_lens, meta.cu_seqlens_q,
                                     scale=scaling, sliding_window=sliding_window, softcap=softcap,
                                     block_size=meta.cache.block_size, sinks=sinks, chunk=chunk)
    return out.unsqueeze(0)
