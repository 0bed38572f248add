"""Commands that change the running engine: pause, resume, reset the prefix cache, new weights.

Callable from any thread, one at a time: every command takes the manager's admin lock first
(`AdminLock`), so two callers never interleave (a pause sent during an update is applied after
it, and stays). A caller that cannot get the lock within its `wait` gets `AdminBusy`, naming
the command in progress. Each command travels through the manager's inbox (`CONTROL`), runs
on the engine thread between two steps, and its caller waits for the answer; with no engine
thread (never started, or stopped) it runs at once in the caller's thread, and from the engine
thread itself (a result handler) at once too. New weights are copied on the engine thread, in
the same command that makes the engine consistent with them: no step can ever run on partly
copied weights, whatever the pause state or a stop asks meanwhile. Kept apart from
`manager.py`, which owns the thread, the submission path and the results.
"""

from __future__ import annotations

import logging
import threading
import time

from .weights import check_inflight, copy_weights, weight_pairs

logger = logging.getLogger("contbatch")

CONTROL = ("pause", "resume", "reset_prefix_cache", "weights", "adapter")  # inbox commands a caller waits on


class AdminBusy(RuntimeError):
    """Another admin command held the lock for longer than the caller would wait."""

    def __init__(self, operation: str | None, waited: float | None) -> None:
        super().__init__(f"another admin operation ({operation or 'unknown'}) is in progress"
                         + (f" and did not end within {waited:g} s" if waited is not None else ""))
        self.operation = operation


class AdminLock:
    """One admin command at a time. The holder's name is kept for `AdminBusy`'s message. A
    command whose caller stopped waiting (a timeout) is *orphaned*: the engine thread releases
    the lock when that command has run, so the next one never starts on top of it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._guard = threading.Lock()  # orders "the caller gave up" against "the command ended"
        self.operation: str | None = None

    def acquire(self, operation: str, wait: float | None) -> None:
        if not self._lock.acquire(timeout=-1 if wait is None else max(wait, 0.0)):
            raise AdminBusy(self.operation, wait)
        self.operation = operation

    def try_acquire(self, operation: str) -> bool:
        if not self._lock.acquire(blocking=False):
            return False
        self.operation = operation
        return True

    def release(self) -> None:
        self.operation = None
        self._lock.release()


class EngineControl:
    """The manager's control surface (mixed into `ContinuousBatchingManager`, whose state it
    uses: `core`, `model`, `_inbox`, `_thread`, `_paused`, `tensor_parallel`, `_admin`).

    Every command takes `timeout` (None: no limit) for the whole call, and `wait` (None: up
    to `timeout`) for the part spent waiting on another admin command; past `wait` it raises
    `AdminBusy`, past `timeout` `TimeoutError` (the command then still runs, in order)."""

    @property
    def weight_version(self) -> int:
        return self.core.weight_version if self.core else 0

    def is_paused(self) -> bool:
        return self._paused

    def pause(self, timeout: float | None = None, *, wait: float | None = None) -> None:
        """Stop scheduling steps once the step in flight is done; requests keep their KV and
        new ones wait. Returns when the engine is idle. Idempotent."""
        self._admin_command("pause", None, timeout, wait)

    def resume(self, timeout: float | None = None, *, wait: float | None = None) -> None:
        self._admin_command("resume", None, timeout, wait)

    def reset_prefix_cache(self, timeout: float | None = None, *, wait: float | None = None) -> int:
        """Forget every cached prefix; returns the blocks that went back to the free pool."""
        return self._admin_command("reset_prefix_cache", None, timeout, wait)

    def update_weights(self, weights=None, *, inflight: str = "recompute", timeout: float | None = None,
                       wait: float | None = None) -> int:
        """Copy new weights into the attached model, in place, and make the engine consistent
        with them; returns the new `weight_version`.

        `weights`: a state dict or `(name, tensor)` pairs (checked before any copy), or None
        when the caller already changed the model's parameters (an optimizer step on the same
        model object). The copy runs on the engine thread between two steps, so no step sees
        a partial copy; the pause state is left as it is. Every cached prefix is dropped.
        Requests in flight are recomputed with the new weights (`"recompute"`: their tokens so
        far stay), keep their KV (`"keep"`: later tokens use the new weights) or end cancelled
        (`"abort"`); their outputs list the version of each token in `weight_versions`."""
        check_inflight(inflight)
        if self.tensor_parallel is not None:
            raise RuntimeError("update_weights() is not supported under tensor parallelism yet (each rank holds a "
                               "shard of every weight)")
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeError("update_weights() cannot run in a result handler (the engine thread is mid-step): "
                               "call pause() there and update from another thread")
        pairs = weight_pairs(self.model, weights) if weights is not None else []
        result = self._admin_command("weights", (pairs, inflight), timeout, wait)
        logger.info("contbatch: weights updated to version %d (%d tensors; %d requests in flight: %s; %d cached "
                    "blocks freed)", result["weight_version"], len(pairs), result["requests"], inflight,
                    result["freed_cached_blocks"])
        return result["weight_version"]

    def admin_operation(self) -> str | None:
        """The admin command running now, if any (for a server's 409 message)."""
        return self._admin.operation

    # -- running a command ---------------------------------------------------------------
    def _admin_command(self, kind: str, payload, timeout: float | None, wait: float | None):
        if self.core is None:
            raise RuntimeError("this manager was destroyed")
        self._check_driver(kind)
        start = time.monotonic()
        on_engine_thread = self._thread is not None and threading.current_thread() is self._thread
        if on_engine_thread:  # a result handler: runs between steps already; waiting would deadlock
            if not self._admin.try_acquire(kind):
                raise AdminBusy(self._admin.operation, 0.0)
        else:
            self._admin.acquire(kind, wait if wait is not None else timeout)
        remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        return self._control(kind, payload, remaining)

    def _control(self, kind: str, payload, timeout: float | None):
        """Run a command (the admin lock held) on the engine thread, or here when no thread
        runs, and wait for it; the lock is released when the command has run."""
        if not self.is_running() or threading.current_thread() is self._thread:
            try:
                return self._do_control(kind, payload)
            finally:
                self._admin.release()
        done, box = threading.Event(), {}
        self._inbox.put((kind, (payload, done, box)))
        if not done.wait(timeout):
            with self._admin._guard:
                if not done.is_set():  # still queued or running: the engine thread releases the lock
                    box["orphaned"] = True
                    raise TimeoutError(f"the engine did not {kind.replace('_', ' ')} within {timeout} s")
        self._admin.release()
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def _answer(self, payload, result=None, error: BaseException | None = None) -> None:
        """Engine thread: hand a command's outcome to its caller (or release the lock of an
        orphaned one)."""
        _, done, box = payload
        with self._admin._guard:
            if error is not None:
                box["error"] = error
            else:
                box["result"] = result
            done.set()
            if box.get("orphaned"):
                self._admin.release()

    def _do_control(self, kind: str, payload):
        if kind == "pause":
            self.core.flush()
            self._paused = True
        elif kind == "resume":
            self._paused = False
        elif kind == "reset_prefix_cache":
            return self.core.reset_prefix_cache()
        elif kind == "weights":
            pairs, inflight = payload
            self.core.flush()  # the step in flight reads the old weights to its end
            copy_weights(pairs)
            return self.core.weights_changed(inflight)
        elif kind == "adapter":  # LoRA adapters (engine/adapters.py): the step in flight reads them to its end
            self.core.flush()
            return self._adapters.command(*payload)
        return None
