"""Commands that change the running engine: pause, resume, reset the prefix cache, new weights.

Callable from any thread. Each travels through the manager's inbox as a control command
(`CONTROL`), runs on the engine thread between two steps, and its caller waits for the
answer; with no engine thread (never started, or stopped) it runs at once in the caller's
thread, and from the engine thread itself (a result handler) at once too. Kept apart from
`manager.py`, which owns the thread, the submission path and the results.
"""

from __future__ import annotations

import logging
import threading

from .weights import check_inflight, copy_weights, weight_pairs

logger = logging.getLogger("contbatch")

CONTROL = ("pause", "resume", "reset_prefix_cache", "weights")  # inbox commands a caller waits on


class EngineControl:
    """The manager's control surface (mixed into `ContinuousBatchingManager`, whose state it
    uses: `core`, `model`, `_inbox`, `_thread`, `_paused`, `tensor_parallel`)."""

    @property
    def weight_version(self) -> int:
        return self.core.weight_version if self.core else 0

    def is_paused(self) -> bool:
        return self._paused

    def pause(self, timeout: float | None = None) -> None:
        """Stop scheduling steps once the step in flight is done; requests keep their KV and
        new ones wait. Returns when the engine is idle. Idempotent."""
        self._control("pause", None, timeout)

    def resume(self, timeout: float | None = None) -> None:
        self._control("resume", None, timeout)

    def reset_prefix_cache(self, timeout: float | None = None) -> int:
        """Forget every cached prefix; returns the blocks that went back to the free pool."""
        return self._control("reset_prefix_cache", None, timeout)

    def update_weights(self, weights=None, *, inflight: str = "recompute", timeout: float | None = None) -> int:
        """Copy new weights into the attached model, in place, and make the engine consistent
        with them; returns the new `weight_version`.

        `weights`: a state dict or `(name, tensor)` pairs (checked before any copy), or None
        when the caller already changed the model's parameters (an optimizer step on the same
        model object). Every cached prefix is dropped. Requests in flight are recomputed with
        the new weights (`"recompute"`: their tokens so far stay), keep their KV (`"keep"`:
        later tokens use the new weights) or end cancelled (`"abort"`); their outputs list
        the version of each token in `weight_versions`."""
        check_inflight(inflight)
        if self.tensor_parallel is not None:
            raise RuntimeError("update_weights() is not supported under tensor parallelism yet (each rank holds a "
                               "shard of every weight)")
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeError("update_weights() cannot run in a result handler (the engine thread is mid-step): "
                               "call pause() there and update from another thread")
        pairs = weight_pairs(self.model, weights) if weights is not None else []
        was_paused = self._paused
        self.pause(timeout)
        try:
            copy_weights(pairs)
            result = self._control("weights", inflight, timeout)
        finally:
            if not was_paused:
                self.resume(timeout)
        logger.info("contbatch: weights updated to version %d (%d tensors; %d requests in flight: %s; %d cached "
                    "blocks freed)", result["weight_version"], len(pairs), result["requests"], inflight,
                    result["freed_cached_blocks"])
        return result["weight_version"]

    def _control(self, kind: str, payload, timeout: float | None):
        """Run a control command on the engine thread (or here, when no thread runs) and
        wait for it. From the engine thread itself (a result handler) it runs at once."""
        if self.core is None:
            raise RuntimeError("this manager was destroyed")
        self._check_driver(kind)
        if not self.is_running() or threading.current_thread() is self._thread:
            return self._do_control(kind, payload)
        done, box = threading.Event(), {}
        self._inbox.put((kind, (payload, done, box)))
        if not done.wait(timeout):
            raise TimeoutError(f"the engine did not {kind.replace('_', ' ')} within {timeout} s")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def _do_control(self, kind: str, payload):
        if kind == "pause":
            self.core.flush()
            self._paused = True
        elif kind == "resume":
            self._paused = False
        elif kind == "reset_prefix_cache":
            return self.core.reset_prefix_cache()
        elif kind == "weights":
            return self.core.weights_changed(payload)
        return None
