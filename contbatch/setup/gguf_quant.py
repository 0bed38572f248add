"""Serving a GGUF file at its own quantization: its Q8_0, Q4_0 and Q4_1 tensors copied block
for block into `QuantLinear` layers, never through float.

The model is first loaded as today (transformers dequantizes every tensor, which gives the
norms and the layers left float); then each linear layer whose GGUF tensor is of one of these
types is swapped for the tensor's own blocks, and so is a plain embedding (a lookup of the
packed table, `cpu/quant/embedding.py`; a tied one shares the head's):

- Q8_0 (fp16 d, 32 int8): int8 codes with groups of 32, scale d.
- Q4_0 (fp16 d, 16 bytes of nibbles): int4, scale d, min -8 d (w = (q - 8) d exactly).
- Q4_1 (fp16 d, fp16 m, 16 bytes): int4, scale d, min m.

The nibble bytes are ggml's order, and the fp16 fields are kept as they are (cpu/quant/format.py).
fp16 to float32 is exact, and the dequantized values are those transformers computed, so every swapped layer is
checked against the float weight it replaces, bit for bit, before it is kept: a layer that
differs (a name mapping or row order this code did not foresee) stays float and is counted.
Rows of q/k that transformers reorders for the rotary layout (its tensor processor) are
reordered the same way, found by running that processor on the row numbers. Other types
(F16, F32, the K-quants Q4_K, Q6_K, ...) have no exact conversion here: they stay float (the
values transformers dequantized), and the start-up line says how many and why.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from ..config import QuantSummary
from ..cpu import native, ops
from ..cpu.quant.format import BLOCK, PackedWeight, QuantFormat, dequantize, symmetric_mins
from ..cpu.quant.linear import QuantLinear
from .quantize import (linear_layers, plain_embedding, record, share_tied_table, summary_of, swap, swap_embedding,
                       tied_embedding)

logger = logging.getLogger("contbatch")

_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _fp16(raw: np.ndarray, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block ([rows, blocks, bytes]), float16 [rows, blocks]."""
    return torch.from_numpy(np.ascontiguousarray(np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0]))


def packed_from_blocks(kind: str, raw: np.ndarray, out: int, inp: int) -> PackedWeight:
    """A GGUF tensor's raw bytes (uint8 [out, blocks * block bytes]) as our packed weight."""
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"{kind} blocks have no packed form here (only {sorted(_BLOCK_BYTES)})")
    if inp % BLOCK or raw.shape != (out, inp // BLOCK * _BLOCK_BYTES[kind]):
        raise ValueError(f"{kind} data {raw.shape} does not hold [{out}, {inp}] weights")
    blocks = raw.reshape(out, inp // BLOCK, _BLOCK_BYTES[kind])
    d = _fp16(blocks, 0)
    if kind == "Q8_0":
        codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out, inp))
        return PackedWeight(QuantFormat(8, BLOCK, kind), codes.contiguous(), d, None, out, inp)
    nibbles = blocks[..., 2:] if kind == "Q4_0" else blocks[..., 4:]
    # -8 d is exact in fp16 (a power of two) unless |d| > 8188 overflows it: then the values
    # differ from the file's and the caller's bit-for-bit check keeps the layer float
    mins = symmetric_mins(d) if kind == "Q4_0" else _fp16(blocks, 2)
    codes = torch.from_numpy(np.ascontiguousarray(nibbles).reshape(out, inp // 2))
    return PackedWeight(QuantFormat(4, BLOCK, kind), codes, d, mins, out, inp)


def _values(packed: PackedWeight) -> torch.Tensor:
    """The packed weight's float32 values (by the C++ op where the library is loaded)."""
    if native.load()[0]:
        f = packed.fmt
        return ops.quant_dequantize(packed.codes, packed.scales, packed.mins, f.bits, f.group)
    return dequantize(packed)


def _row_order(processor, name: str, rows: int, mapping: dict) -> np.ndarray | None:
    """The order transformers' tensor processor puts a tensor's rows in, or None if it does
    more than reorder rows."""
    result = processor.process(weights=np.arange(rows).reshape(rows, 1), name=name, tensor_key_mapping=mapping,
                               parsed_parameters={"config": {}, "tensors": {}})
    order = np.asarray(result.weights).reshape(-1)
    return order if order.shape == (rows,) and np.array_equal(np.sort(order), np.arange(rows)) else None


@torch.no_grad()
def attach_gguf_blocks(model: torch.nn.Module, path: str | Path) -> QuantSummary:
    """Swaps the linear layers of `model` (loaded from the GGUF file at `path`, dequantized)
    for the file's own blocks where their type allows (see the module docstring)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    if summary_of(model) is not None:
        raise ValueError("this model is quantized already")
    reader = gguf.GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    mapping = get_gguf_hf_weights_map(model, processor)
    by_hf = {mapping[t.name]: t for t in reader.tensors if t.name in mapping}
    embed = model.get_input_embeddings()
    embed_name = next((n for n, p in model.named_parameters() if embed is not None and p is embed.weight), None)
    tied = tied_embedding(model)
    swapped: list[QuantLinear] = []
    left: dict[str, int] = {}

    def packed_like(tensor, weight: torch.Tensor) -> PackedWeight | str:
        """The GGUF tensor's blocks as a packed weight equal to `weight`, or why not."""
        kind = tensor.tensor_type.name
        if kind not in _BLOCK_BYTES:
            return f"{kind}: dequantized, no exact conversion here"
        order = _row_order(processor, tensor.name, weight.shape[0], mapping)
        if order is None:
            return "its GGUF rows are transformed, not only reordered"
        packed = packed_from_blocks(kind, np.asarray(tensor.data)[order], *weight.shape)
        # in the loaded dtype: a bfloat16 model's weight is the file's values rounded to it
        if not torch.equal(_values(packed).to(weight.dtype), weight.detach()):
            return f"{kind} blocks differ from the loaded weight"
        return packed

    for name, m in linear_layers(model):
        tensor = by_hf.get(f"{name}.weight")
        if tensor is None and embed is not None and m.weight is embed.weight:
            tensor = by_hf.get(embed_name)  # a tied head: the embedding's blocks
        packed = packed_like(tensor, m.weight) if tensor is not None else "no GGUF tensor found for it"
        if isinstance(packed, str):
            left[packed] = left.get(packed, 0) + 1
            continue
        swapped.append(swap(model, name, m, packed))
    embedding = share_tied_table(model, tied)
    plain = plain_embedding(model) if tied is None else None  # a tied one is packed with its head or not at all
    if plain is not None and by_hf.get(embed_name) is not None:  # an untied embedding of its own blocks
        packed = packed_like(by_hf[embed_name], plain.weight)
        if not isinstance(packed, str):
            swap_embedding(model, plain, packed)
            embedding = packed.fmt.source
    return record(model, "gguf", swapped, left, embedding)
