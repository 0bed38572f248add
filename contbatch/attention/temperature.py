"""Queries scaled by their position: Llama 4's attention temperature on its no-rope layers.

With `attn_temperature_tuning`, a no-rope layer multiplies each query by
`log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`, with `pos` counted from the length of
its own cache. An engine step passes no cache, so the model counts a step's rows from 0, and a
packed step holds several requests anyway. Below `floor_scale - 1` that factor is exactly 1:
the start-up check (`setup/layer_checks.py`) holds every step under `floor_scale` tokens, so
the query arrives unscaled, and here it is scaled as `generate` scales it, from the step's true
positions (`StepMetadata.positions`), with the same operations in the same order: bit for bit
the model's query. Device-side only (no host sync), so CUDA graphs and compiled steps take it.
"""

from __future__ import annotations

import torch

from .metadata import StepMetadata


def tempered_query(query: torch.Tensor, meta: StepMetadata, layer: int) -> torch.Tensor:
    """query [1, H, T, D] as the layer's temperature scales it (unchanged for other layers)."""
    temperature = meta.cache.layout.layer(layer).temperature
    if temperature is None:
        return query
    if meta.positions is None:
        raise RuntimeError("a layer tempers its queries by position, but the step carries no positions")
    floor_scale, attn_scale = temperature
    pos = meta.positions.reshape(-1)[: query.shape[2]]
    scales = torch.log1p(torch.floor((pos.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (query * scales.view(1, 1, -1, 1)).to(query.dtype)
