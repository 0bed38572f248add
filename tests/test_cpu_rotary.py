"""Fused rotary embeddings on the CPU (cpu/routers/rotary.py): bit-identical to the modeling
file's own function, used only inside engine steps, the global put back by the last manager."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from transformers import GenerationConfig
from transformers.models.llama import modeling_llama

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.cpu import native, ops
from contbatch.cpu.routers import rotary as rotary_router

from conftest import make_tiny_model, random_prompts, reference_generate

pytestmark = pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
ORIGINAL = modeling_llama.apply_rotary_pos_emb


def _inputs(batch, tokens, head_dim, dtype, transposed=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if transposed:  # [B, T, H, D] viewed as [B, H, T, D], as the attention layers make it
        q = torch.randn(batch, tokens, 6, head_dim, generator=gen).to(dtype).transpose(1, 2)
        k = torch.randn(batch, tokens, 2, head_dim, generator=gen).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(batch, 6, tokens, head_dim, generator=gen).to(dtype)
        k = torch.randn(batch, 2, tokens, head_dim, generator=gen).to(dtype)
    angles = torch.rand(batch, tokens, head_dim // 2, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,tokens,head_dim,transposed", [(1, 1, 64, True), (1, 37, 64, True), (2, 5, 18, False),
                                                               (1, 100, 128, True)])
def test_fused_op_is_bit_identical_to_the_original(dtype, batch, tokens, head_dim, transposed):
    q, k, cos, sin = _inputs(batch, tokens, head_dim, dtype, transposed)
    want = ORIGINAL(q, k, cos, sin)
    got = ops.fused_rotary(q, k, cos, sin)
    for w, g in zip(want, got):
        assert g.dtype == dtype and g.shape == w.shape and torch.equal(g, w)


def test_plan_routes_matching_files_and_refuses_others():
    llama = make_tiny_model("llama")
    plan = rotary_router.plan_rotary(llama)
    assert plan.modules == ("transformers.models.llama.modeling_llama",) and "bit-identical" in plan.summary
    json.dumps(dataclasses.asdict(plan))  # part of resolved_config.as_dict()
    assert rotary_router.plan_rotary(llama, "off").modules == ()
    with pytest.raises(ValueError, match=r"cpu_kernel_overrides\['rotary'\]"):
        ContinuousBatchingConfig(cpu_kernel_overrides={"rotary": "fused"})

    def interleaved(q, k, cos, sin):  # GPT-J style pairs: not what the fused op computes
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return q * cos[:, None] + rot(q) * sin[:, None], k * cos[:, None] + rot(k) * sin[:, None]

    same, why = rotary_router._matches(interleaved, 64, torch.float32)
    assert not same and why.startswith("max difference")
    assert rotary_router._matches(ORIGINAL, 64, torch.bfloat16) == (True, "bit-identical")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_routes_step_calls_only_exactly_and_puts_the_global_back(arch):
    """Greedy tokens equal `model.generate`'s; the user's forward during the run and the
    modeling file's global after the last manager stops are the original's; a second manager
    (on another model of the same architecture) stopping first leaves the first one's routing."""
    model, other = make_tiny_model(arch), make_tiny_model(arch, seed=1)
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = module.apply_rotary_pos_emb
    calls = []
    real = ops.fused_rotary

    def counting(q, k, cos, sin):
        calls.append(q.shape)
        return real(q, k, cos, sin)

    prompts = random_prompts(6, 1, 30, seed=11)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=24)
    first, second = (ContinuousBatchingManager(m, gc, config) for m in (model, other))
    assert first.resolved_config.cpu.rotary.modules == (module.__name__,)
    ops.fused_rotary = counting
    try:
        first.start()
        second.start()
        second.stop(timeout=30)
        try:
            assert module.apply_rotary_pos_emb is not original, "the second manager took the first one's routing"
            ids = first.add_requests(prompts)
            results = [first.get_result(i, timeout=60) for i in ids]
            assert calls, "engine steps did not use the fused rotary"
            seen = len(calls)
            with torch.no_grad():
                model(torch.tensor([prompts[0]]))  # the user's forward, while attached
            assert len(calls) == seen, "a forward outside the engine was routed"
        finally:
            first.stop(timeout=30)
    finally:
        ops.fused_rotary = real
    assert module.apply_rotary_pos_emb is original
    for prompt, result in zip(prompts, results):
        assert result.generated_tokens == reference_generate(model, prompt, 6)
