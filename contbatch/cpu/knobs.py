"""What the user asks of the CPU kernels: one knob and a mapping of per-kernel overrides.

`cpu_kernels="auto"` lets every kernel decide by itself (by start-up measurement or a start-up
comparison with the module it replaces); `"off"` keeps PyTorch's own ops everywhere.
`cpu_kernel_overrides` changes single kernels on top of either, for A/B work:

- `linear`: `"auto"`, `"aten"` (PyTorch's `F.linear`), `"onednn"`, `"small_linear"` (our few-row
  kernel), `"panel"` (our float32 batch kernel on panel-packed weights) or `"upcast"` (the
  linear router);
- `linear_prepack`: `True` or `False` (layers on oneDNN or panel keep a packed copy of their
  weight; without copies `panel` is not used);
- `norm`: `"auto"` or `"off"` (the fused RMSNorm, or the module's own forward);
- `rotary`: `"auto"` or `"off"` (the fused rotary embedding);
- `layer`: `"auto"`, `"layer"` or `"off"` (decoder layers as one call; `"layer"`: no stack);
- `prefill`: `"auto"` or `"off"` (prompt chunks' attention in our kernel, or SDPA);
- `prefetch`: `"auto"`, `"l1"`, `"l2"` or `"none"` (how the few-row kernels ask for their
  weight and K/V streams ahead: measured per machine, into L1, into L2, never; `prefetch.py`).

"off" always means "not ours: PyTorch's own code"; `"aten"` is one of the linear kernels the
router chooses between.

This module is standard library only: the config validates against it when it is built.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields

logger = logging.getLogger("contbatch")

CPU_KERNELS = ("auto", "off")
LINEAR_KERNELS = ("auto", "aten", "onednn", "small_linear", "panel", "upcast")
OVERRIDES: dict[str, tuple] = {
    "linear": LINEAR_KERNELS,
    "linear_prepack": (True, False),
    "norm": ("auto", "off"),
    "rotary": ("auto", "off"),
    "layer": ("auto", "layer", "off"),
    "prefill": ("auto", "off"),
    "prefetch": ("auto", "l1", "l2", "none"),
}
# The kernels put on a model's modules (the routers), as opposed to the attention's prefill
# kernel, which the attention backend runs.
ROUTERS = ("linear", "norm", "rotary", "layer")
OFF_ROUTERS = {"linear": "aten", "norm": "off", "rotary": "off", "layer": "off"}  # PyTorch's own code
# Config fields of earlier versions, one per override; accepted as keywords, with a warning.
DEPRECATED_FIELDS: dict[str, str] = {
    "cpu_linear_kernel": "linear",
    "cpu_linear_prepack": "linear_prepack",
    "cpu_rms_norm_kernel": "norm",
    "cpu_rotary_kernel": "rotary",
    "cpu_layer_kernel": "layer",
    "cpu_prefill_kernel": "prefill",
}
# Values those fields took that are spelled differently now.
DEPRECATED_VALUES: dict[tuple[str, object], object] = {
    **{(key, "aten"): "off" for key in ("norm", "rotary", "layer", "prefill")},
    ("linear", "native"): "small_linear",
}


def check(cpu_kernels: object, overrides: object) -> dict[str, object] | None:
    """Raises ValueError for a value the knobs do not take; returns the overrides as a new dict
    (None stays None)."""
    if cpu_kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels must be one of {CPU_KERNELS}, got {cpu_kernels!r}")
    if overrides is None:
        return None
    if not isinstance(overrides, Mapping):
        raise ValueError(f"cpu_kernel_overrides must be a mapping of kernel to choice, got {overrides!r}")
    for key, value in overrides.items():
        allowed = OVERRIDES.get(key)
        if allowed is None:
            raise ValueError(f"cpu_kernel_overrides has no key {key!r}; its keys: {', '.join(OVERRIDES)}")
        # `1 in (True, False)` holds in Python: a boolean knob takes booleans only.
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise ValueError(f"cpu_kernel_overrides[{key!r}] must be one of {allowed}, got {value!r}")
    return dict(overrides)


def merge_deprecated(overrides: Mapping | None, old: Mapping[str, object]) -> dict[str, object]:
    """`overrides` with the deprecated config fields in `old` mapped in, one warning each. A
    field and an override of the same kernel that disagree are a ValueError."""
    merged = dict(overrides or {})
    for name, value in old.items():
        key = DEPRECATED_FIELDS[name]
        value = DEPRECATED_VALUES.get((key, value), value)
        message = (f"ContinuousBatchingConfig({name}=...) is deprecated and will be removed in the next release; "
                   f"use cpu_kernel_overrides={{{key!r}: {value!r}}}")
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        logger.warning("contbatch: %s", message)
        if key in merged and merged[key] != value:
            raise ValueError(f"{name}={value!r} contradicts cpu_kernel_overrides[{key!r}]={merged[key]!r}")
        merged[key] = value
    return merged


def without_routers(overrides: Mapping | None) -> dict[str, object]:
    """`overrides` with every router on PyTorch's own ops (`ROUTERS`), the prefill kernel as
    asked: what a tensor-parallel rank runs (the routers time and check kernels on one
    process's weights, and a rank holds a shard)."""
    return {**(overrides or {}), **OFF_ROUTERS}


@dataclass(frozen=True)
class CpuKnobs:
    """The choice in force for each kernel: `mode`'s default, or the override."""

    mode: str = "auto"  # cpu_kernels
    linear: str = "auto"
    linear_prepack: bool = True
    norm: str = "auto"
    rotary: str = "auto"
    layer: str = "auto"
    prefill: str = "auto"
    prefetch: str = "auto"

    @classmethod
    def from_config(cls, cpu_kernels: str, overrides: Mapping | None = None) -> "CpuKnobs":
        base = {} if cpu_kernels == "auto" else {**OFF_ROUTERS, "prefill": "off"}
        return cls(mode=cpu_kernels, **{**base, **(overrides or {})})

    def describe(self) -> str:
        """The mode, and the kernels whose choice is not the mode's default."""
        default = CpuKnobs.from_config(self.mode)
        changed = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                   if getattr(self, f.name) != getattr(default, f.name)]
        return self.mode + (f" ({', '.join(changed)})" if changed else "")
