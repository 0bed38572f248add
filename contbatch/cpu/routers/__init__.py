"""A model's CPU kernel routers, together (`CpuRouters`): its linear layers, RMSNorms, rotary
embeddings and decoder layers on the kernels its `CpuPlan` chose, installed for the life of a
manager and taken back at its stop, the decoder layers last (their one call runs the others'
kernels). Installing first moves the weights a decode step streams onto 2 MiB pages where the
plan says so (`weight_pages.py`; once per model: they stay there after the stop), and sets the
few-row kernels' prefetch settings the plan measured (`prefetch.py`; the process's, put back at
the stop). The manager does this for the target model, the draft proposer for a draft model's
own plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import weight_pages
from .base import Router
from .layer import LayerRouter
from .linear import LinearRouter, one_row_weights
from .norm import NormRouter
from .rotary import RotaryRouter

if TYPE_CHECKING:
    from ..plan import CpuPlan

__all__ = ["CpuRouters", "LayerRouter", "LinearRouter", "NormRouter", "RotaryRouter", "Router"]


class CpuRouters(Router):
    def __init__(self, model: torch.nn.Module, plan: CpuPlan | None) -> None:
        self.routers: list[Router] = []
        self.model, self.plan = model, plan
        self._prefetch_before: dict[str, tuple[int, int]] = {}
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
        if self.plan is not None and self.plan.pages is not None and self.plan.pages.move:
            weights = weight_pages.decode_weights(self.model, one_row_weights(self.model, self.plan.linear))
            weight_pages.move_to_huge_pages(weights, self.model)
        if self.plan is not None and self.plan.prefetch is not None:
            self._prefetch_before = self.plan.prefetch.apply()
        for router in self.routers:
            router.install()

    def uninstall(self) -> None:
        for router in self.routers:
            router.uninstall()
        if self.plan is not None and self.plan.prefetch is not None:
            self.plan.prefetch.restore(self._prefetch_before)
