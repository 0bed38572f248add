"""RMSNorm layers as one C++ call each inside engine steps (`ops.fused_rms_norm`).

Norm classes differ where it matters (Gemma scales by `1 + weight`, some norms skip the cast),
and their names do not say so. So a class is routed only after its own forward was compared
with the fused op, at start-up, on one of its modules with that module's weight and random
rows: equal within rounding (TOLERANCE), or left alone (the start-up line says which classes
were refused). Only calls inside an engine step with the plain call shape (the hidden states
alone) are routed; compiled steps trace the original (Inductor fuses it there).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from .. import native, ops
from ... import context
from .base import Router

KERNELS = ("auto", "off")
DTYPES = (torch.float32, torch.bfloat16)
# Relative tolerance of the start-up comparison: float32 differs only in the order the squares
# are summed; a bfloat16 output may land one rounding step (2^-8 relative) apart.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


@dataclass(frozen=True)
class NormPlan:
    kernel: str  # what the user asked: auto or aten
    classes: tuple[str, ...]  # norm classes routed to the fused op
    summary: str


def eps_of(m: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(m, name, None)
        if isinstance(value, float):
            return value
    return None


def _candidates(model: torch.nn.Module) -> list[torch.nn.Module]:
    found = []
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if (type(m).__name__.endswith("RMSNorm") and isinstance(weight, torch.nn.Parameter) and weight.dim() == 1
                and weight.dtype in DTYPES and weight.device.type == "cpu" and eps_of(m) is not None
                and "forward" not in m.__dict__):
            found.append(m)
    return found


def _matches(m: torch.nn.Module) -> tuple[bool, str]:
    """The module's own forward against the fused op on random rows, with its own weight."""
    dtype = m.weight.dtype
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, m.weight.numel(), generator=gen) * 3).to(dtype)
    with torch.inference_mode():
        try:
            want = type(m).forward(m, x)
        except Exception as exc:  # a forward that wants more than the rows
            return False, f"its forward({type(exc).__name__})"
        got = ops.fused_rms_norm(x, m.weight, eps_of(m))
    if not isinstance(want, torch.Tensor) or want.dtype != got.dtype or want.shape != got.shape:
        return False, "output type or shape differs"
    err = ((want.float() - got.float()).abs() / want.float().abs().clamp_min(1e-6)).max().item()
    return err <= TOLERANCE[dtype], f"max relative difference {err:.1e}"


def plan_norm(model: torch.nn.Module, kernel: str = "auto") -> NormPlan:
    if kernel not in KERNELS:
        raise ValueError(f"the norm kernel must be one of {KERNELS}, got {kernel!r}")
    layers = _candidates(model)
    if kernel == "off" or not layers:
        why = "as asked" if kernel == "off" else "no float32/bfloat16 RMSNorm on the CPU"
        return NormPlan(kernel, (), f"aten ({why})")
    ok, how = native.load()
    if not ok:
        return NormPlan(kernel, (), f"aten (C++ kernels {how})")
    routed, refused = [], []
    for name in sorted({type(m).__name__ for m in layers}):
        first = next(m for m in layers if type(m).__name__ == name)
        same, why = _matches(first)
        (routed if same else refused).append(name if same else f"{name} ({why})")
    count = sum(type(m).__name__ in routed for m in layers)
    summary = (f"fused for {count} modules of {', '.join(routed)}" if routed else "off") + (
        f"; left to PyTorch: {', '.join(refused)}" if refused else "")
    return NormPlan(kernel, tuple(routed), summary)


def _routed_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if (not args and not kwargs and not torch.compiler.is_compiling() and self._contbatch_in_step()
            and hidden_states.dtype == self.weight.dtype):
        return ops.fused_rms_norm(hidden_states, self.weight, self._contbatch_eps)
    return type(self).forward(self, hidden_states, *args, **kwargs)


ATTRIBUTES = ("forward", "_contbatch_eps", "_contbatch_in_step")


class NormRouter(Router):
    """Installs the plan on a model's norms for the life of a manager, and takes it back."""

    def __init__(self, model: torch.nn.Module, plan: NormPlan) -> None:
        self.model = model
        self.plan = plan
        self.modules: list[torch.nn.Module] = []

    def install(self) -> None:
        if not self.plan.classes or self.modules:
            return
        for m in _candidates(self.model):
            if type(m).__name__ in self.plan.classes:
                m._contbatch_eps = eps_of(m)
                m._contbatch_in_step = context.in_step
                m.forward = types.MethodType(_routed_forward, m)
                self.modules.append(m)

    def uninstall(self) -> None:
        for m in self.modules:
            for attr in ATTRIBUTES:
                m.__dict__.pop(attr, None)
        self.modules = []
