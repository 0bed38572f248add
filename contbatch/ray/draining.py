"""The front's drain: what `ContbatchFront` does between a shutdown signal and Serve's teardown.

Serve's own shutdown kills its HTTP proxies at once, so a client whose stream is in flight
would see its connection cut. `contbatch serve --ray-replicas` therefore drains the front
first, as the single-process server drains itself: new requests get 503
(`server_shutting_down`), requests in flight go on until they finish or `--drain-timeout`
passes; then each request still in flight is ended by the front, which is alive to say so: a
stream with an error event and `[DONE]` (never a cut that could pass for a finished
completion: the event has no `finish_reason`), a request still waiting for its response
with a 503. Only then does Serve tear everything down.

All of it runs on the front replica's event loop (its request handler and its `drain` method),
so plain attributes and asyncio events need no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..server.errors import error_body

SHUTTING_DOWN = "the server is shutting down and accepts no new requests"
FLUSH_S = 5.0  # after the drain timeout: how long the ended requests get to send their last event


def shutting_down_body(detail: str = SHUTTING_DOWN) -> dict:
    """The OpenAI-shaped error of a request refused or ended by the drain."""
    return error_body(503, detail, code="server_shutting_down")


class _EndingResponse(StreamingResponse):
    """A StreamingResponse that calls `on_end` once it is done, however it ends."""

    def __init__(self, *args, on_end, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


class FrontDrain:
    """Requests in flight through one front replica, and its drain."""

    def __init__(self) -> None:
        self.draining = False  # new requests are refused
        self.stopping = asyncio.Event()  # set at the drain timeout: requests in flight are ended
        self._inflight: set = set()  # the replica calls (Serve response generators) in flight
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def enter(self, call) -> None:
        """A request's replica call started (before its response head arrives)."""
        self._inflight.add(call)
        self._idle.clear()

    def leave(self, call) -> None:
        """The request ended, whichever way: answered, failed, or its client went away."""
        self._inflight.discard(call)
        if not self._inflight:
            self._idle.set()

    def response(self, body: AsyncIterator[bytes], call, **kwargs) -> StreamingResponse:
        """The response streaming `body`, with the request counted in flight until the response
        ends, whichever way (finished, failed, its client gone, never started); then the replica
        call is cancelled, which is a no-op for one that finished and frees the replica's
        engine from one whose client left."""
        def end() -> None:
            self.leave(call)
            with contextlib.suppress(Exception):
                call.cancel()

        return _EndingResponse(body, on_end=end, **kwargs)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests; wait up to `timeout_s` for those in flight; end the rest.

        Returns how many requests were still in flight at the timeout (0: all finished). Ending
        one cancels its replica call (the replica's engine cancels the request) and makes its
        body end with an error event, or its head wait answer 503 (see `forwarding.py`)."""
        self.draining = True
        if await self._wait_idle(timeout_s):
            return 0
        left = list(self._inflight)
        self.stopping.set()
        for call in left:
            with contextlib.suppress(Exception):  # best effort: a stream also checks `stopping` per part
                call.cancel()
        await self._wait_idle(FLUSH_S)
        return len(left)

    async def _wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
            return True
        except asyncio.TimeoutError:
            return False
