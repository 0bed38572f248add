"""Rotary embeddings as one C++ call per layer inside engine steps (`ops.fused_rotary`).

transformers applies rotary embeddings with a module-level function of each modeling file,
`apply_rotary_pos_emb(q, k, cos, sin)`, which attention classes call through their modeling
file's globals. So routing means replacing the global: with one wrapper per original (Dynamo
guards on its identity, so a compiled step survives a second manager), counted across
managers and put back by the last one. The wrapper calls the fused op only inside an engine
step, outside compiled steps, and only for the plain call shape (no extra arguments, q/k
`[B, H, T, D]`, cos/sin `[B, T, D]` of the full head dim: partial-rotary models fall through
to the original). A modeling file is routed only after its function matched the fused op bit
for bit at start-up, on random rows of the model's head dim and dtype.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import native, ops
from ... import context
from .base import Router

KERNELS = ("auto", "off")
FUNCTION = "apply_rotary_pos_emb"
DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class RotaryPlan:
    kernel: str  # what the user asked: auto or aten
    modules: tuple[str, ...]  # modeling files whose apply_rotary_pos_emb runs fused in steps
    summary: str


def _calls_function(cls: type) -> bool:
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    return code is not None and FUNCTION in code.co_names


def _sites(model: torch.nn.Module) -> dict[str, int]:
    """{modeling module name: head dim} for attention classes calling the module's function."""
    sites: dict[str, int] = {}
    for m in model.modules():
        cls = type(m)
        head_dim = getattr(m, "head_dim", None)
        if isinstance(head_dim, int) and head_dim % 2 == 0 and _calls_function(cls):
            if callable(getattr(sys.modules.get(cls.__module__), FUNCTION, None)):
                sites.setdefault(cls.__module__, head_dim)
    return sites


def _plain_call(q, k, cos, sin) -> bool:
    return (q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and sin.shape == cos.shape
            and cos.shape[-1] == q.shape[-1] == k.shape[-1] and cos.shape[0] == q.shape[0] == k.shape[0]
            and cos.shape[1] == q.shape[2] == k.shape[2] and q.dtype in DTYPES
            and q.dtype == k.dtype == cos.dtype == sin.dtype and q.device.type == "cpu"
            and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1)


def _matches(function: Callable, head_dim: int, dtype: torch.dtype) -> tuple[bool, str]:
    """The modeling file's own function against the fused op, as a step calls it."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 4, head_dim, generator=gen).to(dtype).transpose(1, 2)  # [B, H, T, D] view, as models make it
    k = torch.randn(1, 5, 2, head_dim, generator=gen).to(dtype).transpose(1, 2)
    angles = torch.rand(1, 5, head_dim // 2, generator=gen) * 40
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    with torch.inference_mode():
        try:
            want = function(q, k, cos, sin)
        except Exception as exc:
            return False, f"its function ({type(exc).__name__})"
        got = ops.fused_rotary(q, k, cos, sin)
    if not (isinstance(want, tuple) and len(want) == 2 and all(isinstance(t, torch.Tensor) for t in want)):
        return False, "it returns something else"
    for w, g in zip(want, got):
        if w.shape != g.shape or w.dtype != g.dtype or not torch.equal(w, g):
            diff = (w.float() - g.float()).abs().max().item() if w.shape == g.shape else float("nan")
            return False, f"max difference {diff:.1e}"
    return True, "bit-identical"


def plan_rotary(model: torch.nn.Module, kernel: str = "auto") -> RotaryPlan:
    if kernel not in KERNELS:
        raise ValueError(f"the rotary kernel must be one of {KERNELS}, got {kernel!r}")
    sites = _sites(model)
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    if kernel == "off" or not sites or dtype not in DTYPES:
        why = "as asked" if kernel == "off" else "no float32/bfloat16 attention calling apply_rotary_pos_emb"
        return RotaryPlan(kernel, (), f"aten ({why})")
    ok, how = native.load()
    if not ok:
        return RotaryPlan(kernel, (), f"aten (C++ kernels {how})")
    routed, refused = [], []
    for name, head_dim in sorted(sites.items()):
        function = _Wrappers.original(getattr(sys.modules[name], FUNCTION))
        same, why = _matches(function, head_dim, dtype)
        (routed if same else refused).append(name if same else f"{name} ({why})")
    short = [n.rsplit(".", 1)[-1] for n in routed]
    summary = (f"fused in {', '.join(short)} (bit-identical at start-up)" if routed else "off") + (
        f"; left to PyTorch: {', '.join(refused)}" if refused else "")
    return RotaryPlan(kernel, tuple(routed), summary)


class _Wrappers:
    """One wrapper per original function, installed while any manager needs it. A wrapper asks
    the step context of the router that made it: one engine, one context, per process."""

    lock = threading.Lock()
    by_original: dict[Callable, Callable] = {}
    users: dict[str, int] = {}

    @classmethod
    def original(cls, function: Callable) -> Callable:
        return getattr(function, "_contbatch_original", function)

    @classmethod
    def wrapper(cls, original: Callable, in_step: Callable[[], bool]) -> Callable:
        if original not in cls.by_original:
            def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
                if (not args and not kwargs and not torch.compiler.is_compiling() and in_step()
                        and _plain_call(q, k, cos, sin)):
                    return ops.fused_rotary(q, k, cos, sin)
                return original(q, k, cos, sin, *args, **kwargs)

            apply_rotary_pos_emb._contbatch_original = original
            apply_rotary_pos_emb.__doc__ = original.__doc__
            cls.by_original[original] = apply_rotary_pos_emb
        return cls.by_original[original]


class RotaryRouter(Router):
    """Installs the plan's wrappers for the life of a manager, and takes them back."""

    def __init__(self, plan: RotaryPlan) -> None:
        self.plan = plan
        self.installed: list[str] = []

    def install(self) -> None:
        if self.installed:
            return
        with _Wrappers.lock:
            for name in self.plan.modules:
                module = sys.modules[name]
                current = getattr(module, FUNCTION)
                setattr(module, FUNCTION, _Wrappers.wrapper(_Wrappers.original(current), context.in_step))
                _Wrappers.users[name] = _Wrappers.users.get(name, 0) + 1
                self.installed.append(name)

    def uninstall(self) -> None:
        with _Wrappers.lock:
            for name in self.installed:
                _Wrappers.users[name] -= 1
                module = sys.modules[name]
                current = getattr(module, FUNCTION)
                if _Wrappers.users[name] == 0 and getattr(current, "_contbatch_original", None) is not None:
                    setattr(module, FUNCTION, current._contbatch_original)
            self.installed = []
