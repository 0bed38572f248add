"""The tiled layout of packed weights (cpu/quant/format.py) and its integer kernels
(csrc/quant_tiles.h, AVX-512 VNNI): the layout round-trips and looks up rows as the row
layout does, and the kernels' outputs stay within the bound their docstring states against
F.linear on the dequantized weight, for int8 and int4, every row count they take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from contbatch.cpu import native, ops
from contbatch.cpu.quant.format import (PackedWeight, QuantFormat, dequantize, format_for, quantize, symmetric_mins,
                                        tile, untile)

FORMATS = {"int8": format_for("int8", 256), "Q8_0": QuantFormat(8, 32, "Q8_0"), "int4": format_for("int4", 256),
           "int4-g128": format_for("int4-g128", 256), "Q4_0": QuantFormat(4, 32, "Q4_0")}


def quantized(w: torch.Tensor, name: str) -> PackedWeight:
    """w in format `name`; Q4_0 as a GGUF file holds it: every min -8 x its scale (symmetric)."""
    packed = quantize(w, FORMATS[name])
    if name == "Q4_0":
        packed.mins = symmetric_mins(packed.scales)
    return packed


needs_tiles = pytest.mark.skipif(not (native.load()[0] and ops.quant_tiles_available()),
                                 reason="needs the C++ kernels with AVX-512 VNNI")


@pytest.mark.parametrize("name", FORMATS)
def test_tile_round_trips_and_looks_up_rows_as_the_row_layout(name):
    torch.manual_seed(0)
    packed = quantized(torch.randn(48, 256), name)
    tiled = tile(packed)
    assert tiled.fmt.tiled and tiled.nbytes == packed.nbytes
    assert tiled.fmt.symmetric == (name == "Q4_0")  # its mins are -8 x its scales: the kernels fold them in
    assert tiled.codes.shape == packed.codes.shape and not torch.equal(tiled.codes, packed.codes)
    back = untile(tiled)
    assert not back.fmt.tiled and not back.fmt.symmetric and back.fmt.op_bits == packed.fmt.bits
    for a, b in ((back.codes, packed.codes), (back.scales, packed.scales), (back.mins, packed.mins)):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(dequantize(tiled), dequantize(packed))
    ids = torch.tensor([0, 17, 47, 5, 17, 16])
    got, want = tiled.rows(ids), packed.rows(ids)
    assert torch.equal(dequantize(got), dequantize(want)) and torch.equal(got.codes, want.codes)
    assert tile(quantized(torch.randn(40, 256), name)).fmt.tiled is False  # not a multiple of 16


@pytest.mark.skipif(not native.load()[0], reason="needs the C++ kernels")
@pytest.mark.parametrize("name", FORMATS)
def test_rows_read_in_place_equal_the_dequantized_rows(name):
    """`quant_rows` (an embedding's lookup) reads rows of either layout in place: each equals
    that row of the whole weight's dequantized values, bit for bit; an id outside the table is
    refused by name."""
    torch.manual_seed(1)
    packed = quantized(torch.randn(48, 256), name)
    ids = torch.tensor([0, 17, 47, 5, 17, 16, 31])
    want = dequantize(packed)[ids]
    layouts = [packed, tile(packed)] if ops.quant_tiles_available() else [packed]
    for w in layouts:
        got = ops.quant_rows(w.codes, w.scales, w.mins, ids, w.fmt.op_bits, w.fmt.group)
        assert got.dtype == torch.float32 and torch.equal(got, want), (name, w.fmt.tiled)
        assert torch.equal(ops.quant_rows(w.codes, w.scales, w.mins, ids[:0], w.fmt.op_bits, w.fmt.group),
                           want[:0])
        with pytest.raises(RuntimeError, match="outside the 48 rows"):
            ops.quant_rows(w.codes, w.scales, w.mins, torch.tensor([48]), w.fmt.op_bits, w.fmt.group)


@needs_tiles
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 37, 65, 600])
def test_tiled_kernel_within_its_bound_of_linear_on_dequantized_weights(name, rows):
    """Each input is written as an integer multiple of its block's step d (2^-22 of the block's
    largest power of two), so an output is off by at most d / 2 x sum |w| per block, plus float32
    accumulation; an outlier input (a transformer's massive activations) makes d coarse for its
    block, which the bound follows. Every row count runs them (600: two calls of at most 512)."""
    torch.manual_seed(rows)
    packed = tile(quantized(torch.randn(96, 256), name))
    w = dequantize(packed).double()
    x = torch.randn(rows, 256) * torch.rand(rows, 256) ** 4
    x[:, 37] = 3e3  # one outlier input in block 1
    bias = torch.randn(96)
    got = ops.quant_linear(x, packed.codes, packed.scales, packed.mins, bias, packed.fmt.op_bits,
                           packed.fmt.group).double()
    expected = F.linear(x.double(), w, bias.double())
    top = x.abs().reshape(rows, -1, 32).amax(-1)  # [rows, blocks]
    step = torch.exp2(torch.floor(torch.log2(top)) + 1 - 22)
    per_block = w.abs().reshape(96, -1, 32).sum(-1)  # [out, blocks]
    bound = 0.5 * step.double() @ per_block.T + 2e-6 * (x.double().abs() @ w.abs().T)
    assert ((got - expected).abs() <= bound).all()
    row_layout = untile(packed)
    plain = ops.quant_linear(x, row_layout.codes, row_layout.scales, row_layout.mins, bias, row_layout.fmt.op_bits,
                             row_layout.fmt.group).double()
    assert ((plain - expected).abs() <= bound).all()


@needs_tiles
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 5, 37, 600])
def test_tiled_kernel_takes_bfloat16_inputs_in_two_digits(name, rows):
    """bfloat16 x (8 significant bits) is written in two digits, d 2^-14 of the block's largest
    power of two: exact for every input within 2^-7 of its block's largest, the rest within
    d / 2; the output is rounded to bfloat16 (2^-9 of it), which the bound adds."""
    torch.manual_seed(rows)
    packed = tile(quantized(torch.randn(96, 256), name))
    w = dequantize(packed).double()
    x = (torch.randn(rows, 256) * torch.rand(rows, 256) ** 4).bfloat16()
    x[:, 37] = 3e3
    got = ops.quant_linear(x, packed.codes, packed.scales, packed.mins, None, packed.fmt.op_bits, packed.fmt.group)
    assert got.dtype == torch.bfloat16
    expected = F.linear(x.double(), w)
    top = x.double().abs().reshape(rows, -1, 32).amax(-1)
    step = torch.exp2(torch.floor(torch.log2(top)) + 1 - 14)
    per_block = w.abs().reshape(96, -1, 32).sum(-1)
    bound = 0.5 * step @ per_block.T + 2e-6 * (x.double().abs() @ w.abs().T)
    assert ((got.double() - expected).abs() <= bound + 2.0**-8 * (expected.abs() + bound)).all()
    # against three digits (the same x in float32): apart by no more than the two bounds
    three = ops.quant_linear(x.float(), packed.codes, packed.scales, packed.mins, None, packed.fmt.op_bits,
                             packed.fmt.group).double()
    assert ((three - expected).abs() <= bound).all()
    assert ((got.double() - three).abs() <= 2 * bound + 2.0**-8 * (expected.abs() + bound)).all()


@needs_tiles
@pytest.mark.parametrize("fmt", ["Q8_0", "int4", "Q4_0"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("rows", [3, 40])
def test_tiled_kernel_passes_non_finite_inputs_on(fmt, bad, rows):
    packed = tile(quantized(torch.randn(32, 64), fmt))
    x = torch.randn(rows, 64)
    x[1, 37] = bad
    y = ops.quant_linear(x, packed.codes, packed.scales, packed.mins, None, packed.fmt.op_bits, packed.fmt.group)
    others = torch.ones(rows, dtype=torch.bool)
    others[1] = False
    assert torch.isfinite(y[others]).all() and not torch.isfinite(y[1]).any()


def test_tiled_weights_need_whole_tiles():
    packed = quantize(torch.randn(48, 64), FORMATS["Q8_0"])
    with pytest.raises(ValueError, match="multiple of 16"):
        type(packed)(QuantFormat(8, 32, "Q8_0", tiled=True), packed.codes[:40], packed.scales[:40], None, 40, 64)


@needs_tiles
@pytest.mark.parametrize("rows", [1, 2, 3, 40, 300])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_tiled_linears_of_one_input_in_one_call_equal_each_alone(rows, threads):
    """`quant_linears` hands the output features of several tiled linears out in units over
    the threads (odd tile counts, so units straddle linears): every output equals
    `quant_linear`'s on its own weight bit for bit, float32 and bfloat16 x, at any thread count."""
    torch.manual_seed(rows)
    layers = [(tile(quantized(torch.randn(out, 256), name)), bias)
              for out, name, bias in ((48, "Q8_0", torch.randn(48)), (208, "int4", None), (80, "int8", None),
                                      (16, "int4-g128", torch.randn(16)), (112, "Q4_0", torch.randn(112)))]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, 256).to(dtype)
            got = ops.quant_linears(x, [(p.codes, p.scales, p.mins, b, p.fmt.op_bits, p.fmt.group) for p, b in layers])
            for (p, b), y in zip(layers, got):
                alone = ops.quant_linear(x, p.codes, p.scales, p.mins, b, p.fmt.op_bits, p.fmt.group)
                assert y.dtype == dtype and torch.equal(y, alone)
    finally:
        torch.set_num_threads(before)
