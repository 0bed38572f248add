"""Float32 linear layers on oneDNN inside engine steps only (engine/cpu_linear.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, generate_batch
from contbatch.engine import cpu_linear

from conftest import make_tiny_model, random_prompts, reference_generate

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="this PyTorch build has no oneDNN linear")


@pytest.mark.parametrize("kernel", ["aten", "onednn", "auto"])
def test_greedy_output_equals_generate_with_each_kernel(llama_model, kernel):
    prompts = random_prompts(12, 1, 40, seed=5)
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=32, cpu_linear_kernel=kernel)
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None)
    results = generate_batch(llama_model, prompts, gc, config, progress_bar=False)
    for i, prompt in enumerate(prompts):
        assert results[f"req_{i}"].generated_tokens == reference_generate(llama_model, prompt, 8)


def test_forced_onednn_routes_engine_calls_only_and_is_taken_back():
    """While attached, the engine's forward goes through oneDNN; the user's own forward and
    backward on the same model are the unmodified model's (same loss and gradients), and
    stopping the manager leaves no trace on the modules."""
    model = make_tiny_model("llama")
    twin = copy.deepcopy(model)
    ids = torch.tensor([random_prompts(1, 12, 12, seed=3)[0]])
    calls = []
    real = cpu_linear.onednn_linear

    def counting(x, w, b):
        calls.append(tuple(w.shape))
        return real(x, w, b)

    manager = ContinuousBatchingManager(model, GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None),
                                        ContinuousBatchingConfig(block_size=4, cpu_linear_kernel="onednn"))
    r = manager.resolved_config.cpu_linear
    assert r.kernel == "onednn" and r.onednn_large and "as asked" in r.summary
    cpu_linear.onednn_linear = counting
    try:
        manager.start()
        try:
            rid = manager.add_request(ids[0].tolist())
            assert manager.get_result(rid, timeout=60).error is None
            assert calls, "engine steps did not use the oneDNN linear"
            seen = len(calls)
            loss = model(ids, labels=ids).loss  # the user's training step, while attached
            loss.backward()
            assert len(calls) == seen, "a forward outside the engine was routed"
        finally:
            manager.stop(timeout=30)
    finally:
        cpu_linear.onednn_linear = real
    twin_loss = twin(ids, labels=ids).loss
    twin_loss.backward()
    assert torch.equal(loss, twin_loss)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert not any("forward" in m.__dict__ or "_contbatch_route" in m.__dict__ for m in model.modules())


def test_plan_is_probed_logged_and_validated(llama_model, caplog):
    with pytest.raises(ValueError, match="cpu_linear_kernel"):
        ContinuousBatchingConfig(cpu_linear_kernel="mkl")
    aten = ContinuousBatchingManager(llama_model, config=ContinuousBatchingConfig(cpu_linear_kernel="aten"))
    assert not aten.resolved_config.cpu_linear.routes_anything
    auto = ContinuousBatchingManager(llama_model, config=ContinuousBatchingConfig()).resolved_config.cpu_linear
    shapes = {(m.out_features, m.in_features) for m in llama_model.modules() if isinstance(m, torch.nn.Linear)}
    assert set(auto.onednn_small) <= shapes and set(auto.onednn_few) <= shapes and set(auto.onednn_large) <= shapes
    assert "at 4 rows" in auto.summary
    assert "probed in" in auto.summary  # the verdict and its numbers, for the start-up line
    bf16 = make_tiny_model("llama").to(torch.bfloat16)
    plan = ContinuousBatchingManager(bf16, config=ContinuousBatchingConfig()).resolved_config.cpu_linear
    assert not plan.routes_anything and "no float32" in plan.summary
