"""Fused RMSNorm on the CPU (cpu/routers/norm.py): routed only where it matches the module's own
forward, only inside engine steps, and taken back when the manager stops."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, generate_batch
from contbatch.cpu import native, ops
from contbatch.cpu.routers import norm as norm_router

from conftest import make_tiny_model, random_prompts, reference_generate

pytestmark = pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")


def _norms(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def _randomize_norm_weights(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in _norms(model):
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 72), (2, 5, 64), (40, 16)])
def test_fused_op_matches_the_module_forward(dtype, shape):
    """Rows of any count and width (72: not a multiple of the vector width), leading dims kept;
    float32 within summation-order rounding, bfloat16 equal but for rare one-step roundings."""
    norm = type(_norms(make_tiny_model("llama"))[0])(shape[-1], eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]) * 2)
    x = (torch.randn(*shape) * 4).to(dtype)
    want = norm(x)
    got = ops.fused_rms_norm(x, norm.weight, 1e-5)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
        assert (got != want).float().mean() < 0.05


def test_plan_routes_matching_classes_and_refuses_others():
    llama = _randomize_norm_weights(make_tiny_model("llama"))
    plan = norm_router.plan_norm(llama)
    assert plan.classes == ("LlamaRMSNorm",) and f"fused for {len(_norms(llama))} modules" in plan.summary
    json.dumps(dataclasses.asdict(plan))  # part of resolved_config.as_dict()
    gemma = _randomize_norm_weights(make_tiny_model("gemma2"))  # scales by 1 + weight: not ours
    refused = norm_router.plan_norm(gemma)
    assert refused.classes == () and "left to PyTorch: Gemma2RMSNorm (max relative difference" in refused.summary
    assert norm_router.plan_norm(llama, "off").classes == ()
    with pytest.raises(ValueError, match=r"cpu_kernel_overrides\['norm'\]"):
        ContinuousBatchingConfig(cpu_kernel_overrides={"norm": "fused"})


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_routes_step_calls_only_exactly_and_takes_them_back(arch):
    """Greedy tokens equal `model.generate`'s with the fused norms (Qwen3: its per-head q/k
    norms too); the user's own forward while the manager runs never reaches the fused op,
    and stopping leaves no trace on the modules."""
    model = _randomize_norm_weights(make_tiny_model(arch))
    calls = []
    real = ops.fused_rms_norm

    def counting(x, w, eps):
        calls.append(x.shape)
        return real(x, w, eps)

    prompts = random_prompts(6, 1, 30, seed=9)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    manager = ContinuousBatchingManager(model, gc, ContinuousBatchingConfig(block_size=4, max_batch_tokens=24))
    assert manager.resolved_config.cpu.norm.classes
    ops.fused_rms_norm = counting
    try:
        manager.start()
        try:
            ids = manager.add_requests(prompts)
            results = [manager.get_result(i, timeout=60) for i in ids]
            assert calls, "engine steps did not use the fused norm"
            seen = len(calls)
            with torch.no_grad():
                model(torch.tensor([prompts[0]]))  # the user's forward, while attached
            assert len(calls) == seen, "a forward outside the engine was routed"
        finally:
            manager.stop(timeout=30)
    finally:
        ops.fused_rms_norm = real
    for prompt, result in zip(prompts, results):
        assert result.generated_tokens == reference_generate(model, prompt, 6)
    assert not any(set(norm_router.ATTRIBUTES) & set(m.__dict__) for m in _norms(model))
    assert ContinuousBatchingManager(model, config=ContinuousBatchingConfig(cpu_kernel_overrides={"norm": "off"})
                                     ).resolved_config.cpu.norm.summary == "aten (as asked)"
