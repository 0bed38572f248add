"""Which CPU kernels run for one model: `plan_cpu` decides, once, and gives one `CpuPlan`.

The resolver plans the target model with the user's knobs (`knobs.CpuKnobs`); the draft model
of speculative decoding is planned with the target's plan's knobs; a tensor-parallel rank plans
with its routers off (`knobs.without_routers`). The plan is pure data (JSON in
`resolved_config.as_dict()`); `routers.CpuRouters` puts it on the model while a manager runs.

The linear plan is made whatever the model's device (it routes only CPU weights, so elsewhere
it says there are none); the norm, rotary and layer plans only for a model on the CPU. The
layer plan comes last: a layer runs as one call only where its norms, rotary and linears
already run on our kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import native
from .knobs import CpuKnobs
from .prefetch import PrefetchPlan, plan_prefetch
from .quant.linear import QuantLinear
from .routers.layer import LayerPlan, plan_layer
from .routers.linear import LinearPlan, one_row_weights, plan_linear
from .routers.norm import NormPlan, plan_norm
from .routers.rotary import RotaryPlan, plan_rotary
from .weight_pages import PagesPlan, decode_weights, plan_pages


@dataclass(frozen=True)
class CpuPlan:
    knobs: CpuKnobs  # what was asked
    linear: LinearPlan  # the kernel of each linear weight shape, per row regime
    norm: NormPlan | None = None  # the RMSNorm classes run as one fused call (None: not on the CPU)
    rotary: RotaryPlan | None = None  # the modeling files whose rotary runs as one fused call
    layer: LayerPlan | None = None  # the decoder layers run as one call (None: not on the CPU, or not planned)
    prefill: bool = False  # the torch backend's prompt chunks attend in our C++ kernel (else SDPA)
    pages: PagesPlan | None = None  # the weights a decode step streams, on 2 MiB pages (None: not on the CPU)
    prefetch: PrefetchPlan | None = None  # how few-row kernels ask for their streams ahead (None: not on the CPU)

    def describe(self, prefill: bool = True) -> str:
        """One line for the start-up log; `prefill`: say what the prefill attention runs (on the
        torch backend, the only one with a choice)."""
        parts = [f"prefill_kernel={self.prefill}"] if prefill else []
        parts.append(f"linear: {self.linear.summary}")
        for name, plan in (("rms_norm", self.norm), ("rotary", self.rotary), ("layer", self.layer),
                           ("weights", self.pages), ("prefetch", self.prefetch)):
            if plan is not None:
                parts.append(f"{name}: {plan.summary}")
        return f"cpu_kernels={self.knobs.describe()}: " + "; ".join(parts)


def plan_cpu(model: torch.nn.Module, knobs: CpuKnobs, *, prefill: bool = False, decode_kernel: bool = False,
             eager_paths: Sequence[str] = ("decode", "varlen"), layers: bool = True) -> CpuPlan:
    """The plan for `model` under `knobs`. `prefill`: whether the attention backend runs our
    prefill kernel (its choice, recorded here); `decode_kernel`: whether decode rows take our
    C++ attention; `eager_paths`: the step paths not compiled; `layers=False` plans no fused
    decoder layers (the layers keep their own forward)."""
    linear = plan_linear(model, knobs.linear, knobs.linear_prepack)
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        return CpuPlan(knobs, linear, prefill=prefill)
    one_row = one_row_weights(model, linear)
    pages = plan_pages(decode_weights(model, one_row))
    prefetch = plan_prefetch(stream_kinds(model, one_row, decode_kernel), knobs.prefetch, pages.move)
    norm = plan_norm(model, knobs.norm)
    rotary = plan_rotary(model, knobs.rotary)
    layer = plan_layer(model, knobs.layer, linear, norm, rotary, decode_kernel, eager_paths) if layers else None
    return CpuPlan(knobs, linear, norm, rotary, layer, prefill, pages, prefetch)


def stream_kinds(model: torch.nn.Module, one_row: list[torch.Tensor], decode_kernel: bool) -> tuple[str, ...]:
    """The kinds of stream (`ops.STREAM_KINDS`) our few-row kernels read in `model`'s steps:
    float linears the router may put on `small_linear` (`one_row`), tiled packed ones, and the
    K/V rows of our decode attention (`decode_kernel`)."""
    if not native.load()[0]:
        return ()
    packed = any(isinstance(m, QuantLinear) and m.fmt.tiled for m in model.modules())
    return (*(("float",) if one_row else ()), *(("packed",) if packed else ()), *(("kv",) if decode_kernel else ()))
