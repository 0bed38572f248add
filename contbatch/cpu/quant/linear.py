"""`QuantLinear`: a linear layer whose weight is held packed (int8 or int4, `format.py`).

It replaces an `nn.Linear` in the model (setup/quantize.py does the swap) and computes
`F.linear(x, W, b)` with W the packed weight's dequantized float32 values, float32
accumulation. On a CPU with our C++ library every call runs `ops.quant_linear`: a few rows
(decoding) dequantize in registers, reading only the packed bytes; more rows (batched steps,
prompts) dequantize a panel of output features at a time, once for all the rows, into float32
register tiles. Why ours rather than
PyTorch's `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu`: measured in
benchmarks/quantized.py (docs/cpu.md has the figures): with float32 activations the aten ops
were several times slower than a float32 linear, and with bfloat16 activations their output
is no longer the float32 model's. Without the library (no compiler) the weight is dequantized
in PyTorch at each call: correct, slower, and said at start-up.

It is not an `nn.Linear`: the float linear router and adapters leave it alone. The fused
decoder layers (routers/layer.py) take it: their C++ call runs the same `quant_linear` op
on its buffers, so a layer of packed linears is still one call. It has no `weight` parameter:
code that would copy float weights into it (`update_weights`) refuses by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import native, ops
from .format import PackedWeight, QuantFormat, dequantize, tile

_ACTIVATIONS = (torch.float32, torch.bfloat16)


class QuantLinear(torch.nn.Module):
    """y = x W^T + b with W packed; codes, scales, mins and bias are buffers (they move with
    the module and appear in its state dict as `<name>.codes`, `.scales`, `.mins`, `.bias`)."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.native = native.load()[0]
        if self.native and packed.codes.device.type == "cpu" and ops.quant_tiles_available():
            packed = tile(packed)  # integer dot products on 16 outputs at once (format.py)
        self.fmt: QuantFormat = packed.fmt
        self.in_features = packed.in_features
        self.out_features = packed.out_features
        self.register_buffer("codes", packed.codes.contiguous())
        self.register_buffer("scales", packed.scales.contiguous())
        self.register_buffer("mins", None if packed.mins is None else packed.mins.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        if self.native:
            ops.register_quant_fakes()

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.fmt, self.codes, self.scales, self.mins, self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed weight (the bias not counted)."""
        return self.packed.nbytes

    def dequantized(self) -> torch.Tensor:
        """The weight's float32 values [out, in] (on the codes' device)."""
        if self.native and self.codes.device.type == "cpu":
            return ops.quant_dequantize(self.codes, self.scales, self.mins, self.fmt.op_bits, self.fmt.group)
        return dequantize(self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.device.type == "cpu" and x.dtype in _ACTIVATIONS:
            return ops.quant_linear(x, self.codes, self.scales, self.mins, self.bias, self.fmt.op_bits, self.fmt.group)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.fmt.bits}, "
                f"group={self.fmt.group}, source={self.fmt.source}, bias={self.bias is not None}")
