"""Token-exactness of a tiny model under the engine's pressures, shared by the tests of model
families with their own KV layouts (latent attention, per-layer shapes, chunked attention).

Every run is compared token for token with `model.generate` (greedy, float32) on each prompt
alone: the reference is computed here, once per model and prompt set, never by the engine.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, continuous_batching

from conftest import random_prompts, reference_generate

NEW_TOKENS = 10
# Prompts long enough to cross several 4-token blocks, windows of 8 and chunks of 8.
PROMPTS = random_prompts(8, 9, 30, seed=41)

# name -> config: each exercises another path of the engine on the same prompts.
SETTINGS: dict[str, dict] = {
    # Every prompt in one batch, prefill chunked through 16-token steps while others decode.
    "batched": dict(block_size=4, max_batch_tokens=16, num_blocks=128),
    # A pool of 14 blocks for 8 requests of up to 40 tokens: victims wait on the host tier.
    "offload": dict(block_size=4, num_blocks=14, max_batch_tokens=16, safety_margin=0.0, cpu_offload_space=1.0,
                    allow_block_sharing=False),
    # The same pool without a host tier: victims are soft reset and recomputed.
    "preempt": dict(block_size=4, num_blocks=14, max_batch_tokens=16, safety_margin=0.0, cpu_offload_space=0.0,
                    allow_block_sharing=False),
    # The plain PyTorch paths: decode rows gather their keys, prompt chunks run SDPA.
    "gather": dict(block_size=4, max_batch_tokens=16, num_blocks=128, decode_fast_path=False, cpu_kernels="off"),
    # The kernels' PyTorch reference backend (the GPU layout on the CPU).
    "reference": dict(block_size=4, max_batch_tokens=16, num_blocks=128, attention_backend="reference"),
}

_references: dict[tuple, list[list[int]]] = {}


def expected(model: torch.nn.Module, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    key = (id(model), tuple(map(tuple, prompts)))
    if key not in _references:
        _references[key] = [reference_generate(model, p, NEW_TOKENS) for p in prompts]
    return _references[key]


def served(model: torch.nn.Module, setting: str | dict, prompts: list[list[int]] = PROMPTS) -> tuple[list, dict]:
    """The engine's tokens for `prompts` under one of `SETTINGS` (or these config fields), and
    its stats."""
    gc = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    fields = SETTINGS[setting] if isinstance(setting, str) else setting
    with continuous_batching(model, gc, ContinuousBatchingConfig(**fields)) as m:
        outs = [m.get_result(rid, timeout=300) for rid in m.add_requests(prompts)]
        stats = m.stats()
    for out in outs:
        assert out is not None and not out.error, getattr(out, "error", "no result")
    return [list(o.generated_tokens) for o in outs], stats


def assert_exact(model: torch.nn.Module, setting: str, prompts: list[list[int]] = PROMPTS) -> dict:
    """The engine under `setting` reproduces `generate` token for token; returns its stats,
    after checking that the pressure settings really evicted requests."""
    tokens, stats = served(model, setting, prompts)
    want = expected(model, prompts)
    for i, (got, ref) in enumerate(zip(tokens, want)):
        assert got == ref, f"{setting}: prompt {i} ({len(prompts[i])} tokens): {got} != generate's {ref}"
    if setting == "offload":
        assert stats["offloads"] > 0 and stats["restores"] == stats["offloads"], stats
    if setting == "preempt":
        assert stats["soft_resets"] > 0, stats
    return stats
