"""LoRA adapters in the batch: the engine's greedy float32 tokens for rows of different adapters
and rows of none equal each row's own reference, the adapter merged into the model by the test
and run with `model.generate` (tests/lora_adapters.py)."""

from __future__ import annotations

import pytest
import torch

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, generate_batch
from contbatch.sampling.params import SamplingParams
from conftest import make_tiny_model, random_prompts, reference_generate
from lora_adapters import ATTENTION, MLP, merged, write_adapter

MAX_NEW = 8


@pytest.fixture(scope="module")
def base():
    return make_tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "one": write_adapter(base, str(root / "one"), rank=8, alpha=16, seed=1),
        "two": write_adapter(base, str(root / "two"), rank=16, alpha=8, seed=2, targets=ATTENTION, rslora=True),
        "three": write_adapter(base, str(root / "three"), rank=4, alpha=8, seed=3, targets=MLP),
    }


@pytest.fixture(scope="module")
def references(base, adapters):
    return {None: base, **{name: merged(base, path) for name, path in adapters.items()}}


def _expected(references, prompts, names):
    return [reference_generate(references[n], p, MAX_NEW) for p, n in zip(prompts, names)]


def _run(base, config, prompts, names, adapters, load=("one", "two", "three")):
    manager = ContinuousBatchingManager(base, config=config)
    manager.start()
    try:
        for name in load:
            manager.load_adapter(name, adapters[name])
        ids = manager.add_requests(prompts, max_new_tokens=MAX_NEW, adapters=names)
        outs = {rid: manager.get_result(rid, timeout=120) for rid in ids}
        stats = manager.stats()
        stats["spec_draft_tokens"] = sum(o.spec_draft_tokens for o in outs.values())
    finally:
        manager.stop()
        manager.destroy()
    return [outs[rid].generated_tokens for rid in ids], stats


def test_references_differ(base, references):
    """The adapters change the greedy tokens: a test that they are applied can fail."""
    prompt = random_prompts(1, 12, 12, seed=5)[0]
    outs = {n: tuple(reference_generate(m, prompt, MAX_NEW)) for n, m in references.items()}
    assert len(set(outs.values())) == len(outs)


def test_mixed_batch_matches_merged_references(base, adapters, references):
    prompts = random_prompts(6, 5, 20, seed=11)
    names = ["one", None, "two", "three", "one", None]
    got, _ = _run(base, ContinuousBatchingConfig(block_size=4), prompts, names, adapters)
    assert got == _expected(references, prompts, names)


def test_mixed_batch_on_routed_and_fused_kernels(base, adapters, references):
    """The LoRA hook composes with the CPU linear router (small_linear forced) and the one-call
    decoder layers (forced on: layers with adapter hooks take their own forward)."""
    prompts = random_prompts(5, 5, 16, seed=21)
    names = [None, "three", "one", "two", None]
    config = ContinuousBatchingConfig(block_size=4, cpu_kernel_overrides={"linear": "small_linear", "layer": "layer"})
    got, _ = _run(base, config, prompts, names, adapters)
    assert got == _expected(references, prompts, names)


@pytest.mark.parametrize("offload", [0.0, 0.01], ids=["soft-reset", "offload"])
def test_chunked_prefill_and_preemption(base, adapters, references, offload):
    prompts = random_prompts(6, 14, 30, seed=12)
    names = ["two", "one", None, "three", "two", "one"]
    config = ContinuousBatchingConfig(block_size=4, num_blocks=16, max_batch_tokens=16, safety_margin=0.0,
                                      cpu_offload_space=offload)
    got, stats = _run(base, config, prompts, names, adapters)
    assert got == _expected(references, prompts, names)
    assert stats["soft_resets"] + stats["offloads"] > 0  # KV pressure did preempt


def test_generate_batch(base, adapters, references):
    prompts = random_prompts(3, 6, 12, seed=13)
    names = [None, "one", "two"]
    out = generate_batch(base, prompts, config=ContinuousBatchingConfig(block_size=4), progress_bar=False,
                         sampling_params=SamplingParams(max_new_tokens=MAX_NEW),
                         lora_adapters={k: adapters[k] for k in ("one", "two")}, adapters=names)
    assert [o.generated_tokens for o in out.values()] == _expected(references, prompts, names)


def test_speculative_ngram_with_adapters(base, adapters, references):
    """Proposals are verified by the target with each row's adapter: the tokens stay exact."""
    prompts = [p * 3 for p in random_prompts(4, 4, 6, seed=14)]  # repetitive: the n-gram proposer proposes
    names = ["one", None, "two", "one"]
    config = ContinuousBatchingConfig(block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    got, stats = _run(base, config, prompts, names, adapters)
    assert got == _expected(references, prompts, names)
    assert stats["spec_draft_tokens"] > 0  # proposals were made and verified
