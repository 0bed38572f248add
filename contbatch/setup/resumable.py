"""Can a recurrent model resume a prompt from a state the engine kept? Checked once at start.

The engine computes long prompts in chunks and recomputes evicted requests; each chunk of a
recurrent layer starts from the state the previous one left. Some mixers' multi-token path
ignores a given state (Mamba 1's selective scan starts from zero: its kernel has no initial
state), so their chunked prompts would differ from `generate`'s. One probe tells them apart.
"""

from __future__ import annotations

import inspect
import sys

import torch

RESUME_SPLIT = (5, 8)  # tokens of the first piece, and of the whole probe


def resume_gap(model: torch.nn.Module) -> str | None:
    """A recurrent model's prompt computed in two pieces, the second resuming from the state
    the first left (transformers' own cache), must give the logits of the prompt computed
    whole: the engine chunks prompts and resumes them from the states it keeps. Mixers whose
    multi-token path ignores a saved state (Mamba 1's scan starts from zero) fail this.
    Returns why the model cannot be served, or None."""
    from transformers import DynamicCache

    first, total = RESUME_SPLIT
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.arange(total, device=device)[None] % max(1, vocab - 3) + 3
    pos = torch.arange(total, device=device)[None]
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    try:
        with torch.inference_mode():
            whole = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, -1].float()
            cls = _own_cache_class(model, DynamicCache)
            cache = cls(config=model.config) if "config" in inspect.signature(cls).parameters else cls()
            model(input_ids=ids[:, :first], position_ids=pos[:, :first], use_cache=True, **{name: cache})
            split = model(input_ids=ids[:, first:], position_ids=pos[:, first:], use_cache=True,
                          **{name: cache}).logits[0, -1].float()
    except Exception as exc:
        return (f"its recurrent layers could not resume a prompt from a saved state "
                f"({type(exc).__name__}: {str(exc)[:200]})")
    scale = max(1.0, whole.abs().max().item())
    tolerance = (1e-3 if next(model.parameters()).dtype == torch.float32 else 2e-2) * scale
    gap = (whole - split).abs().max().item()
    if gap <= tolerance:
        return None
    return (f"its recurrent layers do not resume a prompt from a saved state (a prompt computed in two pieces "
            f"differs from the prompt computed whole by {gap:.3g} in the logits), so chunked prefill and "
            "recompute would change its tokens")


def _own_cache_class(model: torch.nn.Module, default: type) -> type:
    """The cache class the model's modeling file defines for itself (MiniMax's), else `default`."""
    module = sys.modules.get(type(model).__module__)
    own = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, default) and c is not default
           and c.__module__ == module.__name__] if module else []
    return own[0] if len(own) == 1 else default
