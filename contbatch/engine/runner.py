"""One forward pass of the model over a ragged step, then token choice."""

from __future__ import annotations

import torch

from ..attention.paged import ENGINE_MASK
from ..faults import inject
from ..sampling.sampler import SampleResult, Sampler
from .batch import ModelInputs


class ModelRunner:
    def __init__(self, model: torch.nn.Module, sampler: Sampler | None = None) -> None:
        self.model = model
        self.sampler = sampler or Sampler()

    @torch.inference_mode()
    def run(self, inputs: ModelInputs) -> SampleResult:
        """The next token (and logprobs where asked) of every request that samples this step."""
        inject("forward")
        out = self.model(
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            attention_mask=ENGINE_MASK,
            logits_to_keep=inputs.logits_indices,
            use_cache=False,
            cb_meta=inputs.meta,
        )
        return self.sampler.sample_states(out.logits[0], inputs.sampled)
