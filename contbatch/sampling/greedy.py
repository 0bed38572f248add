"""Token choice from a step's logits, batched over every sampling request."""

from __future__ import annotations

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits: [S, V] -> token ids [S]. Argmax in float32, like `model.generate`."""
    return logits.float().argmax(dim=-1)
