"""HTTP over a Serve handle: the front forwards a read request, a replica runs it through the
single-process server's own app, and the response comes back as a stream of parts.

Running the real FastAPI app in the replica (rather than re-implementing routes behind
handle methods) is what keeps every route, error shape, limit, metric and the API key exactly
as in `contbatch serve`. The replica yields a head (`{"status", "headers"}`) and then the body
chunks as the app sends them, so streamed completions stay streamed end to end.

Replica death is the one failure the app cannot answer itself: the front turns it into a 503
before the head, or an error event then `[DONE]` inside an event stream, never a hang. The
front's drain (`draining.py`) ends what is still in flight at its timeout the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from ..server.errors import error_body
from ..server.formatting import sse
from .draining import shutting_down_body
from .routing import REPLICA_HEADER, HTTPCall

logger = logging.getLogger("contbatch.ray")

_END = object()
DRAIN_ENDED = "the server is shutting down: the request did not finish within the drain timeout"


def http_scope(call: HTTPCall) -> dict:
    """The ASGI scope of a forwarded request (the front already parsed the request line)."""
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
        "query_string": call.query, "root_path": "", "headers": list(call.headers),
        "client": call.client, "server": ("contbatch-replica", 0), "state": {},
    }


async def run_asgi(app, call: HTTPCall, replica_id: str) -> AsyncIterator[dict | bytes]:
    """Run `call` through the ASGI `app`; yield the response head, then its body chunks.

    Closing the iterator early (the client went away, Serve cancelled the call) tells the app
    the client disconnected, which cancels the engine request, and then stops the app."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(http_scope(call), receive, send)
        finally:
            await messages.put(_END)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is _END:
                break
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield {"status": message["status"], "headers": headers + [(REPLICA_HEADER, replica_id)]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task  # re-raises what the app raised (Starlette answers errors itself first)
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            task.cancel()


def replica_lost(exc: BaseException) -> dict:
    """The OpenAI-shaped error for a request whose replica died or could not be reached."""
    return error_body(503, f"the replica serving this request is gone ({type(exc).__name__}: {exc}); "
                           "retry: Serve replaces it", code="replica_unavailable")


async def forward_body(parts, head: dict, stopping: asyncio.Event | None = None) -> AsyncIterator[bytes]:
    """The body parts after `head`. An event stream whose replica is lost mid-stream, or that
    the front's drain ends (`stopping` set, see `draining.py`), ends with an error event and
    `[DONE]`: never cut short in a way that could pass for a finished completion (the error
    event has no `finish_reason`). A plain body is cut instead: its client sees a read short
    of its Content-Length, an error."""
    streaming = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head["headers"])
    ended: dict | None = None
    try:
        try:
            async for part in parts:
                if stopping is not None and stopping.is_set():
                    ended = shutting_down_body(DRAIN_ENDED)
                    break
                yield part
        except Exception as exc:  # RayActorError, ActorDiedError, ... : the replica is gone, or the drain cancelled it
            if stopping is not None and stopping.is_set():
                ended = shutting_down_body(DRAIN_ENDED)
            else:
                logger.warning("contbatch.ray: replica lost mid-response: %r", exc)
                ended = replica_lost(exc)
            if not streaming:
                raise
        if ended is not None:
            if not streaming:
                raise RuntimeError(ended["error"]["message"])
            yield (sse(ended) + sse("[DONE]")).encode()
    finally:
        with contextlib.suppress(Exception):
            parts.cancel()
