"""The quantized benchmark's floor (benchmarks/quantized.py): the bytes a decode token reads,
for a float model, a quantized one with its tied table packed and shared, and one whose
untied embedding stays float beside a packed head."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import make_tiny_model
from contbatch.cpu import native
from contbatch.cpu.quant.embedding import QuantEmbedding
from contbatch.cpu.quant.linear import QuantLinear
from contbatch.setup.quantize import quantize_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import quantized as bench  # noqa: E402


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.skipif(not native.load()[0], reason="needs the C++ kernels")
def test_decode_read_bytes():
    model = make_tiny_model("llama")
    table = model.get_input_embeddings().weight
    # untied float: every parameter but the embedding table
    assert bench.decode_read_bytes(model) == nbytes(model.parameters()) - nbytes([table])
    model.lm_head.weight = table  # tied float: the table is the head's weight, read whole
    assert bench.decode_read_bytes(model) == nbytes(model.parameters())
    quantize_model(model, "int8")  # tied and packed: the table is read as the head, once
    assert isinstance(model.get_input_embeddings(), QuantEmbedding)
    packed = sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))
    assert bench.decode_read_bytes(model) == packed + nbytes(model.parameters())
    assert nbytes(model.parameters()) < nbytes([table]) // 4  # norms only: the float table is gone
    untied = make_tiny_model("llama")
    quantize_model(untied, "int8")  # untied: its float table stays and is read a row at a time
    float_table = untied.get_input_embeddings().weight
    packed = sum(m.nbytes for m in untied.modules() if isinstance(m, QuantLinear))
    assert bench.decode_read_bytes(untied) == packed + nbytes(untied.parameters()) - nbytes([float_table])
