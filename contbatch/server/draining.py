"""uvicorn with a drain phase: what `contbatch serve` does on SIGTERM and SIGINT.

- First signal: new requests get 503 at once; requests in flight go on until they are done or
  the drain timeout passes (then the engine is hard-stopped and they end with an error); then
  uvicorn closes and the process exits 0.
- Second signal: a forced exit that still answers everyone. The engine is hard-stopped, so
  every request it holds ends at once with an OpenAI-shaped 503 (a stream: an error event,
  then `[DONE]`); the server waits a moment (`FORCED_GRACE_S`) for those answers to be sent,
  shuts down, and the process exits with status 1 (`FORCED_EXIT_STATUS`).
- Third signal: `os._exit(1)` at once, for an engine that does not even stop.

uvicorn's own handling would refuse connections instead of answering 503, skip the app's
shutdown on a second signal (leaving the engine thread running into interpreter teardown:
an abort), and re-raise the signal once shut down, so the exit status would say "killed".
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from types import FrameType

import uvicorn

from .gate import ServerState

logger = logging.getLogger("contbatch.server")

FORCED_EXIT_STATUS = 1
FORCED_GRACE_S = 3.0  # after a second signal: for the failed requests' answers to go out


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain phase between the signal and the shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float, manager=None) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.manager = manager
        self.signals = 0
        self._gave_up = False
        self._forcing: asyncio.Task | None = None

    @property
    def exit_status(self) -> int:
        """What the process should exit with once `run()` returns."""
        if not self.started:
            return 1
        return FORCED_EXIT_STATUS if self.signals >= 2 else 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals += 1
        if self.signals >= 3:
            logger.error("third signal: exiting now")
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(FORCED_EXIT_STATUS)
        if self.signals == 2 or self.should_exit:
            logger.warning("second signal: failing %d request(s) in flight with 503 and exiting", self.state.inflight)
            self.state.begin_drain()
            if self.manager is None:
                self.should_exit = True
            return
        logger.info("signal %d: draining %d request(s) in flight (up to %.0f s); new requests get 503",
                    sig, self.state.inflight, self.drain_timeout_s)
        self.state.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        state = self.state
        if self.signals >= 2 and self._forcing is None and not self.should_exit:
            self._forcing = asyncio.create_task(self._force())
        elif state.draining and not self.should_exit and self._forcing is None:
            if state.inflight == 0:
                logger.info("drained: shutting down")
                self.should_exit = True
            elif time.monotonic() - state.drain_started > self.drain_timeout_s and not self._gave_up:
                self._gave_up = True
                logger.warning("drain timeout: failing %d request(s) still in flight", state.inflight)
                if self.manager is not None:  # their handlers answer at once, with an error
                    await asyncio.to_thread(self.manager.stop, True)
            elif self._gave_up and time.monotonic() - state.drain_started > self.drain_timeout_s + 5:
                self.should_exit = True  # whatever still hangs is cut by uvicorn's own timeout
        return await super().on_tick(counter)

    async def _force(self) -> None:
        """Fail everything the engine holds (its handlers answer 503 at once), give the
        answers a moment to leave, then shut down (uvicorn's shutdown runs the app's, which
        stops what is left)."""
        try:
            await asyncio.to_thread(self.manager.stop, True, FORCED_GRACE_S)
            deadline = time.monotonic() + FORCED_GRACE_S
            while self.state.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.state.inflight:
                logger.warning("%d request(s) still unanswered; closing their connections", self.state.inflight)
        finally:
            self.should_exit = True
