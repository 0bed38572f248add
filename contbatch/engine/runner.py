"""One forward pass of the model over a ragged step, then token choice."""

from __future__ import annotations

import torch

from ..attention.paged import ENGINE_MASK
from ..sampling.greedy import greedy
from .batch import ModelInputs


class ModelRunner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.inference_mode()
    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Returns the next token of every request that samples this step."""
        out = self.model(
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            attention_mask=ENGINE_MASK,
            logits_to_keep=inputs.logits_indices,
            use_cache=False,
            cb_meta=inputs.meta,
        )
        return greedy(out.logits[0])
