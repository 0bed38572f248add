"""The backbone: greedy float32 output equals `model.generate`, whatever the batch mix."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, continuous_batching, generate_batch

from conftest import random_prompts, reference_generate


def _check(model, prompts, max_new, config, eos=None):
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos)
    results = generate_batch(model, prompts, gc, config, progress_bar=False)
    assert list(results) == [f"req_{i}" for i in range(len(prompts))]
    mismatches = []
    for i, prompt in enumerate(prompts):
        out = results[f"req_{i}"]
        assert out.error is None, out.error
        expected = reference_generate(model, prompt, max_new, eos)
        if out.generated_tokens != expected:
            mismatches.append((i, len(prompt), expected, out.generated_tokens))
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} differ; first: {mismatches[0]}"
    return results


def test_tiny_models_mixed_batch_chunked_small_blocks(tiny_model):
    """56 requests of 1..90 tokens, 4-token blocks, a 48-token step budget: long prompts are
    chunked over several steps while others decode, and sequences cross many blocks."""
    prompts = random_prompts(56, 1, 90, seed=1)
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=48)
    _check(tiny_model, prompts, 12, config)


def test_sliding_window_models(sliding_model):
    """Mistral (every layer windowed) and Gemma 2/3 (alternating, Gemma 2 soft-capped):
    prompts up to 8x the window, chunked, across 4-token blocks."""
    prompts = random_prompts(24, 1, 64, seed=12)
    with continuous_batching(
        sliding_model, GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None),
        ContinuousBatchingConfig(block_size=4, max_batch_tokens=40),
    ) as manager:
        assert manager.resolved_config.sliding_window_layers > 0
        assert any("sliding-window" in note for note in manager.resolved_config.notes)
        ids = manager.add_requests(prompts)
        outs = [manager.get_result(rid, timeout=120) for rid in ids]
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(sliding_model, prompt, 10)


def test_tiny_model_default_config(llama_model):
    prompts = random_prompts(20, 1, 60, seed=2)
    _check(llama_model, prompts, 10, ContinuousBatchingConfig())


def test_tiny_model_under_kv_pressure_soft_resets(llama_model):
    """So few blocks that running requests are soft reset and recomputed, repeatedly."""
    prompts = random_prompts(24, 10, 40, seed=3)
    config = ContinuousBatchingConfig(block_size=4, num_blocks=16, max_batch_tokens=64, safety_margin=0.0)
    gc = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None)
    with continuous_batching(llama_model, gc, config) as manager:
        ids = manager.add_requests(prompts)
        results = [manager.get_result(rid, timeout=120) for rid in ids]
        stats = manager.stats()
    assert stats["soft_resets"] >= len(prompts), stats
    for prompt, out in zip(prompts, results):
        assert out.generated_tokens == reference_generate(llama_model, prompt, 16)


def test_tiny_model_one_token_per_step(llama_model):
    """A 1-token budget: every prompt is prefilled one token at a time."""
    prompts = random_prompts(6, 1, 12, seed=4)
    _check(llama_model, prompts, 5, ContinuousBatchingConfig(block_size=4, max_batch_tokens=1))


def test_eos_stops_like_generate(llama_model):
    prompts = random_prompts(30, 2, 30, seed=5)
    # Pick an EOS id that greedy decoding actually produces for some prompts.
    first = [reference_generate(llama_model, p, 8)[3] for p in prompts[:5]]
    results = _check(llama_model, prompts, 12, ContinuousBatchingConfig(block_size=8), eos=first[0])
    assert any(r.finish_reason == "stop" for r in results.values())


def test_default_model_chat_prompts(default_model):
    model, tok = default_model
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain gravity in one sentence.",
        "Hi",
        "List three prime numbers.",
        "What does a compiler do?",
    ]
    prompts = [
        list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False))
        for q in questions
    ]
    gc = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=tok.eos_token_id)
    results = generate_batch(model, prompts, gc, ContinuousBatchingConfig(block_size=16, max_batch_tokens=64), progress_bar=False)
    for i, prompt in enumerate(prompts):
        assert results[f"req_{i}"].generated_tokens == reference_generate(model, prompt, 20, tok.eos_token_id)
    assert "Paris" in tok.decode(results["req_0"].generated_tokens)


def test_default_model_few_random_prompts(default_model):
    """The default run's share of the slow test below: random token prompts (not chat text)
    on the real model, chunked across small blocks while others decode."""
    model, _ = default_model
    prompts = random_prompts(3, 1, 30, seed=7, vocab=49152)
    _check(model, prompts, 4, ContinuousBatchingConfig(block_size=8, max_batch_tokens=32))


@pytest.mark.slow
def test_default_model_many_random_prompts(default_model):
    model, _ = default_model
    prompts = random_prompts(50, 1, 120, seed=6, vocab=49152)
    _check(model, prompts, 16, ContinuousBatchingConfig(block_size=4, max_batch_tokens=96))


def test_model_is_restored_after_generate_batch(llama_model):
    before = llama_model.config._attn_implementation
    generate_batch(llama_model, [[5, 6, 7]], GenerationConfig(max_new_tokens=2, do_sample=False), progress_bar=False)
    assert llama_model.config._attn_implementation == before
    with torch.inference_mode():
        llama_model(torch.tensor([[5, 6, 7]]))  # plain forward works again
