"""uvicorn's h11 protocol with a header read timeout, and the uvicorn config that uses it.

uvicorn times out idle keep-alive connections, but nothing else: a client that opens a
connection and sends nothing, or sends its request line and headers a byte at a time
(slowloris), holds the connection forever. Here each request's head (request line and
headers) must be complete `header_timeout_s` seconds after the connection opened, or after
its first byte on a kept-alive connection; otherwise the connection gets a 408 (or, if it sent
nothing at all, is just closed). The timer is never restarted by more bytes, so dripping them
does not help. The body's own deadline is the app's (`bodies.read_body`), where the 408 can
be OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body


class HeaderTimeoutH11Protocol(H11Protocol):
    """H11Protocol, with a deadline on each request's head. Subclassed per server by
    `http_protocol` to carry its timeout (uvicorn builds protocols from the class alone)."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is cut too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the head is complete (or the connection failed)
        elif self.conn.trailing_data[0]:
            self._arm()  # a head has begun and is not complete

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # a partial request: say why it ends
            self.transport.write(_timeout_response(self.header_timeout_s))
        self.transport.close()


def _timeout_response(timeout_s: float) -> bytes:
    """A complete 408 written raw: h11 cannot send a response to a request it never parsed."""
    body = json.dumps(error_body(408, f"the request headers did not arrive within {timeout_s:g} s", None,
                                 "request_timeout")).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


def http_protocol(header_timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class for uvicorn's `http=`, with this header timeout."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": header_timeout_s})


def uvicorn_config(app: Any, header_timeout_s: float, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for this app, with the header timeout's protocol (h11, whether or not
    httptools is installed: the timeout is implemented for h11 only)."""
    return uvicorn.Config(app, http=http_protocol(header_timeout_s), **kwargs)
