"""A model's CPU kernel routers, together: its linear layers, RMSNorms and rotary embeddings on
the kernels chosen at start-up (`cpu_linear.py`, `cpu_norm.py`, `cpu_rotary.py`), installed for
the life of a manager and taken back at its stop. The manager does this for the target model,
the draft proposer for a draft model's own plans."""

from __future__ import annotations

import torch

from .cpu_linear import LinearPlan, LinearRouter
from .cpu_norm import NormPlan, NormRouter
from .cpu_rotary import RotaryPlan, RotaryRouter


class CpuRouters:
    def __init__(self, model: torch.nn.Module, linear: LinearPlan | None, norm: NormPlan | None,
                 rotary: RotaryPlan | None) -> None:
        self.routers = ([LinearRouter(model, linear)] if linear is not None else []) + (
            [NormRouter(model, norm)] if norm is not None else []) + ([RotaryRouter(rotary)] if rotary is not None else [])

    def install(self) -> None:
        for router in self.routers:
            router.install()

    def uninstall(self) -> None:
        for router in self.routers:
            router.uninstall()
