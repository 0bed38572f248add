"""`QuantEmbedding`: a token embedding whose table is held packed (`format.py`).

A lookup rebuilds only the rows it gathers (of a tiled table, their tiles), in place
(`quant_rows`), as their dequantized values exactly (those rows of the `quant_dequantize` the
packed linears are checked against), so a model served from a GGUF file whose embedding is
Q8_0/Q4_0/Q4_1 looks up the values transformers dequantized, bit for bit, without a float copy
of the table beside the packed one. A tied output layer (lm_head sharing the embedding) and the
embedding share one packed table: the same codes, scales and mins tensors, resident once.

It replaces a plain `nn.Embedding` only (setup/gguf_quant.py, setup/quantize.py): a subclass
that scales or offsets its lookups (Gemma's) keeps its float table. It has no `weight`
parameter: code that would read or copy float embedding weights refuses or is refused by name
(`update_weights` refuses any quantized model).
"""

from __future__ import annotations

import torch

from .. import native, ops
from .format import PackedWeight, QuantFormat, dequantize


class QuantEmbedding(torch.nn.Module):
    """`embedding(ids)` of a packed [num_embeddings, embedding_dim] table, in `dtype`."""

    def __init__(self, packed: PackedWeight, dtype: torch.dtype, padding_idx: int | None = None) -> None:
        super().__init__()
        self.fmt: QuantFormat = packed.fmt
        self.num_embeddings = packed.out_features
        self.embedding_dim = packed.in_features
        self.padding_idx = padding_idx
        self.dtype = dtype
        self.register_buffer("codes", packed.codes)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("mins", packed.mins)
        self.native = native.load()[0]

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed table (shared with a tied head's, where there is one)."""
        return PackedWeight(self.fmt, self.codes, self.scales, self.mins, self.num_embeddings,
                            self.embedding_dim).nbytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if self.native and self.codes.device.type == "cpu":  # read in place, whether the table is tiled or not
            rows = ops.quant_rows(self.codes, self.scales, self.mins, ids, self.fmt.op_bits, self.fmt.group)
        else:
            table = PackedWeight(self.fmt, self.codes, self.scales, self.mins, self.num_embeddings,
                                 self.embedding_dim)
            rows = dequantize(table.rows(ids))  # in the row layout, whether the table is tiled or not
        return rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, bits={self.fmt.bits}, group={self.fmt.group}, "
                f"source={self.fmt.source}")
