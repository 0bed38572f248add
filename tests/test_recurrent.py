"""Hybrid models: recurrent layers (Mamba, Gated DeltaNet, short convolutions) beside paged
attention, their per-request state in `RecurrentStateCache`.

The backbone is exactness: greedy float32 tokens equal `model.generate`'s for every request of
a batch that mixes prompt chunks and decode rows, under chunked prefill, preemption (soft reset:
the state is rebuilt by recompute) and offload (the state waits with the request).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, continuous_batching
from contbatch.attention.recurrent import recurrent_mixers
from contbatch.cache.recurrent_state import LayerStates, RecurrentStateCache

from conftest import random_prompts, reference_generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from tiny_models import build_tiny  # noqa: E402

NEW = 8
GREEDY = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None)
# One family per kind of mixer: Gated DeltaNet (qwen3_next), Mamba 2 (bamba), attention and
# Mamba in the same layer (falcon_h1), short convolutions (lfm3), lightning attention with its
# own cache methods (minimax), a convolution inside the attention's projections (zaya).
FAMILIES = ["qwen3_next", "bamba", "falcon_h1", "lfm3", "minimax", "zaya"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request):
    model = build_tiny(request.param)
    assert recurrent_mixers(model), request.param
    return model


def _run(model, prompts, **overrides):
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=16, safety_margin=0.0, **overrides)
    with continuous_batching(model, GREEDY, config) as m:
        outs = [m.get_result(rid, timeout=300) for rid in m.add_requests(prompts)]
        stats, resolved, store = m.stats(), m.resolved_config, m.core.cache.recurrent
        assert store is not None and store.num_assigned == 0  # every slot given back at retirement
    return outs, stats, resolved


@pytest.mark.parametrize("offload", [0.0, 1.0])
def test_exact_under_chunking_and_pressure(hybrid, offload):
    """Eight prompts of 5-30 tokens in 16-token steps through 12 four-token blocks: prompts
    are chunked, decode rows run beside prompt chunks, and requests are evicted (soft reset or
    offloaded) and resumed; every request's tokens equal `generate`'s."""
    prompts = random_prompts(8, 5, 30, seed=41)
    outs, stats, resolved = _run(hybrid, prompts, num_blocks=12, cpu_offload_space=offload)
    assert stats["offloads"] + stats["soft_resets"] > 0, stats
    if offload:
        assert stats["offloads"] > 0
    assert resolved.recurrent_mixers == len(recurrent_mixers(hybrid))
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(hybrid, prompt, NEW)


def test_config_is_loud_and_prefix_sharing_off():
    model = build_tiny("qwen3_next")
    prompts = random_prompts(3, 6, 12, seed=42)
    outs, _, resolved = _run(model, prompts, allow_block_sharing=True)
    assert resolved.allow_block_sharing is False
    assert any("recurrent layers keep a per-request state" in n and "prefix sharing off" in n for n in resolved.notes)
    assert resolved.decode_compile is None and resolved.varlen_compile is None
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(model, prompt, NEW)


def test_speculative_decoding_is_refused():
    model = build_tiny("bamba")
    config = ContinuousBatchingConfig(speculative_config={"num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="recurrent layers.*rolled back"):
        with continuous_batching(model, GREEDY, config):
            pass


def test_user_forward_runs_unwrapped_while_attached_and_after():
    """`generate` on the attached model (another thread's own forward) runs the mixers as they
    are; the wrappers leave with the manager."""
    model = build_tiny("lfm3")
    prompt = random_prompts(1, 9, 9, seed=43)[0]
    before = reference_generate(model, prompt, NEW)
    with continuous_batching(model, GREEDY, ContinuousBatchingConfig(block_size=4)) as m:
        assert all("forward" in mixer.__dict__ for mixer in recurrent_mixers(model))
        assert reference_generate(model, prompt, NEW) == before
        assert m.get_result(m.add_request(prompt), timeout=120).generated_tokens == before
    assert not any("forward" in mixer.__dict__ for mixer in recurrent_mixers(model))


@pytest.mark.parametrize("arch", ["recurrent_gemma", "rwkv"])
def test_mixers_without_the_cache_api_are_refused(arch):
    """Recurrent layers that keep state their own way (not through transformers' recurrent
    cache API) are refused at start with the reason, never served wrong."""
    model = build_tiny(arch)
    with pytest.raises(ValueError, match="recurrent|state-space|linear-attention"):
        with continuous_batching(model, GREEDY, ContinuousBatchingConfig(block_size=4)):
            pass


def test_state_slots_assign_release_and_grow():
    store = RecurrentStateCache("cpu", initial_slots=2)
    a, b = store.assign("a"), store.assign("b")
    assert {a, b} == {0, 1}
    rows = LayerStates({0: torch.ones(2, 3, 4)}, {0: torch.full((2, 5), 2.0)}, {0: 4})
    store.write(7, torch.tensor([a, b]), rows)
    c = store.assign("c")  # a third request: the tables double, the stored rows stay
    assert store.capacity == 4 and c not in (a, b)
    got = store.read(7, torch.tensor([b]))
    assert torch.equal(got.conv[0], torch.ones(1, 3, 4)) and torch.equal(got.recurrent[0], torch.full((1, 5), 2.0))
    assert torch.count_nonzero(store.read(7, torch.tensor([c])).conv[0]) == 0
    store.release("a")
    again = store.assign("a")  # a request starting over gets a zeroed slot
    assert torch.count_nonzero(store.read(7, torch.tensor([again])).recurrent[0]) == 0
    with pytest.raises(RuntimeError, match="holds no recurrent state"):
        store.slot("never-started")


@pytest.mark.parametrize("arch", ["mamba", "jamba"])
def test_mixers_that_cannot_resume_a_prompt_are_refused(arch):
    """Mamba 1's multi-token scan starts from zero whatever state it is given: a chunked prompt
    would differ from `generate`'s, so the start-up probe refuses it with the measured gap."""
    model = build_tiny(arch)
    with pytest.raises(ValueError, match="do not resume a prompt from a saved state"):
        with continuous_batching(model, GREEDY, ContinuousBatchingConfig(block_size=4)):
            pass


def test_attention_free_model_is_exact():
    """A model of recurrent layers only (Mamba 2): no KV at all, the blocks only number positions."""
    model = build_tiny("mamba2")
    prompts = random_prompts(5, 5, 30, seed=44)
    outs, _, resolved = _run(model, prompts, num_blocks=40)
    assert resolved.kv_cache_bytes == 0
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(model, prompt, NEW)
