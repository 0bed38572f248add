"""A strict CPU stand-in for CUDA-graph capture: host syncs and host-to-device copies raise.

A CUDA graph records device work only. Inside a capture, anything that makes the host wait for
the device (`.item()`, `.tolist()`, `int(t)`, `bool(t)`, `nonzero`, boolean-mask indexing,
`.cpu()`, an explicit `synchronize`) fails on a GPU, or worse, bakes a stale value into every
replay; so does building a tensor from Python data or numpy (`torch.tensor(...)` copies from
the host each time it runs, but a replay does not run Python). The eager stand-in used on the
CPU (`contbatch.runtime.graphs.eager_capture`) would let all of these pass, so a graph that
breaks on the first GPU would pass every CPU test.

`guarded_capture` has `eager_capture`'s contract and marks the running thread as "inside a
captured region" while the captured forward runs, at capture and at every replay. While the
guard is installed (`forbid_host_syncs()`, a context manager), every forbidden call made on
that thread raises `HostSyncInCapture`; on other threads and outside the region the calls behave as usual.

On the CPU the "device" and the host are the same memory, so a host-to-device copy is defined
here as creating or copying a tensor from Python data or numpy inside the region
(`torch.tensor`, `torch.as_tensor`, `torch.from_numpy`), plus explicit `.cpu()`, `.numpy()`
and `.to("cpu")` (the host spelled out as a string; `.to(device=x.device)` names the tensor's
own device and is a no-op on a GPU too); `Tensor.to(device)` and `Tensor.copy_` from a CPU
tensor to another device raise too (testable on the CPU with the `meta` device).

This is a test helper: it patches torch for the duration of `forbid_host_syncs()` only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_state = threading.local()

# Tensor methods that read device memory on the host (or hand it to numpy).
TENSOR_HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "cpu", "numpy")
# torch functions that build a tensor from host data (a host-to-device copy on a GPU), or sync.
TORCH_HOST_FUNCTIONS = ("tensor", "as_tensor", "from_numpy", "nonzero")


class HostSyncInCapture(RuntimeError):
    """A host sync or host-to-device copy inside a captured region: it would fail on a GPU."""


def inside() -> bool:
    """True on a thread that is running a captured region right now."""
    return getattr(_state, "depth", 0) > 0 and not getattr(_state, "suspended", False)


@contextmanager
def captured_region() -> Iterator[None]:
    """Mark the current thread as inside a captured region (nestable)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


@contextmanager
def suspended() -> Iterator[None]:
    """Lift the guard on this thread for test instrumentation that runs inside a region (an
    assertion of a test's stand-in kernel) but is not part of what a real graph would record."""
    saved = getattr(_state, "suspended", False)
    _state.suspended = True
    try:
        yield
    finally:
        _state.suspended = saved


def opaque(fn: Callable) -> Callable:
    """`fn` run as one device operation: the guard is lifted inside it. For the CPU stand-ins of
    device kernels (the PyTorch reference kernels, a test's fake flash-attn), whose own host
    reads emulate what a real kernel does on the device; the code around the call stays guarded."""

    def run_opaque(*args, **kwargs):
        with suspended():
            return fn(*args, **kwargs)

    return run_opaque


def _refuse(what: str) -> None:
    raise HostSyncInCapture(f"{what} inside a captured region (a host sync or host-to-device copy)")


def _has_bool_mask(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _is_cpu(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def guarded_capture(run: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
    """`eager_capture` with the captured forward run inside a guarded region, at capture and at
    every replay; the copy into the fixed output happens outside it, as a replay's would."""

    def captured() -> torch.Tensor:
        with captured_region():
            return run()

    output = captured()

    def replay() -> None:
        output.copy_(captured())

    return replay, output


def _guard_tensor_method(name: str, original: Callable) -> Callable:
    def guarded(self, *args, **kwargs):
        if inside():
            _refuse(f"Tensor.{name}()")
        return original(self, *args, **kwargs)

    return guarded


def _guard_torch_function(name: str, original: Callable) -> Callable:
    def guarded(*args, **kwargs):
        if inside():
            _refuse(f"torch.{name}()")
        return original(*args, **kwargs)

    return guarded


def _guarded_getitem(original: Callable) -> Callable:
    def __getitem__(self, index):
        if inside() and _has_bool_mask(index):
            _refuse("boolean-mask indexing (Tensor.__getitem__ with a bool tensor)")
        return original(self, index)

    return __getitem__


def _guarded_to(original: Callable) -> Callable:
    def to(self, *args, **kwargs):
        if inside():
            named = kwargs.get("device", args[0] if args else None)
            if isinstance(named, str) and _is_cpu(named):  # spelled out: always the host, on a GPU too
                _refuse(f"Tensor.to({named!r})")
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if device is not None and self.device.type == "cpu" and not _is_cpu(device):
                _refuse(f"Tensor.to({device}) from a CPU tensor")
        return original(self, *args, **kwargs)

    return to


def _guarded_copy(original: Callable) -> Callable:
    def copy_(self, src, *args, **kwargs):
        if inside() and isinstance(src, torch.Tensor) and src.device.type == "cpu" and self.device.type != "cpu":
            _refuse(f"Tensor.copy_ from a CPU tensor to {self.device}")
        return original(self, src, *args, **kwargs)

    return copy_


def _guard_sync(what: str, original: Callable) -> Callable:
    def synchronize(*args, **kwargs):
        if inside():
            _refuse(what)
        return original(*args, **kwargs)

    return synchronize


def _patches() -> list[tuple[Any, str, Callable]]:
    """(owner, attribute, replacement) for everything the guard forbids."""
    out: list[tuple[Any, str, Callable]] = []
    for name in TENSOR_HOST_READS:
        out.append((torch.Tensor, name, _guard_tensor_method(name, getattr(torch.Tensor, name))))
    for name in TORCH_HOST_FUNCTIONS:
        out.append((torch, name, _guard_torch_function(name, getattr(torch, name))))
    out.append((torch.Tensor, "__getitem__", _guarded_getitem(torch.Tensor.__getitem__)))
    out.append((torch.Tensor, "to", _guarded_to(torch.Tensor.to)))
    out.append((torch.Tensor, "copy_", _guarded_copy(torch.Tensor.copy_)))
    cuda = torch.cuda
    if hasattr(cuda, "synchronize"):
        out.append((cuda, "synchronize", _guard_sync("torch.cuda.synchronize()", cuda.synchronize)))
    for cls_name in ("Stream", "Event"):
        cls = getattr(cuda, cls_name, None)
        if cls is not None and hasattr(cls, "synchronize"):
            out.append((cls, "synchronize", _guard_sync(f"torch.cuda.{cls_name}.synchronize()", cls.synchronize)))
    return out


@contextmanager
def forbid_host_syncs() -> Iterator[None]:
    """Install the guard for the duration of the block; everything is restored after it."""
    saved = []
    try:
        for owner, name, replacement in _patches():
            saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


_MISSING = object()
