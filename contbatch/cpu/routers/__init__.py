"""A model's CPU kernel routers, together (`CpuRouters`): its linear layers, RMSNorms, rotary
embeddings and decoder layers on the kernels its `CpuPlan` chose, installed for the life of a
manager and taken back at its stop, the decoder layers last (their one call runs the others'
kernels). The manager does this for the target model, the draft proposer for a
draft model's own plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import Router
from .layer import LayerRouter
from .linear import LinearRouter
from .norm import NormRouter
from .rotary import RotaryRouter

if TYPE_CHECKING:
    from ..plan import CpuPlan

__all__ = ["CpuRouters", "LayerRouter", "LinearRouter", "NormRouter", "RotaryRouter", "Router"]


class CpuRouters(Router):
    def __init__(self, model: torch.nn.Module, plan: CpuPlan | None) -> None:
        self.routers: list[Router] = []
        if plan is None:
            return
        self.routers.append(LinearRouter(model, plan.linear))
        if plan.norm is not None:
            self.routers.append(NormRouter(model, plan.norm))
        if plan.rotary is not None:
            self.routers.append(RotaryRouter(plan.rotary))
        if plan.layer is not None:
            self.routers.append(LayerRouter(model, plan.layer, plan.linear))

    def install(self) -> None:
        for router in self.routers:
            router.install()

    def uninstall(self) -> None:
        for router in self.routers:
            router.uninstall()
