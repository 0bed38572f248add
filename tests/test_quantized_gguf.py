"""GGUF tensors served at their own quantization: Q8_0/Q4_0/Q4_1 blocks converted without a
float round trip (checked against the gguf package's own dequantization), and the default
model's GGUF (Q4_1 + a Q8_0 head) against `model.generate` on its dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from contbatch.cpu import native
from contbatch.cpu.quant.linear import QuantLinear
from contbatch.setup.gguf_quant import packed_from_blocks

from test_quantized import TIE_MARGIN, margin_at, reference_values

BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@pytest.mark.parametrize("kind", sorted(BYTES))
def test_blocks_convert_to_the_gguf_packages_values(kind):
    import gguf

    rng = np.random.default_rng(len(kind))
    out, inp = 24, 96
    raw = rng.integers(0, 256, size=(out, inp // 32 * BYTES[kind]), dtype=np.uint8)
    blocks = raw.reshape(out, inp // 32, BYTES[kind])
    scales = rng.standard_normal((out, inp // 32, 2)).astype(np.float16)  # finite d (and m) fields
    blocks[..., :4 if kind == "Q4_1" else 2] = scales.view(np.uint8).reshape(out, inp // 32, 4)[..., :4 if kind == "Q4_1" else 2]
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32))
    layer = QuantLinear(packed_from_blocks(kind, raw, out, inp))
    assert expected.shape == (out, inp)
    assert torch.equal(reference_values(layer), expected)
    assert torch.equal(layer.dequantized(), expected)


def test_other_block_types_are_refused():
    with pytest.raises(ValueError, match="no packed form"):
        packed_from_blocks("Q6_K", np.zeros((4, 210), np.uint8), 4, 256)
    with pytest.raises(ValueError, match="does not hold"):
        packed_from_blocks("Q4_1", np.zeros((4, 20), np.uint8), 4, 64)


@pytest.mark.slow
@pytest.mark.skipif(not native.load()[0], reason="needs the C++ kernels")
def test_default_gguf_served_quantized_matches_its_dequantized_model(default_model):
    """The default model's GGUF at its quantization: every linear layer swapped (210 Q4_1, the
    tied head Q8_0), and greedy tokens equal `model.generate` on the dequantized model (the
    suite's default model, made from the same GGUF by the gguf package), except near-ties."""
    from transformers import GenerationConfig

    from contbatch import ContinuousBatchingConfig, generate_batch
    from contbatch.setup.loading import load_model

    model, tok = load_model(quantization="gguf")
    ref, _ = default_model
    summary = model.contbatch_quantization
    assert dict(summary.formats) == {"Q4_1": 210, "Q8_0": 1} and not summary.float_layers
    # The tied embedding looks up the head's Q8_0 table: the values transformers dequantized.
    assert summary.embedding == "Q8_0, shared with the tied head"
    ids = torch.tensor([[0, 17, 49151]])
    assert torch.equal(model.get_input_embeddings()(ids), ref.get_input_embeddings()(ids))
    float_bytes = 4 * sum(p.numel() for p in model.parameters())  # the norms
    assert summary.packed_bytes < summary.resident_bytes < summary.packed_bytes + float_bytes + 2**20
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            assert torch.equal(reference_values(m), ref.get_submodule(name).weight.detach()), name
    texts = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "List three colors:"]
    prompts = [tok.encode(t) for t in texts]
    gc = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None)
    results = generate_batch(model, prompts, gc, ContinuousBatchingConfig(), progress_bar=False)
    from conftest import reference_generate

    for i, prompt in enumerate(prompts):
        got, expected = results[f"req_{i}"].generated_tokens, reference_generate(ref, prompt, 16)
        if got != expected:
            step = next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b)
            margin = margin_at(ref, prompt, expected, step)
            print(f"prompt {i}: near-tie at token {step}, margin {margin:.3g}")
            assert margin < TIE_MARGIN, f"prompt {i} differs at token {step} with margin {margin:.3g}"


@pytest.mark.skipif(not native.load()[0], reason="needs the C++ kernels")
def test_default_gguf_served_quantized_in_bfloat16(default_model):
    """A bfloat16 load keeps the file's blocks too: its weights are the file's values rounded
    to bfloat16, so they are compared in that dtype, and the packed layers hold the exact
    values (those of the float32 model); activations and outputs are bfloat16."""
    from contbatch.setup.loading import load_model

    model, _ = load_model(quantization="gguf", dtype=torch.bfloat16)
    ref, _ = default_model
    summary = model.contbatch_quantization
    assert dict(summary.formats) == {"Q4_1": 210, "Q8_0": 1} and not summary.float_layers
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj", "lm_head"):
        assert torch.equal(reference_values(model.get_submodule(name)), ref.get_submodule(name).weight.detach()), name
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 504, 3458, 282]])).logits
        expected = ref(torch.tensor([[1, 504, 3458, 282]])).logits
    assert logits.dtype == torch.bfloat16
    # bfloat16 activations move every logit (up to 1.13 from float64 over a 128-token prompt,
    # docs/cpu.md), so the ranks below the first can swap at near-ties: the first token is
    # compared, and the logits within that rounding's reach
    got, want = logits[0, -1].float(), expected[0, -1]
    assert got.argmax() == want.argmax()
    assert (got - want).abs().max() < 1.5
