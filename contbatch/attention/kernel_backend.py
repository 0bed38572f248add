"""`KernelBackend`: the shape of the attention backends whose kernels walk the block tables
themselves (`triton`, `flash`, `reference`), one `AttentionBackend` (metadata.py) each.

They need nothing prepared: a `decode` kernel for decode-only steps (the fast path; None when
it is off) and a `varlen` one for any step, with `q: [T, H, D]` and caches as logical
`[H_kv, slots, D]` views. The `torch` backend (`torch_backend.py`) plans batched decode
groups and per-request prefill rows instead. `select.py` chooses and loads one at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .metadata import Kernel, StepMetadata, layer_chunk

if TYPE_CHECKING:
    from ..cache.paged_cache import PagedAttentionCache


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
