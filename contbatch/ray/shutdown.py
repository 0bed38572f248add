"""How `contbatch serve --ray-replicas N` ends: the first SIGTERM or SIGINT drains Serve, then
the Ray runtime this process started is stopped and the process exits 0; a second signal skips
the drain. Whatever the replicas did before (died, were replaced), the same path runs.

Why handlers of our own: `ray.init` installs a SIGTERM handler that raises `SystemExit`
wherever the main thread happens to be, and Ray's core worker a fatal-signal handler that
dumps a stack trace; a SIGTERM then tore the process down in the middle of Ray's own teardown
(SIGABRT), and node processes (the dashboard and runtime-env agents) outlived it. Installed
after `ray.init`, ours replace both: a signal only interrupts the main thread's wait, and the
teardown runs once, in order, on the main thread, with later signals ignored so that it
finishes (an operator who cannot wait sends SIGKILL, and then nothing can clean up).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

logger = logging.getLogger("contbatch.ray")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(BaseException):
    """Raised on the main thread by a signal: the first asks for a drain, the second ends it.
    A BaseException, so that no `except Exception` in library code swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Handler:
    """Counts signals; raises StopRequested for the first two, ignores the rest (teardown)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, _frame) -> None:
        self.count += 1
        if self.count <= 2:
            raise StopRequested(signum)


def run_until_signalled(start: Callable[[], None], drain: Callable[[], None], teardown: Callable[[], None]) -> int:
    """`start()`, then wait for SIGTERM/SIGINT; on the first, `drain()`; always `teardown()`.

    Returns 0 once torn down after a signal. An exception from `start` or `drain` still runs
    `teardown` and then propagates. Must run on the main thread (signal handlers live there),
    after `ray.init`, whose handlers these replace until they are restored on return."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run_until_signalled must run on the main thread (it installs signal handlers)")
    handler = _Handler()
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        try:
            try:
                start()
                threading.Event().wait()  # only a signal ends this wait
            except StopRequested as stop:
                logger.info("contbatch.ray: signal %d: draining Serve (requests in flight finish or end with an "
                            "error), then stopping Ray; a second signal skips the drain", stop.signum)
                drain()
        except StopRequested as stop:  # raised during the drain: the second signal
            logger.warning("contbatch.ray: second signal (%d): stopping Ray now without draining", stop.signum)
        return 0
    finally:
        handler.count = 3  # from here on signals are ignored: the teardown must finish
        try:
            teardown()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
