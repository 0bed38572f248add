"""Weight-only int8/int4 linear layers: the kernel against F.linear on dequantized weights, and
quantized tiny models' greedy tokens against `model.generate` on the same model with every
quantized weight replaced by its dequantized float32 values (built here from the packed data,
not by the code under test), except at measured near-ties."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, generate_batch
from contbatch.cpu import native
from contbatch.cpu.quant.embedding import QuantEmbedding
from contbatch.cpu.quant.format import format_for, quantize
from contbatch.cpu.quant.linear import QuantLinear
from contbatch.setup.quantize import quantize_model

from conftest import make_tiny_model, random_prompts, reference_generate

TIE_MARGIN = 1e-3  # top-two logit margin under which a different greedy token is a near-tie
METHODS = ("int8", "int4", "int4-g128")


def reference_values(m) -> torch.Tensor:
    """The layer's float32 weight from its codes, scales and mins, by the format's definition
    (cpu/quant/format.py), in either layout."""
    o, codes, scales, mins = m.out_features, m.codes, m.scales, m.mins
    if m.fmt.tiled:  # 16 outputs a tile: codes [bytes / 4][16][4], scales and mins [groups][16]
        width = codes.shape[1]
        codes = codes.view(o // 16, width // 4, 16, 4).permute(0, 2, 1, 3).reshape(o, width)
        scales, mins = (None if f is None else f.view(o // 16, -1, 16).permute(0, 2, 1).reshape(o, -1)
                        for f in (scales, mins))
        if m.fmt.bits == 4:  # byte 4v + k: input 8v + k in the low nibble, 8v + 4 + k in the high one
            b = codes.reshape(o, -1, 4).to(torch.int32)
            codes = torch.stack([b & 15, b >> 4], dim=2)
    elif m.fmt.bits == 4:  # each 16-byte block: inputs 0-15 in the low nibbles, 16-31 in the high ones
        b = codes.reshape(o, -1, 16).to(torch.int32)
        codes = torch.cat([b & 15, b >> 4], dim=-1)
    q = codes.reshape(o, -1).float()
    w = q * scales.float().repeat_interleave(m.fmt.group, dim=1)
    return w + mins.float().repeat_interleave(m.fmt.group, dim=1) if mins is not None else w


@pytest.mark.skipif(not native.load()[0], reason="needs the C++ kernels")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(96, 64), (40, 256), (200, 128), (208, 96)])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 37, 70, 300])
def test_kernel_matches_linear_on_dequantized_weights(method, shape, rows):
    out, inp = shape
    torch.manual_seed(rows * 1000 + out)
    weight, bias = torch.randn(out, inp), torch.randn(out)
    fmt = format_for(method, inp)
    if inp % fmt.group:
        fmt = format_for("int4-g32", inp)
    m = QuantLinear(quantize(weight, fmt), bias)
    ref_w = reference_values(m)
    assert torch.equal(m.dequantized(), ref_w)  # the C++ dequantization gives exactly the defined values
    x = torch.randn(2, rows, inp)
    expected = F.linear(x.double(), ref_w.double(), bias.double())
    got = m(x)
    assert got.shape == (2, rows, out) and got.dtype == torch.float32
    assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max() * inp ** 0.5
    got_bf16 = m(x.bfloat16())
    assert got_bf16.dtype == torch.bfloat16
    expected_bf16 = F.linear(x.bfloat16().double(), ref_w.double(), bias.double())
    assert torch.allclose(got_bf16.double(), expected_bf16, rtol=1e-2, atol=1e-2 * expected_bf16.abs().max().item())


@pytest.mark.skipif(not native.load()[0], reason="needs the C++ kernels")
@pytest.mark.parametrize("rows", [1, 4, 7, 12, 20, 100])
def test_linears_of_one_input_in_one_call_equal_each_alone(rows):
    """`quant_linears` (q/k/v or gate/up of a fused layer in one parallel region): every output
    equals `quant_linear`'s on its own weight bit for bit, for mixed formats, with and without bias."""
    from contbatch.cpu import ops

    torch.manual_seed(rows)
    layers = [QuantLinear(quantize(torch.randn(out, 256), format_for(method, 256)), bias)
              for out, method, bias in ((96, "int8", torch.randn(96)), (40, "int4", None),
                                        (200, "int4-g128", torch.randn(200)))]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, rows, 256).to(dtype)
        got = ops.quant_linears(x, [(m.codes, m.scales, m.mins, m.bias, m.fmt.op_bits, m.fmt.group) for m in layers])
        for m, y in zip(layers, got):
            assert y.shape == (1, rows, m.out_features) and y.dtype == dtype
            assert torch.equal(y, m(x))
    with pytest.raises(RuntimeError, match="1 to 512 rows"):
        ops.quant_linears(torch.randn(513, 256), [(m.codes, m.scales, m.mins, m.bias, m.fmt.op_bits, m.fmt.group)
                                                 for m in layers])


@pytest.mark.skipif(not native.load()[0], reason="needs the C++ kernels")
@pytest.mark.parametrize("method", METHODS)
def test_batch_rows_do_not_depend_on_the_rows_beside_them(method):
    """From the rows where a call dequantizes a panel at a time (16 for int8, 12 for int4, in
    the row layout), a row's outputs are the same whatever rows share the call: a request's
    tokens in a batched step do not depend on the batch."""
    torch.manual_seed(3)
    m = QuantLinear(quantize(torch.randn(200, 256), format_for(method, 256)), torch.randn(200))
    if m.fmt.tiled:
        pytest.skip("the tiled layout (AVX-512 VNNI) runs its integer kernels at every row count")
    x = torch.randn(300, 256)
    whole = m(x)
    for lo, hi in ((0, 16), (5, 45), (100, 213), (0, 300)):
        assert torch.equal(m(x[lo:hi]), whole[lo:hi])


def test_quantize_round_to_nearest_error_bounds():
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    for method, bound in (("int8", 0.5 / 127), ("int4", 0.5 / 15)):
        m = QuantLinear(quantize(w, format_for(method, 256)))
        rng = w.reshape(64, -1, m.fmt.group)
        span = (rng.abs().amax(-1) if m.fmt.bits == 8 else rng.amax(-1) - rng.amin(-1))
        err = (reference_values(m) - w).abs().reshape(64, -1, m.fmt.group).amax(-1)
        # half a step, plus what rounding the fp16 scale and min to fp16 may add
        fp16 = 2**-11 * rng.abs().amax(-1)
        assert (err <= bound * span * (1 + 2**-10) + fp16 + 1e-7).all(), method
        assert not (err <= bound * span * 0.9).all(), method  # the bound is not loose


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="groups of 128"):
        quantize(torch.randn(8, 96), format_for("int4-g128", 96))
    with pytest.raises(ValueError, match="NaN"):
        quantize(torch.full((4, 32), float("nan")), format_for("int8", 32))
    with pytest.raises(ValueError, match="float16's range"):
        quantize(torch.full((4, 32), 1e6), format_for("int4", 32))
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(make_tiny_model("llama"), "int3")


def tied_tiny_llama() -> torch.nn.Module:
    """The tiny Llama with its head tied to its embedding (one weight, as in the default model)."""
    model = make_tiny_model("llama")
    model.lm_head.weight = model.get_input_embeddings().weight
    return model


def float_reference(arch: str, quantized: torch.nn.Module, build=None) -> torch.nn.Module:
    """The same tiny model in float32 (`build()`, else `make_tiny_model(arch)`), each quantized
    layer's weight replaced by its values (a tied head's weight is the embedding's too: both
    take them, as the quantized model's packed embedding does)."""
    ref = build() if build is not None else make_tiny_model(arch)
    with torch.no_grad():
        for name, m in quantized.named_modules():
            if isinstance(m, QuantLinear):
                ref.get_submodule(name).weight.copy_(reference_values(m))
    return ref


def margin_at(model, prompt: list[int], generated: list[int], step: int) -> float:
    """The top-two logit margin of `model` before generated[step]."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated[:step]])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def compare(model, ref, prompts, max_new, config) -> list[tuple[int, int, float]]:
    """Engine tokens of `model` against `ref.generate`; returns the near-ties met, fails on others."""
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None)
    results = generate_batch(model, prompts, gc, config, progress_bar=False)
    ties = []
    for i, prompt in enumerate(prompts):
        out = results[f"req_{i}"]
        assert out.error is None, out.error
        expected = reference_generate(ref, prompt, max_new)
        if out.generated_tokens != expected:
            step = next(j for j, (a, b) in enumerate(zip(out.generated_tokens, expected)) if a != b)
            margin = margin_at(ref, prompt, expected, step)
            assert margin < TIE_MARGIN, f"request {i} differs at token {step} with margin {margin:.3g}"
            ties.append((i, step, margin))
    return ties


@pytest.mark.skipif(not native.load()[0], reason="needs the C++ kernels")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_tiny_models_match_their_dequantized_reference(arch, method):
    model = make_tiny_model(arch)
    summary = quantize_model(model, method)
    assert summary.quantized_layers == sum(isinstance(m, QuantLinear) for m in model.modules()) > 0
    assert summary.packed_bytes < summary.float32_bytes / 3
    assert model.lm_head.fmt.source == "int8"  # the output layer is int8 under every method
    body = [m for m in model.modules() if isinstance(m, QuantLinear) and m is not model.lm_head]
    assert sum(m.nbytes for m in body) < sum(4 * m.in_features * m.out_features for m in body) / (
        3 if method == "int8" else 5)
    assert summary.embedding is None and type(model.get_input_embeddings()) is torch.nn.Embedding  # untied: float
    ref = float_reference(arch, model)
    prompts = random_prompts(12, 1, 50, seed=7)
    ties = compare(model, ref, prompts, 8, ContinuousBatchingConfig(block_size=4, max_batch_tokens=48))
    print(f"{arch} {method}: near-ties {ties}")
    assert len(ties) <= 2


@pytest.mark.skipif(not native.load()[0], reason="needs the C++ kernels")
def test_a_tied_head_and_embedding_share_one_packed_table():
    """A tied head is one weight: quantized, the embedding looks its rows up in the head's
    packed table (no float table stays resident), and tokens equal the float model's with that
    one weight replaced by its dequantized values."""
    model = tied_tiny_llama()
    summary = quantize_model(model, "int8")
    embed = model.get_input_embeddings()
    assert isinstance(embed, QuantEmbedding) and embed.codes is model.lm_head.codes
    assert summary.embedding == "int8, shared with the tied head"
    float_bytes = 4 * sum(p.numel() for p in model.parameters())  # the norms: all that stays float
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary" in n)
    assert summary.resident_bytes == summary.packed_bytes + float_bytes + buffers
    ids = torch.tensor([[3, 7, 7, 500]])
    assert torch.equal(embed(ids)[0], reference_values(model.lm_head)[ids[0]])
    ref = float_reference("llama", model, build=tied_tiny_llama)
    assert ref.lm_head.weight is ref.get_input_embeddings().weight
    ties = compare(model, ref, random_prompts(8, 1, 40, seed=3), 8, ContinuousBatchingConfig(block_size=4))
    assert len(ties) <= 2


@pytest.mark.skipif(not native.load()[0], reason="needs the C++ kernels")
def test_resolved_config_and_refusals(tmp_path):
    from contbatch import continuous_batching
    from contbatch.setup.loading import load_model

    model = make_tiny_model("llama")
    summary = quantize_model(model, "int4")
    gc = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None)
    with continuous_batching(model, gc, ContinuousBatchingConfig(block_size=4)) as manager:
        resolved = manager.resolved_config
        assert resolved.quantization == summary
        assert resolved.as_dict()["quantization"]["quantized_layers"] == summary.quantized_layers
        with pytest.raises(ValueError, match="packed int4"):
            manager.update_weights({"lm_head.weight": torch.zeros(512, 64)})
    with pytest.raises(ValueError, match="quantized already"):
        quantize_model(model, "int8")
    with pytest.raises(ValueError, match="tensor parallelism"):
        load_model(tmp_path, quantization="int8", tp_plan="auto")
    with pytest.raises(ValueError, match="cannot be combined"):
        load_model(tmp_path, quantization="int8", dequantize=True)
    with pytest.raises(ValueError, match="not one"):
        load_model(tmp_path, quantization="gguf")


@pytest.mark.skipif(not native.load()[0], reason="needs the C++ kernels")
def test_speculative_and_shared_prefixes_on_a_quantized_model():
    """n-gram speculation (verification runs of a few rows) and prompts sharing long prefixes
    (prefix caching) on an int8 model: tokens equal the dequantized reference's, except at
    near-ties; the decoder layers of packed linears still run as one call."""
    from contbatch import continuous_batching

    model = make_tiny_model("llama")
    quantize_model(model, "int8")
    ref = float_reference("llama", model)
    shared = [5, 9, 13, 5, 9, 13, 5, 9, 13, 7] * 3
    prompts = [shared + p for p in random_prompts(6, 1, 12, seed=9)] + [[4, 8, 4, 8, 4, 8, 4, 8]] * 2
    config = ContinuousBatchingConfig(block_size=4, max_batch_tokens=48,
                                      speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    ties = compare(model, ref, prompts, 16, config)
    assert len(ties) <= 2
    gc = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None)
    with continuous_batching(model, gc, ContinuousBatchingConfig(block_size=4)) as manager:
        cpu = manager.resolved_config.cpu
        assert cpu is not None and len(cpu.layer.layers) == model.config.num_hidden_layers, cpu.layer.summary
