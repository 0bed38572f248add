"""Compiled steps: one graph with no break, bounded recompiles, and greedy output equal to
`model.generate` except at a measured near-tie.

Dynamo-only checks use the "eager" backend (tracing, no Inductor code generation: seconds);
exactness at level 1 runs Inductor for real on tiny models.
"""

from __future__ import annotations

import copy
import pickle
import time

import pytest
import torch
from transformers import CompileConfig, GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus, continuous_batching
from contbatch.cpu import native

from conftest import make_tiny_model, random_prompts, reference_generate

GREEDY = GenerationConfig(do_sample=False, eos_token_id=None)
NEAR_TIE = 1e-3


def top_two_margin(model, tokens: list[int]) -> float:
    """Gap between the two largest next-token logits after `tokens`, in float32."""
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_exact_or_near_tie(model, prompt: list[int], got: list[int], expected: list[int]) -> None:
    """Equal, or diverging first where the reference's top two logits are within NEAR_TIE:
    fused kernels may round differently at a near-tie, nowhere else."""
    if got == expected:
        return
    k = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    margin = top_two_margin(model, prompt + expected[:k])
    assert margin < NEAR_TIE, f"compiled output diverges at token {k} where the top-two margin is {margin:.2e}"


def test_compile_level_is_validated_and_reported(llama_model):
    with pytest.raises(ValueError, match="default_compile_level"):
        ContinuousBatchingConfig(default_compile_level=4)
    config = ContinuousBatchingConfig(block_size=4, default_compile_level=2,
                                      varlen_compile_config=CompileConfig(mode="reduce-overhead", dynamic=True))
    r = ContinuousBatchingManager(llama_model, GREEDY, config).resolved_config
    assert r.default_compile_level == 2 and r.decode_compile.mode == "max-autotune-no-cudagraphs"
    assert r.varlen_compile.mode == "default" and any("reduce-overhead" in w for w in r.warnings)


def test_whole_step_traces_without_a_graph_break(default_model):
    """The default model's step is one graph: paged attention is one opaque op per layer, and
    fullgraph=True turns any break into an error. Chat prompts, exact against generate."""
    model, tok = default_model
    eager = CompileConfig(backend="eager", fullgraph=True, dynamic=True)
    # Linear layers routed to oneDNN too (cpu/routers/linear.py): the routing must not break the graph.
    config = ContinuousBatchingConfig(block_size=16, decode_compile_config=eager, varlen_compile_config=eager,
                                      cpu_kernel_overrides={"linear": "onednn"})
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in ("What is the capital of France?", "Say hi.")]
    with continuous_batching(model, GenerationConfig(max_new_tokens=6, do_sample=False), config) as m:
        outs = [m.get_result(rid, timeout=600) for rid in m.add_requests(prompts)]
        stats = m.stats()
    assert stats["graph_breaks"] == 0 and stats["compiles"] >= 1
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(model, prompt, 6, eos_token_id=tok.eos_token_id)


def test_recompiles_stay_within_the_buckets(llama_model):
    """dynamic=False compiles once per padded shape; 200 random requests of every length
    compile no more graphs than there are buckets (decode sizes, varlen token multiples)."""
    static = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=256, max_requests_per_batch=16,
                                      decode_compile_config=static, varlen_compile_config=static)
    prompts = random_prompts(200, 1, 60, seed=21)
    with continuous_batching(llama_model, GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None),
                             config) as m:
        outs = [m.get_result(rid, timeout=600) for rid in m.add_requests(prompts)]
        compiles, runner = m.stats()["compiles"], m.core.runner
        buckets = runner.bucketing.count(runner.max_tokens)
    assert all(o.status == RequestStatus.FINISHED for o in outs)
    assert 2 <= compiles <= buckets, (compiles, buckets)
    for prompt, out in list(zip(prompts, outs))[:8]:
        assert out.generated_tokens == reference_generate(llama_model, prompt, 3)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_level1_matches_generate(arch):
    """Inductor for real (level 1): grouped-query llama, and Gemma 2 (sliding windows,
    soft-capping) through mixed steps, chunked prefill and decode."""
    model = make_tiny_model(arch)
    prompts = random_prompts(10, 2, 40, seed=4)
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=64, default_compile_level=1)
    with continuous_batching(model, GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None),
                             config) as m:
        assert m.is_warm()
        outs = [m.get_result(rid, timeout=600) for rid in m.add_requests(prompts)]
        stats = m.stats()
    assert stats["graph_breaks"] == 0 and stats["compiles"] >= 1
    for prompt, out in zip(prompts, outs):
        assert_exact_or_near_tie(model, prompt, out.generated_tokens, reference_generate(model, prompt, 8))


def test_warm_up_in_the_background_then_serve(llama_model):
    """`start(wait_warm=False)` returns at once; `is_warm()` turns true once the compiled
    paths have run, and requests are exact. A queue too small for the warm-up's requests
    does not keep the engine warming forever."""
    eager = CompileConfig(backend="eager", fullgraph=True, dynamic=True)
    for queue in (0, 1):
        config = ContinuousBatchingConfig(block_size=4, decode_compile_config=eager, varlen_compile_config=eager,
                                          max_queue_size=queue)
        m = ContinuousBatchingManager(llama_model, GenerationConfig(max_new_tokens=4, do_sample=False,
                                                                    eos_token_id=None), config)
        m.start(wait_warm=False)
        try:
            deadline = time.time() + 120
            while not m.is_warm():
                assert time.time() < deadline, "never warm"
                time.sleep(0.05)
            rid = m.add_request([5, 6, 7])
            assert m.get_result(rid, timeout=60).generated_tokens == reference_generate(llama_model, [5, 6, 7], 4)
            # The second manager reuses the first one's compiled step (kept on the model).
            assert m.stats()["graph_breaks"] == 0 and all(m.core.runner.compiled.values())
        finally:
            m.destroy()


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
def test_one_graph_serves_every_row_count():
    """With dynamic shapes one graph runs a prompt's chunk, a few requests decoding and a lone
    one: the linear layers pick their kernel by row count inside their op (not a Python branch
    Dynamo traces once per regime) and a one-token step is not specialised, so a start traces
    the layers once instead of three times."""
    model = make_tiny_model("llama")
    traced = CompileConfig(backend="eager", fullgraph=True, dynamic=True)
    # The warm-up's step is padded to 32 tokens and samples 32 rows (one per possible request),
    # a step of 60-90 tokens samples 32: sizes first seen equal must not stay tied.
    config = ContinuousBatchingConfig(block_size=4, decode_compile_config=traced, varlen_compile_config=traced,
                                      cpu_kernel_overrides={"linear": "small_linear"}, q_padding_interval_size=8, max_requests_per_batch=32)
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    with continuous_batching(model, gen, config) as m:
        for prompts in (random_prompts(3, 20, 30, seed=2), random_prompts(1, 12, 13, seed=3), [[5]]):
            outs = [m.get_result(rid, timeout=600) for rid in m.add_requests(prompts)]
            for prompt, out in zip(prompts, outs):
                assert out.generated_tokens == reference_generate(model, prompt, 4)
        stats = m.stats()
    assert stats["compiles"] == 1 and stats["graph_breaks"] == 0, stats


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
def test_a_second_manager_reuses_the_compiled_step():
    """`generate_batch` makes a manager per call: the model's compiled step (per compile
    choice and linear routing) is kept on the model, so a second manager compiles nothing.
    The routed linear layers (our C++ op, which picks the kernel by row count) are nodes of the graph."""
    model = make_tiny_model("llama")
    targets: list[str] = []

    def recording(gm, example_inputs):  # a Dynamo backend that keeps the graph's calls and runs it as is
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    traced = CompileConfig(backend=recording, fullgraph=True, dynamic=True)
    config = ContinuousBatchingConfig(block_size=4, decode_compile_config=traced, varlen_compile_config=traced,
                                      cpu_kernel_overrides={"linear": "small_linear"})
    prompts = random_prompts(6, 2, 30, seed=8)
    compiles = []
    for _ in range(2):
        with continuous_batching(model, GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None),
                                 config) as m:
            outs = [m.get_result(rid, timeout=600) for rid in m.add_requests(prompts)]
            compiles.append(m.stats()["compiles"])
        for prompt, out in zip(prompts, outs):
            assert out.generated_tokens == reference_generate(model, prompt, 5)
    assert compiles[0] >= 1 and compiles[1] == 0, compiles
    assert any("routed_linear" in t for t in targets), "the compiled step does not call the routed linear kernel"
    # A copy (an RL reference policy) does not inherit steps that run the original's weights.
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    assert not twin._contbatch_compiled and pickle.loads(pickle.dumps(model))._contbatch_compiled == {}
    with continuous_batching(twin, GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None),
                             config) as m:
        outs = [m.get_result(rid, timeout=600) for rid in m.add_requests(prompts[:2])]
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(twin, prompt, 5)


def test_identical_layers_trace_once_as_regions():
    """Each decoder layer is a nested compile region: Dynamo traces a layer once and stamps it
    out for the identical ones (the layer index reaches paged attention as a tensor), while a
    layer that differs (Gemma 2 alternates sliding-window and full attention) gets a region of
    its own. Exact against `generate`."""
    model = make_tiny_model("gemma2")  # 4 layers: sliding, full, sliding, full
    regions: list[list[str]] = []

    def recording(gm, example_inputs):
        regions.append([n.args[1] for n in gm.graph.nodes if "invoke_subgraph" in str(n.target)])
        return gm.forward

    traced = CompileConfig(backend=recording, fullgraph=True, dynamic=True)
    config = ContinuousBatchingConfig(block_size=4, decode_compile_config=traced, varlen_compile_config=traced)
    prompts = random_prompts(4, 2, 30, seed=12)
    with continuous_batching(model, GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None),
                             config) as m:
        outs = [m.get_result(rid, timeout=600) for rid in m.add_requests(prompts)]
        assert m.stats()["graph_breaks"] == 0
    assert regions and all(len(calls) == 4 and len(set(calls)) == 2 for calls in regions), regions
    assert all(calls[0] == calls[2] and calls[1] == calls[3] for calls in regions), regions
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_generate(model, prompt, 4)


def test_layers_of_too_many_kinds_are_not_regions():
    """A stack whose layers differ in more than MAX_REGION_KINDS ways is traced layer by
    layer (a region would be looked up and traced anyway); alike layers are marked once, and
    marking again changes nothing."""
    from contbatch.runtime import compile as compile_mod

    model = make_tiny_model("gemma2")
    assert compile_mod.mark_layer_regions(model) == 4 == compile_mod.mark_layer_regions(model)
    assert [int(layer.self_attn._contbatch_layer) for layer in model.model.layers] == [0, 1, 2, 3]
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=10,
                                      num_attention_heads=2, num_key_value_heads=1)
    mixed = transformers.LlamaForCausalLM(config)
    for i, layer in enumerate(mixed.model.layers):
        layer.mlp.variant = i  # ten kinds of layer
    assert compile_mod.mark_layer_regions(mixed) == 0
    assert all("forward" not in layer.__dict__ for layer in mixed.model.layers)
    assert not any("_contbatch_layer" in m.__dict__ for m in mixed.modules())  # the index stays a constant


def test_compiled_bfloat16_step_calls_the_upcast_linear():
    """bfloat16 layers routed to the float32 product (`upcast`, for CPUs without a bfloat16
    GEMM) are one opaque op each in a compiled step, and the step's tokens are the eager ones."""
    model = make_tiny_model("llama").to(torch.bfloat16)
    targets: list[str] = []

    def recording(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    traced = CompileConfig(backend=recording, fullgraph=True, dynamic=True)
    prompts = random_prompts(4, 2, 30, seed=9)
    gc = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None)
    outs = {}
    for name, compile_config in (("eager", None), ("compiled", traced)):
        config = ContinuousBatchingConfig(block_size=4, decode_compile_config=compile_config,
                                          varlen_compile_config=compile_config,
                                          cpu_kernel_overrides={"linear": "upcast"})
        with continuous_batching(model, gc, config) as m:
            assert "upcast for 5 of 5 weight shapes" in m.resolved_config.cpu.linear.summary
            outs[name] = [m.get_result(rid, timeout=600).generated_tokens for rid in m.add_requests(prompts)]
    assert outs["compiled"] == outs["eager"]
    assert any("upcast_linear" in t for t in targets), "the compiled step does not call the upcast linear"
    # float32 layers have nothing to upcast: the forced kernel leaves them on aten, and says so.
    plan = ContinuousBatchingManager(make_tiny_model("llama"), config=ContinuousBatchingConfig(
        cpu_kernel_overrides={"linear": "upcast"})).resolved_config.cpu.linear
    assert not plan.routes_anything and "upcast is not available here" in plan.summary
