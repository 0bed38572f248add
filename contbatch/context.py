"""The step in flight: the one place contbatch keeps a step's state outside the model's kwargs.

A step's `StepMetadata` reaches every attention call as the `step_metadata` keyword of the
model's forward (transformers passes it down untouched). Two cases need more, and find it
here:
- layers that drop `**kwargs` on the way down lose the keyword: paged attention, and our CPU
  routers, which must tell an engine step from the user's own forward on the same model, ask
  `active_step()` / `in_step()`: the step the engine thread is running (a thread-local, so a
  forward on any other thread is never taken for a step);
- a compiled step cannot carry the metadata (not a tensor) nor read a thread-local while
  Dynamo traces it: its forward passes `COMPILED_STEP` as the keyword (a constant Dynamo
  guards on by identity), paged attention's opaque op takes the metadata from `active_step()`
  at run time, and `in_compiled_step()` (a class attribute, which Dynamo reads and guards on)
  tells routed layers traced then to emit their opaque ops.

`running(meta, compiled=...)` sets both for the length of one forward; the runner
(`runtime/step_runner.py`) is its only caller. A leaf module: `cpu/` and `attention/` read it,
and it imports nothing of contbatch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# The keyword value a compiled forward passes instead of the metadata.
COMPILED_STEP = "contbatch-compiled-step"

_local = threading.local()


class _Compiled:
    active = False  # a compiled step is running (or being traced): Dynamo guards on it


def active_step() -> Any:
    """The `StepMetadata` of the step this thread is running, or None outside an engine forward."""
    return getattr(_local, "meta", None)


def in_step() -> bool:
    return getattr(_local, "meta", None) is not None


def in_compiled_step() -> bool:
    return _Compiled.active


@contextmanager
def running(meta: Any, compiled: bool = False) -> Iterator[None]:
    """This thread runs the step `meta` (compiled, or eager) until the block ends."""
    _local.meta = meta
    _Compiled.active = compiled
    try:
        yield
    finally:
        _local.meta = None
        _Compiled.active = False
