"""Model features the engine supports, each exact against `model.generate`, and the start-up
refusal of those it does not (`contbatch/setup/support.py`). The sweep over every
architecture is `test_model_coverage.py`; these cases go deeper on one feature each: more
prompts, every backend that runs on the CPU, and the failure modes the refusal must name.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, continuous_batching, generate_batch
from contbatch import context
from contbatch.setup import support

from conftest import random_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from model_coverage import reference  # noqa: E402
from tiny_models import build_tiny, tiny_config  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, which also keeps the reference `generate` (this
    thread) and the engine thread from trading OpenMP pools (see test_model_coverage.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _served(model, prompts, new_tokens, **config) -> list[list[int]]:
    """Chunked prefill (24-token steps) over 4-token blocks, on the backend asked for."""
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    cfg = ContinuousBatchingConfig(block_size=4, max_batch_tokens=24, **config)
    with continuous_batching(model, gc, cfg) as manager:
        if "attention_backend" in config:
            assert manager.resolved_config.attention_backend == config["attention_backend"]
        outs = [manager.get_result(rid, timeout=120) for rid in manager.add_requests(prompts)]
    for out in outs:
        assert out.error is None, out.error
    return [out.generated_tokens for out in outs]


def _expected(model, prompts, new_tokens) -> list[list[int]]:
    return reference(model, prompts, new_tokens)


@pytest.fixture(scope="module")
def gpt_oss():
    """Sinks in every layer, alternating sliding (8-token window) and full attention, MoE."""
    return build_tiny("gpt_oss")


@pytest.mark.parametrize("backend,decode_fast_path", [("torch", True), ("torch", False), ("reference", True)])
def test_attention_sinks_are_exact(gpt_oss, backend, decode_fast_path):
    prompts = random_prompts(8, 1, 30, seed=21)
    expected = _expected(gpt_oss, prompts, 8)
    got = _served(gpt_oss, prompts, 8, attention_backend=backend, decode_fast_path=decode_fast_path)
    assert got == expected


def test_attention_sinks_are_exact_in_the_triton_kernels(gpt_oss):
    pytest.importorskip("triton")
    prompts = random_prompts(3, 2, 12, seed=22)
    expected = _expected(gpt_oss, prompts, 3)
    assert _served(gpt_oss, prompts, 3, attention_backend="triton") == expected


@pytest.mark.parametrize("arch", ["gpt_oss", "diffllama"])
def test_compiled_steps_pass_sinks_and_per_call_cache_layers_through_the_custom_op(arch):
    """Under torch.compile paged attention is one opaque op per call: the sinks travel as an
    operand, and the op picks each call's cache layer at run time (Dynamo tracing only)."""
    from transformers import CompileConfig

    model = build_tiny(arch)
    traced = CompileConfig(backend="eager", dynamic=True)
    prompts = random_prompts(4, 1, 20, seed=31)
    expected = _expected(model, prompts, 4)
    gc = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    cfg = ContinuousBatchingConfig(block_size=4, max_batch_tokens=24, decode_compile_config=traced,
                                   varlen_compile_config=traced)
    with continuous_batching(model, gc, cfg) as manager:
        outs = [manager.get_result(rid, timeout=120) for rid in manager.add_requests(prompts)]
        assert manager.core.runner.compiles > 0 and manager.resolved_config.varlen_compile is not None  # no fallback
    assert [out.generated_tokens for out in outs] == expected


def test_flash_attention_refuses_sinks(gpt_oss, monkeypatch):
    monkeypatch.setattr(support, "_backend", lambda model, config: "flash")
    with pytest.raises(ValueError, match=r"'gpt_oss'.*attention sinks.*model\.generate"):
        ContinuousBatchingManager(gpt_oss, config=ContinuousBatchingConfig(attention_backend="flash"))


def test_layers_that_drop_the_attention_kwargs_get_the_step_from_the_engine_thread(monkeypatch):
    """StableLM's decoder layer calls its attention without `**kwargs`: the step metadata is
    lost on the way, and paged attention finds it in the engine thread's context instead."""
    model = build_tiny("stablelm")
    taken = []
    real = context.active_step

    def spy():
        meta = real()
        taken.append(meta is not None)
        return meta

    monkeypatch.setattr(context, "active_step", spy)
    prompts = random_prompts(6, 1, 25, seed=23)
    expected = _expected(model, prompts, 6)
    assert _served(model, prompts, 6) == expected
    assert taken and all(taken)  # every call came without the kwarg and found the step


def test_a_forward_outside_the_engine_sees_no_step():
    """While a manager runs, the user's own `generate` on the same model (another thread)
    takes the model's own attention, whatever the engine thread is doing."""
    model = build_tiny("stablelm")
    prompts = random_prompts(4, 3, 15, seed=24)
    expected = _expected(model, prompts, 5)
    gc = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None)
    with continuous_batching(model, gc, ContinuousBatchingConfig(block_size=4, max_batch_tokens=16)) as manager:
        ids = manager.add_requests(random_prompts(6, 5, 30, seed=25))
        assert context.active_step() is None and threading.current_thread() is threading.main_thread()
        assert _expected(model, prompts, 5) == expected
        for rid in ids:
            assert manager.get_result(rid, timeout=120).error is None


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_differential_attention_keeps_one_cache_layer_per_call(backend):
    """DiffLlama attends twice per layer (same keys, each half of the values): each call
    reads and writes its own cache layer."""
    model = build_tiny("diffllama")
    prompts = random_prompts(6, 1, 30, seed=30)
    assert _served(model, prompts, 6, attention_backend=backend) == _expected(model, prompts, 6)


@pytest.mark.parametrize("multi_query", [True, False])
def test_gpt_bigcode_fused_qkv_is_exact(multi_query):
    """One fused projection split into Q and K/V; multi-query shares a single K/V head."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("gpt_bigcode")
    config.multi_query = multi_query
    config.num_key_value_heads = 1 if multi_query else config.num_attention_heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, pad_token_id=0)
    assert model.transformer.h[0].attn.c_attn.out_features == 64 + 2 * (16 if multi_query else 64)
    prompts = random_prompts(6, 1, 30, seed=26)
    assert _served(model, prompts, 6) == _expected(model, prompts, 6)


@pytest.mark.parametrize("arch", ["codegen", "stablelm", "phi"])
def test_partial_rotary_is_exact(arch):
    """Rotary embedding on part of each head only (rotary_dim 8 of 16; 25% and 50%)."""
    model = build_tiny(arch)
    prompts = random_prompts(6, 1, 30, seed=27)
    assert _served(model, prompts, 6) == _expected(model, prompts, 6)


@pytest.mark.parametrize("arch", ["roberta", "xlm-roberta", "bert"])
def test_bert_family_decoders_are_exact_and_their_bidirectional_default_refused(arch):
    """As causal decoders (`is_decoder=True`) they are exact; `generate` numbers positions from
    0 (from the attention mask), not from padding_idx + 1 as RoBERTa's own embedding would, and
    the engine matches it. With the default `is_decoder=False` they attend bidirectionally:
    refused at start, with the fix in the message."""
    model = build_tiny(arch)
    prompts = random_prompts(6, 1, 30, seed=28)
    assert _served(model, prompts, 6) == _expected(model, prompts, 6)
    model.config.is_decoder = False
    from transformers import AutoModelForCausalLM

    bidirectional = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match=r"bidirectional.*is_decoder=True.*model\.generate"):
        ContinuousBatchingManager(bidirectional)


@pytest.mark.parametrize("arch,feature", [
    ("mamba", "do not resume a prompt from a saved state"),
    ("recurrent_gemma", "linear-attention"),
    ("deepseek_v32", "indexed"),
    ("deepseek_v4", "compressed attention"),
    ("bloom", "AttentionInterface"),
    ("bart", "position_ids"),
    ("hrm_text", "calls attention"),
    ("moshi", "sliding_window"),
])
def test_refused_at_construction_with_the_reason(arch, feature):
    model = build_tiny(arch)
    with pytest.raises(ValueError) as info:
        ContinuousBatchingManager(model)
    message = str(info.value)
    assert f"model type {model.config.model_type!r}" in message and feature in message, message
    assert "model.generate" in message
    assert model.config._attn_implementation != "contbatch_paged"  # nothing attached
    with pytest.raises(ValueError, match=feature):
        generate_batch(model, [[5, 6, 7]], GenerationConfig(max_new_tokens=2, do_sample=False), progress_bar=False)


def test_a_second_manager_does_not_probe_a_model_in_use():
    """Probing swaps the model's attention implementation: never while an engine runs on it."""
    model = build_tiny("llama")
    gc = GenerationConfig(max_new_tokens=30, do_sample=False, eos_token_id=None)
    prompts = random_prompts(4, 5, 20, seed=29)
    expected = _expected(model, prompts, 30)
    with continuous_batching(model, gc, ContinuousBatchingConfig(block_size=4, max_batch_tokens=16)) as manager:
        ids = manager.add_requests(prompts)
        ContinuousBatchingManager(model).destroy()  # made (checked) while the first one runs
        assert [manager.get_result(rid, timeout=120).generated_tokens for rid in ids] == expected


def test_a_model_unchanged_since_its_last_check_is_not_probed_again(monkeypatch):
    """The probe is a forward of the whole model (~0.1 s of each `generate_batch` start on the
    default model): it runs again only when what it checks may have changed."""
    model = build_tiny("llama")
    probes = []
    real = support.probe_attention_calls
    monkeypatch.setattr(support, "probe_attention_calls", lambda m, *a: probes.append(m) or real(m, *a))
    gc = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None)
    prompts = random_prompts(2, 5, 12, seed=3)
    expected = _expected(model, prompts, 3)
    for _ in range(2):
        out = generate_batch(model, prompts, gc, progress_bar=False)
        assert [out[f"req_{i}"].generated_tokens for i in range(2)] == expected
    assert len(probes) == 1
    attention = model.model.layers[0].self_attn
    attention.forward = attention.forward  # a patched forward (an adapter, a hook library)
    ContinuousBatchingManager(model).destroy()
    assert len(probes) == 2
    model.config.sliding_window = 4  # a changed config
    with pytest.raises(ValueError):  # Llama applies no window: refused, checked against the new config
        ContinuousBatchingManager(model)
    assert len(probes) == 3
