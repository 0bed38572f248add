"""What every HTTP request passes first: shutdown (503), the API key (401), in-flight count,
and HEAD answered wherever GET is (as a GET whose body is not sent: load balancers probe so).

A plain ASGI middleware rather than Starlette's `BaseHTTPMiddleware`, which would wrap the
request's receive channel and hide client disconnects from the routes that watch for them.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_body

UNAUTHENTICATED_PATHS = frozenset({"/health"})
UNCOUNTED_PATHS = frozenset({"/health", "/metrics", "/stats"})  # a scrape or poll must not hold up a shutdown
# The browser pages (ui.py): static files with no data, served without the key (a browser
# cannot send one when it opens a page: the page asks for it) and while the engine warms up.
PAGE_PATHS = frozenset({"/", "/dashboard"})
STATIC_PREFIX = "/static/"


def is_page(path: str) -> bool:
    return path in PAGE_PATHS or path.startswith(STATIC_PREFIX)


@dataclass
class ServerState:
    """Shared by the gate, the routes and the shutdown logic of one app (event loop only)."""

    inflight: int = 0
    draining: bool = False
    drain_started: float | None = None
    warm: Callable[[], bool] = lambda: True  # the engine's compiled steps are ready

    def begin_drain(self) -> None:
        """Stop accepting: from now on every new request gets 503; those in flight go on."""
        if not self.draining:
            self.draining = True
            self.drain_started = time.monotonic()


class Gate:
    def __init__(self, app: ASGIApp, state: ServerState, api_keys: tuple[str, ...] = ()) -> None:
        self.app = app
        self.state = state
        self.api_keys = tuple(k.encode() for k in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self.state.draining:
            await _reply(send, 503, "the server is shutting down and accepts no new requests",
                         "server_shutting_down", {"Retry-After": "5", "Connection": "close"})
            return
        page = is_page(path)
        if self.api_keys and path not in UNAUTHENTICATED_PATHS and not page and not self._authorized(scope):
            await _reply(send, 401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                         "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            return
        if path not in UNCOUNTED_PATHS and not page and not self.state.warm():
            await _reply(send, 503, "the engine is compiling its steps and accepts requests once warm",
                         "engine_warming", {"Retry-After": "5"})
            return
        if scope.get("method") == "HEAD":
            scope, send = {**scope, "method": "GET"}, _headers_only(send)
        counted = path not in UNCOUNTED_PATHS
        if counted:
            self.state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                self.state.inflight -= 1

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                token = token.strip()
                if scheme.lower() == b"bearer" and token:
                    return any(secrets.compare_digest(token, key) for key in self.api_keys)
                return False
        return False


def _headers_only(send: Send) -> Send:
    """A HEAD response: the GET's status and headers (its content-length included), no body."""

    async def sender(message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return sender


async def _reply(send: Send, status: int, message: str, code: str, headers: dict[str, str]) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
