"""LoRA adapters in the batch, against PEFT: the engine's greedy float32 tokens for rows of three
adapters and rows of none equal each row's own reference, the adapter merged by PEFT
(`PeftModel.from_pretrained(...).merge_and_unload()`) and run with `model.generate`
(tests/lora_adapters.py). Architectures: Llama, Qwen2, Qwen3 (q/k norms), Mistral (an 8-token
sliding window) and Phi-3 (fused `qkv_proj` and `gate_up_proj`: one low-rank product over the
fused output); under chunked prefill and preemption (soft reset and the CPU offload tier),
with an rsLoRA adapter among the three. (The tiny Gemma 3 of conftest repeats the prompt's last
token whatever its weights, so it could not tell an adapter applied from one ignored.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from contbatch import ContinuousBatchingConfig, generate_batch
from contbatch.cpu import native
from contbatch.sampling.params import SamplingParams
from conftest import make_tiny_model, random_prompts, reference_generate
from lora_adapters import ATTENTION, MLP, expected, references, served, write_adapters

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from tiny_models import build_tiny  # noqa: E402

MAX_NEW = 8
# Per architecture: how to build it, and its attention and MLP projections (fused in Phi-3).
ARCHS = {
    "llama": (lambda: make_tiny_model("llama", seed=3), ATTENTION, MLP),
    "qwen2": (lambda: make_tiny_model("qwen2", seed=3), ATTENTION, MLP),
    "qwen3": (lambda: make_tiny_model("qwen3", seed=3), ATTENTION, MLP),
    "mistral": (lambda: make_tiny_model("mistral", seed=3), ATTENTION, MLP),
    "phi3": (lambda: build_tiny("phi3"), ("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")),
}


def _specs(attention, mlp) -> dict[str, dict]:
    return {
        "one": dict(rank=8, alpha=16, seed=1, targets=attention + mlp),
        "two": dict(rank=16, alpha=8, seed=2, targets=attention, rslora=True),  # alpha / sqrt(r)
        "three": dict(rank=4, alpha=8, seed=3, targets=mlp),
    }


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    build, attention, mlp = ARCHS[request.param]
    model = build()
    paths = write_adapters(model, tmp_path_factory.mktemp(f"lora-{request.param}"), _specs(attention, mlp))
    return model, paths, references(model, paths)


def test_adapters_change_the_reference(arch):
    """Each adapter's merged model gives other tokens than the base and the other adapters, on
    most prompts: the exactness below can fail."""
    _, _, refs = arch
    prompts = random_prompts(4, 5, 20, seed=11)
    outs = [{tuple(reference_generate(m, p, MAX_NEW)) for m in refs.values()} for p in prompts]
    assert sum(len(o) == len(refs) for o in outs) >= 3, outs


def test_mixed_batch_matches_peft(arch):
    model, paths, refs = arch
    prompts = random_prompts(6, 5, 20, seed=11)
    names = ["one", None, "two", "three", "one", None]
    got, _ = served(model, ContinuousBatchingConfig(block_size=4), prompts, names, paths, MAX_NEW)
    assert got == expected(refs, prompts, names, MAX_NEW)


@pytest.mark.parametrize("offload", [0.0, 0.01], ids=["soft-reset", "offload"])
def test_chunked_prefill_and_preemption_match_peft(arch, offload):
    model, paths, refs = arch
    prompts = random_prompts(6, 14, 30, seed=12)
    names = ["two", "one", None, "three", "two", "one"]
    config = ContinuousBatchingConfig(block_size=4, num_blocks=16, max_batch_tokens=16, safety_margin=0.0,
                                      cpu_offload_space=offload)
    got, stats = served(model, config, prompts, names, paths, MAX_NEW)
    assert got == expected(refs, prompts, names, MAX_NEW)
    assert stats["soft_resets" if offload == 0.0 else "offloads"] > 0  # KV pressure did preempt, as asked


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = make_tiny_model("llama", seed=3)
    paths = write_adapters(model, tmp_path_factory.mktemp("lora-llama"), _specs(ATTENTION, MLP))
    return model, paths, references(model, paths)


def test_mixed_batch_on_routed_and_fused_kernels(llama):
    """The LoRA hook composes with the CPU linear router (small_linear forced) and the one-call
    decoder layers (forced on): the call runs the hooks' products itself, in steps of adapter
    rows checked bit for bit against the layers' own forward, and stays on."""
    model, paths, refs = llama
    prompts = random_prompts(5, 5, 16, seed=21)
    names = [None, "three", "one", "two", None]
    config = ContinuousBatchingConfig(block_size=4, cpu_kernel_overrides={"linear": "small_linear", "layer": "layer"})
    got, stats = served(model, config, prompts, names, paths, MAX_NEW)
    assert got == expected(refs, prompts, names, MAX_NEW)
    if native.load()[0]:
        assert stats["fused_enabled"] and any(kind[3] for kind in stats["fused_checked"]), stats["fused_checked"]


def test_prompt_chunks_beside_decode_rows_take_segmented_groups(llama):
    """A long prompt of one adapter prefilled in chunks while two others decode: padding the
    groups to the chunk would triple the rows, so those steps take the groups one at a time
    (segmented), in the one-call layers too, checked bit for bit; tokens equal PEFT's merge."""
    model, paths, refs = llama
    prompts = random_prompts(2, 4, 6, seed=31) + random_prompts(1, 40, 40, seed=32)
    names = ["one", "two", "three"]
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=16)
    got, stats = served(model, config, prompts, names, paths, MAX_NEW)
    assert got == expected(refs, prompts, names, MAX_NEW)
    if native.load()[0]:
        assert stats["fused_enabled"] and {k[3] for k in stats["fused_checked"]} >= {1, 2}, stats["fused_checked"]


def test_generate_batch(llama):
    model, paths, refs = llama
    prompts = random_prompts(3, 6, 12, seed=13)
    names = [None, "one", "two"]
    out = generate_batch(model, prompts, config=ContinuousBatchingConfig(block_size=4), progress_bar=False,
                         sampling_params=SamplingParams(max_new_tokens=MAX_NEW),
                         lora_adapters={k: paths[k] for k in ("one", "two")}, adapters=names)
    assert [o.generated_tokens for o in out.values()] == expected(refs, prompts, names, MAX_NEW)


def test_speculative_ngram_with_adapters(llama):
    """Proposals are verified by the target with each row's adapter: the tokens stay exact."""
    model, paths, refs = llama
    prompts = [p * 3 for p in random_prompts(4, 4, 6, seed=14)]  # repetitive: the n-gram proposer proposes
    names = ["one", None, "two", "one"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}  # any repeated token proposes
    got, stats = served(model, ContinuousBatchingConfig(block_size=4, speculative_config=spec), prompts, names, paths,
                        2 * MAX_NEW)
    assert got == expected(refs, prompts, names, 2 * MAX_NEW)
    assert stats["spec_draft_tokens"] > 0  # proposals were made and verified
