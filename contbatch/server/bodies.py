"""Reading a request body under two limits: its size (413) and the time it takes (408).

Routes read raw bodies themselves (FastAPI's body injection would answer 422 in its own
shape). A client that declares too large a body is refused before a byte of it is read; one
that sends its body too slowly (a slowloris holding a connection and an in-flight slot, and
delaying shutdown) is answered 408 once `timeout_s` has passed since its headers. Both
answers close the connection, so the rest of the body is never read. A client that hangs up
mid-body raises Starlette's `ClientDisconnect`, which `errors.install_handlers` ends quietly.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from .errors import APIError

CLOSE = {"Connection": "close"}  # the unread rest of the body is not worth reading


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed `limit` bytes, or 408 if it
    has not all arrived `timeout_s` seconds after the headers."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large", headers=CLOSE)
    size = 0
    chunks = []
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large",
                                   headers=CLOSE)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s ({size} bytes came)",
                       code="request_timeout", headers=CLOSE) from None
    return b"".join(chunks)
