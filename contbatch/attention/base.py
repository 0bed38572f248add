"""What every attention backend is: the protocol the step runner calls, and `KernelBackend`,
the shape of the backends whose kernels walk the block tables themselves.

Every backend takes the same `StepMetadata` and answers two calls: `prepare(host, cache)`,
once per step on the host copies (what it derives is shared by every layer), and `attend`,
once per layer. The kernel backends (`triton`, `flash`, `reference`) need nothing prepared:
a `decode` kernel for decode-only steps (the fast path; None when it is off) and a `varlen`
one for any step, with `q: [T, H, D]` and caches as logical `[H_kv, slots, D]` views. The
`torch` backend (`torch_backend.py`) plans batched decode groups and per-request prefill
rows instead. `select.py` chooses and loads one at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from .metadata import layer_chunk

if TYPE_CHECKING:
    from ..cache.paged_cache import PagedAttentionCache
    from .metadata import StepMetadata

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


@dataclass(frozen=True)
class KernelBackend:
    name: str
    decode: Kernel | None
    varlen: Kernel
    varlen_tiles: Callable[[torch.Tensor, int | None], tuple[torch.Tensor, torch.Tensor]] | None = None
    max_varlen_tiles: Callable[[int, int], int] | None = None
    kv_keyed: bool = False

    @property
    def fast_decode(self) -> bool:
        return self.decode is not None

    def prepare(self, host: dict[str, torch.Tensor], cache: PagedAttentionCache) -> None:
        return None

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: StepMetadata, layer: int,
               scaling: float, sliding_window: int | None, softcap: float | None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Keys come from the cache only (this step's were just written): `[1, T, H, D]` out.
        Sinks and chunks reach only our kernels (start-up refuses them on flash-attn)."""
        q = query[0].transpose(0, 1)  # [T, H, D]; contiguous, as the projections lay it out
        k_cache, v_cache = meta.cache.kv(layer)
        kernel = self.decode if meta.decode_only and self.decode is not None else self.varlen
        extra = {} if sinks is None else {"sinks": sinks}
        chunk = layer_chunk(meta, layer)
        if chunk is not None:
            extra["chunk"] = chunk
        return kernel(q, k_cache, v_cache, meta, scaling, sliding_window, softcap, **extra).unsqueeze(0)
