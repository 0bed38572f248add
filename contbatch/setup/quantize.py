"""Quantizing a loaded model's linear layers: swapping `nn.Linear` for `cpu.quant.QuantLinear`.

`quantize_model` quantizes a float model at load (round-to-nearest, `cpu/quant/format.py`);
setup/gguf_quant.py swaps in a GGUF file's own blocks instead. Both leave a `QuantSummary` on
the model (`model.contbatch_quantization`), which the resolved config carries and the
start-up line prints: which layers run quantized, in which formats, and the resident bytes.

Only plain `nn.Linear` layers on the CPU with float weights are swapped, and only where the
inputs are a whole number of groups (multiples of 32); others stay float and are counted.
The output layer is int8 (per channel) under the int4 methods too, as llama.cpp keeps its
output tensor at 6-8 bits: it picks the tokens, and at 4 bits it carried nearly all of the
default model's error (docs/cpu.md). A tied output layer (lm_head sharing the embedding) is
one weight: quantized, it stays one, and a plain `nn.Embedding` becomes a `QuantEmbedding`
reading the head's packed table (its lookups are the dequantized values, as they would be in
the float model with that weight replaced by its dequantized values), so no float copy of the
table stays resident beside the packed one. An embedding of another class (one that scales
its lookups) keeps a float table.
"""

from __future__ import annotations

import logging

import torch

from ..config import QuantSummary
from ..cpu import ops
from ..cpu.quant.embedding import QuantEmbedding
from ..cpu.quant.format import BLOCK, PackedWeight, format_for, quantize
from ..cpu.quant.linear import QuantLinear

logger = logging.getLogger("contbatch")

ATTRIBUTE = "contbatch_quantization"
METHODS = ("int8", "int4", "int4-g32", "int4-g128")


def summary_of(model: torch.nn.Module) -> QuantSummary | None:
    return getattr(model, ATTRIBUTE, None)


def linear_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The model's plain float `nn.Linear` layers on the CPU, by qualified name."""
    return [(name, m) for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and m.weight.is_floating_point() and m.weight.device.type == "cpu"]


def replace_module(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def swap(model: torch.nn.Module, name: str, old: torch.nn.Linear, packed: PackedWeight) -> QuantLinear:
    """Puts a QuantLinear holding `packed` (and `old`'s bias) where `old` was."""
    new = QuantLinear(packed, None if old.bias is None else old.bias.detach().float())
    replace_module(model, name, new)
    return new


def plain_embedding(model: torch.nn.Module) -> torch.nn.Embedding | None:
    """The model's input embedding where a packed table can replace it: a plain float
    `nn.Embedding` on the CPU (not a subclass that scales its lookups), else None."""
    embed = model.get_input_embeddings()
    if type(embed) is not torch.nn.Embedding or not embed.weight.is_floating_point():
        return None
    return embed if embed.weight.device.type == "cpu" else None


def swap_embedding(model: torch.nn.Module, old: torch.nn.Embedding, packed: PackedWeight) -> QuantEmbedding:
    """Puts a QuantEmbedding on `packed` where the input embedding `old` was."""
    new = QuantEmbedding(packed, old.weight.dtype, old.padding_idx)
    model.set_input_embeddings(new)
    return new


def tied_embedding(model: torch.nn.Module) -> torch.nn.Embedding | None:
    """The plain input embedding (`plain_embedding`) whose weight the output layer shares, or
    None; asked before the head is swapped."""
    embed, head = plain_embedding(model), model.get_output_embeddings()
    return embed if embed is not None and getattr(head, "weight", None) is embed.weight else None


def share_tied_table(model: torch.nn.Module, embed: torch.nn.Embedding | None) -> str | None:
    """Where the head was tied to `embed` and is now quantized, the embedding becomes a lookup
    of the head's packed table (one table resident); returns its format, or None."""
    head = model.get_output_embeddings()
    if embed is None or not isinstance(head, QuantLinear):
        return None
    swap_embedding(model, embed, head.packed)
    return f"{head.fmt.source}, shared with the tied head"


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of the model, each storage counted once (a tied or
    shared tensor is resident once)."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def record(model: torch.nn.Module, method: str, swapped: list[QuantLinear], left: dict[str, int],
           embedding: str | None = None) -> QuantSummary:
    """Leaves the summary on the model and logs it once."""
    formats: dict[str, int] = {}
    for m in swapped:
        formats[m.fmt.source] = formats.get(m.fmt.source, 0) + 1
    summary = QuantSummary(method, len(swapped), tuple(sorted(formats.items())), tuple(sorted(left.items())),
                           sum(m.nbytes for m in swapped), sum(4 * m.in_features * m.out_features for m in swapped),
                           embedding, resident_bytes(model), sum(m.fmt.tiled for m in swapped),
                           ops.quant_tiles_available())
    setattr(model, ATTRIBUTE, summary)
    logger.info("contbatch: %s", summary.describe())
    return summary


@torch.no_grad()
def quantize_model(model: torch.nn.Module, method: str) -> QuantSummary:
    """Quantizes every eligible linear layer of `model` in place (round-to-nearest; see the
    module docstring); "int4" is groups of 32. The output layer (lm_head) is int8 under every
    method: it decides the tokens, and at 4 bits it carries most of a model's error (a tied one
    is the embedding table too). A layer whose inputs are not a multiple of the group stays
    float ("int4-g128" falls back to groups of 32 where 128 does not divide)."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS} (or 'gguf' for a GGUF file), got {method!r}")
    if summary_of(model) is not None:
        raise ValueError("this model is quantized already")
    swapped, left, tied = [], {}, tied_embedding(model)
    head = model.get_output_embeddings()
    for name, m in linear_layers(model):
        fmt = format_for("int8" if m is head else method, m.in_features)
        if m.in_features % fmt.group and fmt.bits == 4 and m.in_features % BLOCK == 0:
            fmt = format_for("int4-g32", m.in_features)
        if m.in_features % BLOCK or m.in_features % fmt.group:
            why = f"inputs not a multiple of {fmt.group}"
            left[why] = left.get(why, 0) + 1
            continue
        swapped.append(swap(model, name, m, quantize(m.weight, fmt)))
    return record(model, method, swapped, left, share_tied_table(model, tied))
