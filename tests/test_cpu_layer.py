"""Decoder layers as one C++ call (cpu/routers/layer.py): exact against `model.generate` and the
layers' own forward in every kind of step, checked at run time, refused where they cannot be."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, generate_batch
from contbatch.cpu import native
from contbatch.cpu.routers import fused_layer, model_forward
from contbatch.cpu.routers.layer import LayerRouter

from conftest import make_tiny_model, random_prompts, reference_generate

pytestmark = pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")


def _router(manager) -> LayerRouter:
    return next(r for r in manager._routers.routers if isinstance(r, LayerRouter))


def _run(model, prompts, new_tokens, **config):
    """Results and the layer router's checks of one manager's run."""
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    manager = ContinuousBatchingManager(model, gc, ContinuousBatchingConfig(**config))
    manager.start()
    try:
        ids = manager.add_requests(prompts)
        results = [manager.get_result(i, timeout=120).generated_tokens for i in ids]
        router = _router(manager)
        checked, enabled = {kind for _, _, kind in router.shared.checked}, router.shared.enabled
    finally:
        manager.stop(timeout=30)
    return manager, results, checked, enabled


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_layers_equal_generate_in_every_kind_of_step(arch):
    """Llama, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms), Mistral (a sliding window of 8,
    shorter than the prompts): a lone request (one-row steps), then a batch with chunked prompts
    (decode rows beside chunks, a few rows, many rows). Every kind of step was checked against
    the layers' own forward and passed; tokens equal `model.generate`'s."""
    model = make_tiny_model(arch)
    plan = ContinuousBatchingManager(model, config=ContinuousBatchingConfig()).resolved_config.cpu.layer
    assert len(plan.layers) == model.config.num_hidden_layers, plan.summary
    json.dumps(dataclasses.asdict(plan))  # part of resolved_config.as_dict()
    lone = random_prompts(1, 30, 30, seed=3)
    _, results, checked, enabled = _run(model, lone, 10, block_size=4)
    assert enabled and checked == {(2, False, True, False), (0, True, False, False)}  # the prompt, then one decode row
    assert results == [reference_generate(model, lone[0], 10)]
    prompts = random_prompts(7, 1, 60, seed=11)
    _, results, checked, enabled = _run(model, prompts, 8, block_size=4, max_batch_tokens=32)
    assert enabled and {(1, True, False, False), (2, True, True, False)} <= checked, checked
    for prompt, got in zip(prompts, results):
        assert got == reference_generate(model, prompt, 8)


def test_bfloat16_fused_layers_equal_the_layers_own_forward():
    """bfloat16 may part from `generate` (other kernels round differently), never from the
    engine's own per-module path: the same tokens with and without the fused layers."""
    model = make_tiny_model("qwen3").to(torch.bfloat16)
    prompts = random_prompts(5, 1, 30, seed=5)
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None)
    fused, per_module = (generate_batch(model, prompts, generation_config=gc, progress_bar=False,
                                        config=ContinuousBatchingConfig(block_size=4, max_batch_tokens=24,
                                                                        cpu_kernel_overrides={"layer": k}))
                         for k in ("auto", "off"))
    assert [r.generated_tokens for r in fused.values()] == [r.generated_tokens for r in per_module.values()]


@pytest.mark.parametrize("arch, method", [("llama", "int8"), ("qwen2", "int4"), ("qwen3", "int4-g128")])
def test_quantized_linears_run_inside_the_fused_layers(arch, method):
    """Packed linears (int8, int4 in groups of 32 and 128; Qwen2's biases, Qwen3's q/k norms) stay
    inside the one C++ call: every layer is planned fused, every kind of step passes the
    bit-for-bit check against the layers' own forward, and the tokens equal the per-module run's."""
    from contbatch.cpu.quant.linear import QuantLinear
    from contbatch.setup.quantize import quantize_model

    model = make_tiny_model(arch)
    quantize_model(model, method)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) >= 7 * model.config.num_hidden_layers
    prompts = random_prompts(6, 1, 50, seed=21)
    manager, fused, checked, enabled = _run(model, prompts, 8, block_size=4, max_batch_tokens=24)
    assert len(manager.resolved_config.cpu.layer.layers) == model.config.num_hidden_layers
    assert enabled and {(0, True, False, False), (1, True, False, False), (2, True, True, False)} <= checked, checked
    _, per_module, _, _ = _run(model, prompts, 8, block_size=4, max_batch_tokens=24,
                               cpu_kernel_overrides={"layer": "off"})
    assert fused == per_module


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decode_steps_in_one_parallel_region_equal_generate(arch):
    """With every linear on our few-row float32 kernel, a decode step's layers run inside one
    parallel region (decode_region_cpu.cpp: the linears' bands and the attention's tasks shared
    out, the small ops between them on the calling thread). A lone request (one row) and four
    decoding together (a few rows) pass the bit-for-bit check against the layers' own forward,
    and the tokens equal `model.generate`'s. The lone request's keys span three chunks of the
    attention's split (paged_decode_cpu.cpp), attended by both threads after the rotations'
    barrier; the four requests' lie on both sides of one chunk."""
    model = make_tiny_model(arch)
    small = {"linear": "small_linear"}
    lone = random_prompts(1, 150, 150, seed=8)
    _, results, checked, enabled = _run(model, lone, 12, block_size=4, cpu_kernel_overrides=small)
    assert enabled and (0, True, False, False) in checked, checked
    assert results == [reference_generate(model, lone[0], 12)]
    prompts = random_prompts(4, 5, 90, seed=9)
    _, results, checked, enabled = _run(model, prompts, 10, block_size=4, cpu_kernel_overrides=small)
    assert enabled and (1, True, False, False) in checked, checked
    for prompt, got in zip(prompts, results):
        assert got == reference_generate(model, prompt, 10)


@pytest.mark.parametrize("rows", ["short prompts", "draft tokens"])
def test_rows_of_one_request_in_a_parallel_region_read_each_others_keys(rows):
    """A short prompt runs as decode rows of one request (as do the few tokens after a cached
    prefix, and draft tokens being verified), each row seeing the keys up to its own position,
    which other rows write: inside the decode region those keys are written by several threads,
    and every row waits for all of them (decode_region_cpu.cpp). Requests one at a time, short
    prompts, or repetitive ones whose n-gram drafts are verified: the few-row steps pass the
    bit-for-bit check against the layers' own forward, and the tokens equal `model.generate`'s."""
    model = make_tiny_model("llama")
    new_tokens = 6 if rows == "short prompts" else 16
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    spec = None if rows == "short prompts" else {"method": "ngram", "num_speculative_tokens": 4}
    config = ContinuousBatchingConfig(block_size=4, cpu_kernel_overrides={"linear": "small_linear"},
                                      speculative_config=spec)
    prompts = (random_prompts(8, 2, 7, seed=13) if spec is None
               else [p * 4 for p in random_prompts(4, 3, 6, seed=17)])
    manager = ContinuousBatchingManager(model, gc, config)
    manager.start()
    try:
        for prompt in prompts:
            (rid,) = manager.add_requests([prompt])
            want = reference_generate(model, prompt, new_tokens)
            assert manager.get_result(rid, timeout=120).generated_tokens == want
        router = _router(manager)
        checked, enabled = {kind for _, _, kind in router.shared.checked}, router.shared.enabled
    finally:
        manager.stop(timeout=30)
    assert enabled and (1, True, False, False) in checked, checked


def test_a_difference_sends_every_layer_back_to_its_own_forward(monkeypatch, caplog):
    """The run-time check is real: a fused layer that computed something else is caught on its
    first call, said loudly, and the manager's layers run their own forward from then on, with
    the tokens still exact."""
    model = make_tiny_model("llama")
    real = fused_layer.FusedLayer.run
    monkeypatch.setattr(fused_layer.FusedLayer, "run", lambda self, *a: real(self, *a) * 1.001)
    prompts = random_prompts(3, 5, 20, seed=2)
    with caplog.at_level(logging.WARNING, logger="contbatch"):
        _, results, checked, enabled = _run(model, prompts, 6, block_size=4)
    assert not enabled and len(checked) == 1
    assert "differs from its own forward" in caplog.text
    for prompt, got in zip(prompts, results):
        assert got == reference_generate(model, prompt, 6)


def test_an_op_that_raises_never_fails_the_step(monkeypatch, caplog):
    """A layout the op refuses is a logged error and the layers' own forward, not a failed step."""
    model = make_tiny_model("qwen2")

    def refuse(self, *args):
        raise RuntimeError("decoder_layer: refused")

    monkeypatch.setattr(fused_layer.FusedLayer, "run", refuse)
    prompts = random_prompts(3, 5, 20, seed=4)
    with caplog.at_level(logging.ERROR, logger="contbatch"):
        _, results, checked, enabled = _run(model, prompts, 6, block_size=4)
    assert not enabled and not checked and "failed (decoder_layer: refused)" in caplog.text
    for prompt, got in zip(prompts, results):
        assert got == reference_generate(model, prompt, 6)


def test_plan_refuses_what_it_cannot_reproduce():
    model = make_tiny_model("llama")
    config = ContinuousBatchingConfig
    assert ContinuousBatchingManager(model, config=config(cpu_kernel_overrides={"layer": "off"})).resolved_config.cpu.layer.layers == ()
    off = ContinuousBatchingManager(model, config=config(decode_fast_path=False)).resolved_config.cpu.layer
    assert off.layers == () and "decode fast path is off" in off.summary
    norms = ContinuousBatchingManager(model, config=config(cpu_kernel_overrides={"norm": "off"})).resolved_config.cpu.layer
    assert norms.layers == () and "norms are not fused" in norms.summary
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    try:
        hooked = ContinuousBatchingManager(model, config=config()).resolved_config.cpu.layer
    finally:
        handle.remove()
    assert len(hooked.layers) == 1 and "1 left to their own forward (hooks or a patched forward)" in hooked.summary
    assert not hooked.stack  # not every layer: no stack
    full = ContinuousBatchingManager(model, config=config()).resolved_config.cpu.layer
    assert full.stack and "the whole stack as one call" in full.summary
    layer = ContinuousBatchingManager(model, config=config(cpu_kernel_overrides={"layer": "layer"})).resolved_config.cpu.layer
    assert len(layer.layers) == 2 and not layer.stack and "whole stack" not in layer.summary
    compiled = ContinuousBatchingManager(model, config=config(default_compile_level=1)).resolved_config.cpu.layer
    assert compiled.layers == () and "every step is compiled" in compiled.summary
    gemma = ContinuousBatchingManager(make_tiny_model("gemma2"), config=config()).resolved_config.cpu.layer
    assert gemma.layers == () and "per module" in gemma.summary
    with pytest.raises(ValueError, match=r"cpu_kernel_overrides\['layer'\]"):
        config(cpu_kernel_overrides={"layer": "fused"})


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_the_stack_runs_from_each_kind_of_steps_second(arch, monkeypatch):
    """Qwen3 (q/k norms), Mistral (a window): after the first step of a kind ran the layers one by
    one (checked, and showing a plain chain), the steps of that kind run the whole stack as one
    call; tokens equal `model.generate`'s and the engine's own one-call-per-layer path. The
    model's forward (routers/model_forward.py) then skips its later layers instead of calling
    each to be handed the stack's output, and the causal LM's step forward hands the logits on
    without the model's output classes."""
    model = make_tiny_model(arch)
    stacked, passed_on, step_logits = [], [], []
    real_logits = model_forward.StepLogits
    monkeypatch.setattr(model_forward, "StepLogits", lambda logits: step_logits.append(1) or real_logits(logits))
    real, real_pass_on = fused_layer.FusedStack.run, fused_layer.FusedStack.pass_on
    monkeypatch.setattr(fused_layer.FusedStack, "run",
                        lambda self, h, *a: stacked.append(h.shape[1]) or real(self, h, *a))
    monkeypatch.setattr(fused_layer.FusedStack, "pass_on", lambda self, *a: passed_on.append(1) or real_pass_on(self, *a))
    prompts = random_prompts(7, 1, 60, seed=11)
    _, results, _, enabled = _run(model, prompts, 8, block_size=4, max_batch_tokens=32)
    assert enabled and len(stacked) > 3 and max(stacked) > 1, stacked  # decode rows, and beside prompt chunks
    assert not passed_on  # no later layer was called in a step whose stack ran
    assert len(step_logits) >= len(stacked)
    for prompt, got in zip(prompts, results):
        assert got == reference_generate(model, prompt, 8)
    count = len(stacked)
    _, per_layer, _, _ = _run(model, prompts, 8, block_size=4, max_batch_tokens=32, cpu_kernel_overrides={"layer": "layer"})
    assert per_layer == results and len(stacked) == count


@pytest.mark.parametrize("method", [None, "int4"])
def test_the_stack_reads_a_tensor_replaced_between_steps(method):
    """The stack's call holds its step-independent lists in C++ (`ops.stack_args`); a weight (a
    new Parameter, as user code assigns one) or a packed linear's scales (a new buffer) replaced
    while the manager runs is what the next steps read: the held lists are made again, and the
    tokens equal `model.generate`'s on the changed model (which differ from the old model's)."""
    from contbatch.setup.quantize import quantize_model

    model = make_tiny_model("llama")
    if method:
        quantize_model(model, method)
    before, after = random_prompts(3, 8, 30, seed=5), random_prompts(3, 8, 30, seed=6)  # no prefix shared
    old = [reference_generate(model, p, 6) for p in after]
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    manager = ContinuousBatchingManager(model, gc, ContinuousBatchingConfig(block_size=4, max_batch_tokens=32))
    manager.start()
    try:
        for i in manager.add_requests(before):
            manager.get_result(i, timeout=120)
        stack = _router(manager).shared.stack
        held = stack.held.args
        assert held is not None  # the stack ran
        clone = copy.deepcopy(model)  # a frozen reference taken while attached: the C++ object is not copied
        assert clone.model.layers[0]._contbatch_fused.shared.stack.held.args is None
        down = model.model.layers[1].mlp.down_proj
        with torch.no_grad():
            if method:
                down.scales = down.scales * -1.5
            else:
                down.weight = torch.nn.Parameter(down.weight * -1.5, requires_grad=False)
        got = [manager.get_result(i, timeout=120).generated_tokens for i in manager.add_requests(after)]
        assert stack.held.args is not held
    finally:
        manager.stop(timeout=30)
    assert stack.held.args is None  # let go with the manager (its lists hold the cache)
    new = [reference_generate(model, p, 6) for p in after]
    assert got == new and new != old


def test_no_stack_where_the_loop_is_not_a_plain_chain_or_a_layer_has_hooks(monkeypatch):
    """A model whose loop skips a layer (here: config.num_hidden_layers below the layers it
    holds) never proves a chain; a hook added to a layer while the manager runs puts the steps
    back on one call per layer, and the hook runs."""
    stacked = []
    real = fused_layer.FusedStack.run
    monkeypatch.setattr(fused_layer.FusedStack, "run", lambda self, *a: stacked.append(1) or real(self, *a))
    model = make_tiny_model("llama")
    model.config.num_hidden_layers = 1
    prompt = random_prompts(1, 20, 20, seed=8)[0]
    _, results, _, enabled = _run(model, [prompt], 6, block_size=4)
    assert enabled and not stacked and results == [reference_generate(model, prompt, 6)]
    model = make_tiny_model("llama")
    gc = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None)
    manager = ContinuousBatchingManager(model, gc, ContinuousBatchingConfig(block_size=4))
    manager.start()
    try:
        assert manager.get_result(manager.add_request(prompt), timeout=60).generated_tokens == reference_generate(
            model, prompt, 12)
        assert stacked
        before, seen = len(stacked), []
        handle = model.model.layers[1].register_forward_hook(lambda m, a, out: seen.append(1))
        try:
            out = manager.get_result(manager.add_request(prompt), timeout=60).generated_tokens
        finally:
            handle.remove()
        assert out == reference_generate(model, prompt, 12) and len(stacked) == before and len(seen) == 12
    finally:
        manager.stop(timeout=30)


def test_layers_are_given_back_and_user_forwards_are_untouched():
    """Only engine steps take the fused call: the user's forward while the manager runs is the
    layer's own, and stopping leaves no trace on the layers."""
    model = make_tiny_model("llama")
    calls = []
    real = fused_layer.FusedLayer.run

    def counting(self, *args):
        calls.append(self.layer_idx)
        return real(self, *args)

    gc = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    manager = ContinuousBatchingManager(model, gc, ContinuousBatchingConfig(block_size=4))
    fused_layer.FusedLayer.run = counting
    try:
        manager.start()
        try:
            manager.get_result(manager.add_request([5, 6, 7, 8]), timeout=60)
            seen = len(calls)
            assert seen, "engine steps did not use the fused layers"
            with torch.no_grad():
                model(torch.tensor([[5, 6, 7]]))
            assert len(calls) == seen, "a forward outside the engine was routed"
        finally:
            manager.stop(timeout=30)
    finally:
        fused_layer.FusedLayer.run = real
    assert not any("forward" in m.__dict__ or "_contbatch_fused" in m.__dict__ for m in model.model.layers)
    assert "forward" not in model.model.__dict__ and "_contbatch_shared" not in model.model.__dict__
