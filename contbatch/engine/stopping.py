"""Defaults a request inherits from the `GenerationConfig` in force."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# transformers' GenerationConfig defaults to max_length=20; we count it as new tokens.
FALLBACK_MAX_NEW_TOKENS = 20


@dataclass(frozen=True)
class StopDefaults:
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    generation_config: object = None  # the config in force: sampling defaults come from it


def _as_set(eos) -> frozenset[int]:
    if eos is None:
        return frozenset()
    if isinstance(eos, torch.Tensor):
        eos = eos.reshape(-1).tolist()
    return frozenset([int(eos)] if isinstance(eos, int) else (int(e) for e in eos))


def stop_defaults(model: torch.nn.Module, generation_config=None) -> StopDefaults:
    """An explicit config is taken as is (`eos_token_id=None` means: never stop on EOS);
    without one, the model's own generation config supplies the defaults."""
    explicit = generation_config is not None
    gc = generation_config if explicit else getattr(model, "generation_config", None)
    if gc is None:
        return StopDefaults(FALLBACK_MAX_NEW_TOKENS, frozenset(), None)
    if getattr(gc, "num_beams", 1) not in (None, 1):
        raise ValueError(f"beam search (num_beams={gc.num_beams}) is not supported by continuous batching")
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else FALLBACK_MAX_NEW_TOKENS
    return StopDefaults(int(max_new), _as_set(gc.eos_token_id), gc)
