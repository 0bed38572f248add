"""A model's CPU kernel routers, together: its linear layers, RMSNorms, rotary embeddings and
decoder layers on the kernels chosen at start-up (`cpu_linear.py`, `cpu_norm.py`, `cpu_rotary.py`,
`cpu_layer.py`; the layers last, since their one call runs the others' kernels), installed for
the life of a manager and taken back at its stop. The manager does this for the target model,
the draft proposer for a draft model's own plans."""

from __future__ import annotations

import torch

from .cpu_layer import LayerPlan, LayerRouter
from .cpu_linear import LinearPlan, LinearRouter
from .cpu_norm import NormPlan, NormRouter
from .cpu_rotary import RotaryPlan, RotaryRouter


class CpuRouters:
    def __init__(self, model: torch.nn.Module, linear: LinearPlan | None, norm: NormPlan | None,
                 rotary: RotaryPlan | None, layer: LayerPlan | None = None) -> None:
        self.routers = ([LinearRouter(model, linear)] if linear is not None else []) + (
            [NormRouter(model, norm)] if norm is not None else []) + ([RotaryRouter(rotary)] if rotary is not None else [])
        if layer is not None:
            self.routers.append(LayerRouter(model, layer, linear))

    def install(self) -> None:
        for router in self.routers:
            router.install()

    def uninstall(self) -> None:
        for router in self.routers:
            router.uninstall()
