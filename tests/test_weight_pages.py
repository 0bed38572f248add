"""The weights a lone request's decode streams, moved onto 2 MiB pages (cpu/weight_pages.py), and
the private mapping both they and the KV cache live in (hugepages.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, generate_batch, hugepages
from contbatch.cpu import native, weight_pages

from conftest import make_tiny_model, random_prompts, reference_generate


def _huge_kib(address: int) -> int | None:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps), None if not found."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        first = line.split()[0]
        if "-" in first and all(c in "0123456789abcdef-" for c in first):
            lo, hi = (int(x, 16) for x in first.split("-"))
            if lo <= address < hi:
                for entry in lines[i + 1:]:
                    if entry.startswith("AnonHugePages:"):
                        return int(entry.split()[1])
    return None


def _big_model() -> torch.nn.Module:
    """A two-layer Llama whose MLP weights are 4 MiB each, tied embeddings."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_moved_weights_keep_values_ties_and_move_once():
    model = _big_model()
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    available, why = hugepages.availability()
    moved = weight_pages.move_to_huge_pages(weights, model)
    if not available:
        assert moved == 0 and why
        return
    nbytes = sum(w.numel() * 4 for w in {id(w): w for w in weights}.values())
    assert nbytes <= moved < nbytes + 64 * len(weights)
    assert all(torch.equal(values[n], p) for n, p in model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one Parameter
    changed = {n for n, p in model.named_parameters() if p.data_ptr() != before[n]}
    # the LM head is the embedding's Parameter (tied), named once
    assert "model.embed_tokens.weight" in changed and "model.layers.0.mlp.up_proj.weight" in changed
    assert not any("norm" in n for n in changed)  # only what was given
    assert all(w.untyped_storage().nbytes() == w.numel() * 4 for w in weights)  # a storage each
    assert weight_pages.move_to_huge_pages(weights, model) == 0  # a second manager finds them moved
    kib = _huge_kib(model.model.layers[0].mlp.up_proj.weight.data_ptr())
    assert kib is not None and kib >= 2048, kib
    with torch.no_grad():  # an in-place update lands in the moved weight
        model.lm_head.weight.add_(1.0)
    assert torch.equal(model.model.embed_tokens.weight, values["model.embed_tokens.weight"] + 1.0)


def test_views_and_differently_shared_storages_stay():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    base = torch.randn(96, 64)
    with torch.no_grad():
        model[0].weight = torch.nn.Parameter(base[:64])  # views of one storage: moving would split it
        model[1].weight = torch.nn.Parameter(base[64:])
    whole = torch.nn.Linear(64, 64)
    assert weight_pages.movable([model[0].weight, model[1].weight], model) == []
    found = weight_pages.movable([whole.weight, whole.weight], whole)  # the same storage once
    assert len(found) == 1 and found[0] is whole.weight


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
def test_without_huge_pages_nothing_moves_and_the_plan_says_why(monkeypatch, tmp_path):
    off = tmp_path / "enabled"
    off.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "THP_ENABLED", off)
    assert hugepages.availability() == (False, "transparent huge pages are never")
    model = make_tiny_model("llama", seed=3)
    before = [p.data_ptr() for p in model.parameters()]
    config = ContinuousBatchingConfig(cpu_kernel_overrides={"linear": "small_linear"})
    pages = ContinuousBatchingManager(model, config=config).resolved_config.cpu.pages
    assert pages.summary == "one-row weights on ordinary pages (transparent huge pages are never)" and not pages.move
    assert weight_pages.move_to_huge_pages(list(model.parameters()), model) == 0
    assert [p.data_ptr() for p in model.parameters()] == before


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
def test_a_manager_moves_the_one_row_weights_and_stays_exact():
    model = make_tiny_model("llama", seed=4)
    available = hugepages.availability()[0]
    config = ContinuousBatchingConfig(cpu_kernel_overrides={"linear": "small_linear"})
    prompts = random_prompts(3, 5, 20, seed=4)
    want = [reference_generate(model, p, 12) for p in prompts]
    manager = ContinuousBatchingManager(model, config=config)
    pages = manager.resolved_config.cpu.pages
    assert pages.move == available and ("on 2 MiB pages" in pages.summary) == available, pages
    assert pages.nbytes == sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert f"weights: {pages.summary}" in manager.resolved_config.cpu.describe()
    out = generate_batch(model, prompts, GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None),
                         progress_bar=False, config=config)
    assert [out[f"req_{i}"].generated_tokens for i in range(3)] == want
    if available:
        assert all(weight_pages.is_moved(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
@pytest.mark.parametrize("linear", ["onednn", "aten"])
def test_every_routable_weight_moves_whatever_its_kernel_none_under_aten(linear):
    """A lone request's decode reads every linear weight whole, whichever kernel runs it: all of
    them move (here oneDNN's, which never runs `small_linear`); a plan that keeps PyTorch's
    linears (asked `aten`) moves none. Tokens are the same either way."""
    model = make_tiny_model("llama", seed=5)
    available = hugepages.availability()[0]
    config = ContinuousBatchingConfig(cpu_kernel_overrides={"linear": linear})
    manager = ContinuousBatchingManager(model, config=config)
    pages = manager.resolved_config.cpu.pages
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    want_bytes = sum(m.weight.numel() * 4 for m in linears) if linear != "aten" else 0
    assert pages.nbytes == want_bytes, pages
    prompts = random_prompts(2, 5, 16, seed=5)
    want = [reference_generate(model, p, 10) for p in prompts]
    out = generate_batch(model, prompts, GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None),
                         progress_bar=False, config=config)
    assert [out[f"req_{i}"].generated_tokens for i in range(2)] == want
    assert all(weight_pages.is_moved(m.weight) for m in linears) == (available and linear != "aten")


def test_private_mapping_is_zero_aligned_and_huge_where_available():
    buffer, start = hugepages.zeroed_buffer(5 << 20)
    t = torch.frombuffer(buffer, dtype=torch.uint8, count=5 << 20, offset=start)
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0 and not t.any()
    t.fill_(7)
    if hugepages.availability()[0]:
        assert (_huge_kib(t.data_ptr()) or 0) >= 2048  # private memory: shmem_enabled does not apply


@pytest.mark.skipif(not native.load()[0], reason="our C++ kernels cannot be built here")
def test_packed_weights_move_too(tiny_dir):
    """A quantized model's codes, scales and mins are streamed by its one-row kernels as float
    weights are: they are planned and moved the same way, values unchanged."""
    from contbatch import load_model
    from contbatch.cpu.quant.linear import QuantLinear

    model, _ = load_model(tiny_dir, quantization="int4")
    packed = [m for m in model.modules() if isinstance(m, QuantLinear)]
    codes = [m.codes.clone() for m in packed]
    pages = ContinuousBatchingManager(model, config=ContinuousBatchingConfig()).resolved_config.cpu.pages
    assert pages.nbytes >= sum(m.nbytes for m in packed)
    out = generate_batch(model, [[5, 6, 7, 8]], GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None),
                         progress_bar=False)
    assert len(out["req_0"].generated_tokens) == 3
    assert all(torch.equal(c, m.codes) for c, m in zip(codes, packed))
    assert all(weight_pages.is_moved(m.codes) for m in packed) == hugepages.availability()[0]
