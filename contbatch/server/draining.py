"""uvicorn with a drain phase: what `contbatch serve` does on SIGTERM and SIGINT.

New requests get 503 at once; requests in flight go on until they are done or the drain
timeout passes (then the engine is hard-stopped and they end with an error); then uvicorn
closes and the process exits 0. A second signal forces the exit. uvicorn's own handling would
refuse connections instead of answering 503, and re-raise the signal once shut down, so the
exit status would say "killed" rather than 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn

from .gate import ServerState

logger = logging.getLogger("contbatch.server")


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain phase between the signal and the shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float, manager=None) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.manager = manager
        self._gave_up = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or self.should_exit:
            logger.warning("second signal: exiting now without waiting for requests in flight")
            self.should_exit = self.force_exit = True
            return
        logger.info("signal %d: draining %d request(s) in flight (up to %.0f s); new requests get 503",
                    sig, self.state.inflight, self.drain_timeout_s)
        self.state.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        state = self.state
        if state.draining and not self.should_exit:
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
