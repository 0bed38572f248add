"""The one object that carries a step's layout into the model's forward, and the protocol of
the attention backends that read it.

`StepMetadata` is built once per step by the runner (`runtime/step_runner.py`), passed to
`model(...)` as the `step_metadata` keyword, which `transformers` forwards untouched to every
attention call. Every backend (`AttentionBackend`) takes the same fields and answers two
calls: `prepare(host, cache)`, once per step on the host copies, and `attend`, once per layer;
what one backend derives for itself (the CPU backend's decode groups) it computes once in
`prepare` and finds in `prepared`, shared by all layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..cache.paged_cache import PagedAttentionCache


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None,
                 chunk: int | None = None) -> torch.Tensor:
    """Which keys a query may see: causal, within the window where the layer has one
    (`q - k < window`, as `transformers` masks it), and in the query's own aligned chunk where
    the layer attends in chunks (`k // chunk == q // chunk`, Llama 4's chunked local attention:
    with `k <= q`, the same as `k >= first_visible(q)`). Broadcasts over its inputs."""
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    if chunk is not None:
        visible &= k_pos >= q_pos - q_pos % chunk
    return visible


def first_visible(q_pos: int, sliding_window: int | None, chunk: int | None = None) -> int:
    """The first key position a query at `q_pos` sees (`visible_keys`' lower bound)."""
    lo = 0 if sliding_window is None else max(0, q_pos - sliding_window + 1)
    return lo if chunk is None else max(lo, q_pos - q_pos % chunk)


def layer_chunk(meta: "StepMetadata", layer: int) -> int | None:
    """The attention chunk of a cache layer (None: not chunked), from the cache's layout."""
    return meta.cache.layout.layer(layer).chunk


@dataclass
class StepMetadata:
    """A step as index tensors on the model's device (fixed addresses under CUDA graphs):
    nothing the kernels need is read on the host during the forward."""

    cache: PagedAttentionCache
    backend: AttentionBackend
    decode_only: bool  # every request computes one token: the decode fast path may take it
    write_slots: torch.Tensor  # [T]: where each new token's K/V goes
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    kv_lens: torch.Tensor  # [B] int32: keys each request attends to, this step's included
    block_table: torch.Tensor  # [B, W] int32
    tile_request: torch.Tensor | None  # varlen query tiles (Triton)
    tile_start: torch.Tensor | None
    max_q_len: int  # host-side bounds, for kernels whose launch needs them (flash-attn)
    max_kv_len: int
    prepared: object = None  # what the backend's `prepare` derived from the host copies
    lora: object = None  # LoRA rows grouped by adapter slot (lora/segments.py's LoraStep), None: no adapter row
    recurrent: object = None  # the step's requests for recurrent mixers (recurrent.py's RecurrentStep), None: none
    positions: torch.Tensor | None = None  # [T] int64: each token's position in its sequence


# (q, k_cache, v_cache, meta, scale, window, softcap) plus `sinks=` where the model has them and
# `chunk=` for layers of chunked local attention (the cache layout's `LayerKV.chunk`).
Kernel = Callable[..., torch.Tensor]


class AttentionBackend(Protocol):
    name: str
    fast_decode: bool  # decode-only steps take a kernel of their own
    kv_keyed: bool  # the launch takes the longest key length from the host (flash-attn)
    # Triton's varlen kernel runs one program per query tile; these size and fill the tile map.
    varlen_tiles: Callable[[torch.Tensor, int | None], tuple[torch.Tensor, torch.Tensor]] | None
    max_varlen_tiles: Callable[[int, int], int] | None

    def prepare(self, host: dict[str, torch.Tensor], cache: PagedAttentionCache) -> object: ...

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: StepMetadata, layer: int,
               scaling: float, sliding_window: int | None, softcap: float | None,
               sinks: torch.Tensor | None = None) -> torch.Tensor: ...


def cache_layer(meta: StepMetadata, layer_idx: int) -> int:
    """The cache layer of this attention call: the model's layer, or for layers that attend
    more than once per forward (`KVLayout.calls_per_layer`), one cache layer per call, in call
    order. Calls are counted per step on its metadata (modulo, so a forward run twice with the
    same metadata, as a CUDA-graph capture does, maps the same way)."""
    calls = meta.cache.layout.calls_per_layer
    if calls == 1:
        return layer_idx
    counts = meta.__dict__.setdefault("attention_calls", {})  # per step: the metadata is made per step
    n = counts.get(layer_idx, 0)
    counts[layer_idx] = n + 1
    return layer_idx * calls + n % calls
