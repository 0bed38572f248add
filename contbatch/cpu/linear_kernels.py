"""The CPU linear kernels that are not ours, beside PyTorch's `F.linear` ("aten"):

- `onednn`: oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`), on the plain weight or on
  a prepacked copy of it in oneDNN's blocked layout (`pack`, `packed_linear`): the same
  products, bit for bit;
- `upcast` (bfloat16 and float16 weights): the product in float32, the weight converted a slice
  of output features at a time, rounded to the weight's dtype once, at the end. 16-bit products
  are exact in float32, so this differs from a 16-bit GEMM by rounding only.

Our own kernels, for a few rows (`small_linear`) and for float32 batches on a weight packed in
panels (`panel`, which keeps its packed copy in a `PackedWeight` as oneDNN's prepacking does),
are in `ops.py`. `contbatch::onednn_linear` and
`contbatch::upcast_linear` are the two kernels as custom ops, opaque to a compiled step:
Inductor's own lowering of oneDNN's linear wants weights frozen as constants, which would make
weight updates impossible.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import native, ops
from .ops import SMALL_LINEAR_MAX_ROWS

logger = logging.getLogger("contbatch")

# The row count oneDNN's blocked layout is chosen for. Any count runs on it; single rows keep
# the plain weight (they ran slower on the blocked one: docs/cpu.md).
PACK_ROWS = 64
UPCAST_SLICE = 1 << 21  # weight elements converted at a time: 8 MiB of float32, in L3 beside the rows


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's linear runs at `dtype` here, tried on a small product and a packing. A
    build can have oneDNN and still lack a dtype (bfloat16 wants AVX-512 or AVX-NE-CONVERT; a
    CPU without them raises "could not create a primitive descriptor" on every call)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    x, w = torch.ones(2, 16, dtype=dtype), torch.ones(8, 16, dtype=dtype)
    try:
        with torch.inference_mode():
            onednn_linear(x, w, None)
            packed_linear(x, pack(w), None)
    except RuntimeError as exc:
        logger.debug("oneDNN's %s linear does not run here: %s", dtype, exc)
        return False
    return True


def available_kernels(dtype: torch.dtype, rows: int = 1) -> list[str]:
    """The kernels that can compute a product of `rows` rows at `dtype` here, aten first:
    `small_linear` takes 1-7 rows of float32 or bfloat16, `panel` 2 to PANEL_MAX_ROWS rows of
    float32 (one row streams the weight, where small_linear reads the plain one; more rows run
    aten's GEMM), `upcast` 16-bit weights."""
    ours = native.load()[0]
    return (["aten"] + ["onednn"] * onednn_available(dtype)
            + ["small_linear"] * (ours and dtype != torch.float16 and rows <= SMALL_LINEAR_MAX_ROWS)
            + ["panel"] * (ours and dtype == torch.float32 and 1 < rows <= ops.PANEL_MAX_ROWS)
            + ["upcast"] * (dtype in (torch.bfloat16, torch.float16)))


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a [out, in] weight (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


@dataclass(eq=False)
class PackedWeight:
    """A layer's prepacked weight and the weight (tensor and version) it was packed from, by
    `packer` (oneDNN's `pack` where None, or `ops.panel_pack`).

    oneDNN's copy is packed at the layer's second call of more than one row, not when the
    router is installed: a lone request (one prompt step, then one-row steps, which read the
    plain weight) never pays for the copies. Its first multi-row call runs oneDNN on the plain
    weight: the same products, bit for bit. The panel kernel has no such call on the plain
    weight (`panel`: unpacked_calls 0): it packs at the first."""

    weight: torch.Tensor | None
    version: int
    packed: torch.Tensor | None
    unpacked_calls: int = 1  # multi-row calls still to run on the plain weight
    packer: Callable[[torch.Tensor], torch.Tensor] | None = None  # None: oneDNN's `pack`

    @classmethod
    def panel(cls) -> "PackedWeight":
        return cls(None, -1, None, 0, ops.panel_pack)

    def fresh(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of `weight` as it is now (None while deferred): packed again if it
        was replaced or updated in place (an optimizer step, `update_weights`), so a stale copy
        never runs."""
        if self.unpacked_calls > 0:
            self.unpacked_calls -= 1
            return None
        if weight is not self.weight or weight._version != self.version:
            self.weight, self.version, self.packed = weight, weight._version, (self.packer or pack)(weight)
        return self.packed

    # A copy of the model made while a manager runs (a frozen reference policy, a pickled
    # checkpoint) cannot copy oneDNN's opaque tensor: it gets an empty one, packed on first use.
    def __deepcopy__(self, memo) -> "PackedWeight":
        return PackedWeight(None, -1, None, 0, self.packer)

    def __reduce__(self):
        return (PackedWeight, (None, -1, None, 0, self.packer))


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A bfloat16 or float16 product in float32, on oneDNN where it runs, else aten. A large
    weight is converted UPCAST_SLICE elements (whole output features) at a time, so no copy of
    the whole weight in float32 is ever made."""
    rows = x.reshape(-1, x.shape[-1]).float()
    matmul = onednn_linear if onednn_available(torch.float32) else torch.nn.functional.linear
    step = max(1, UPCAST_SLICE // weight.shape[1])
    if weight.shape[0] <= step:
        out = matmul(rows, weight.float(), None if bias is None else bias.float()).to(x.dtype)
    else:
        out = rows.new_empty(rows.shape[0], weight.shape[0], dtype=x.dtype)
        for start in range(0, weight.shape[0], step):
            part = slice(start, start + step)
            out[:, part] = matmul(rows, weight[part].float(), None if bias is None else bias[part].float())
    return out.view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("contbatch::upcast_linear", mutates_args=())
def _upcast_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return upcast_linear(x, weight, bias)


@torch.library.custom_op("contbatch::onednn_linear", mutates_args=())
def _onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return onednn_linear(x, weight, bias)


@_onednn_linear_op.register_fake
@_upcast_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
