"""Paged attention as one opaque custom op, for compiled steps.

`torch.compile` cannot trace the backends (host-side plans, Triton launches, the cache write
by index): left in the graph they would break it in every layer. So a compiled forward calls
`torch.ops.contbatch.paged_attention` instead, which Dynamo sees as one node per layer with a
fake implementation for shapes. The step's `StepMetadata` cannot be an operator argument (it
is not a tensor): the op takes it from `context.active_step()`, which the runner sets for
the length of every forward (`contbatch/context.py`).
"""

from __future__ import annotations

import torch

from ..context import active_step
from .metadata import cache_layer
from .temperature import tempered_query


@torch.library.custom_op("contbatch::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
                    sliding_window: int, softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Writes the layer's new K/V into the paged cache and attends (`sliding_window` -1 and
    `softcap` 0 mean none; `sinks`: one logit per query head, or None); [1, H, T, D] queries
    -> [1, T, H, D]. The cache write is a side effect on tensors the graph never sees; each
    layer touches only its own, and steps run in order, so no reordering the compiler may do
    can observe it."""
    return _paged_attention(query, key, value, layer, scaling, sliding_window, softcap, sinks)


def _paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
                     sliding_window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    meta = active_step()
    if meta is None:
        raise RuntimeError("contbatch::paged_attention called outside a compiled engine step")
    layer = cache_layer(meta, layer)
    meta.cache.write(layer, meta.write_slots, key[0], value[0])
    query = tempered_query(query, meta, layer)
    window = None if sliding_window < 0 else sliding_window
    cap = None if softcap == 0 else softcap
    return meta.backend.attend(query, key, value, meta, layer, scaling, window, cap, sinks).contiguous()


@torch.library.custom_op("contbatch::paged_attention_region", mutates_args=())
def paged_attention_region(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor,
                           scaling: float, sliding_window: int, softcap: float,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention` with the layer index as a 0-d CPU tensor, an input rather than a
    constant of the graph, so identical decoder layers trace to one nested compile region
    (`runtime/compile.py`, `mark_layer_regions`; CPU models only: a CPU input in a CUDA graph is
    left for the GPU check)."""
    # The function, not the op: a second pass through the dispatcher costs time in every layer.
    return _paged_attention(query, key, value, int(layer), scaling, sliding_window, softcap, sinks)


@paged_attention.register_fake
@paged_attention_region.register_fake
def _(query, key, value, layer, scaling, sliding_window, softcap, sinks=None):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
