"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Clients (the `openai` package among them) map the status code to an exception class and show
`message`; so every message says what was wrong and, where there are numbers, which ones.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

logger = logging.getLogger("contbatch.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """A request the server answers with an OpenAI-shaped error and `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After, or Connection: close after an unread body

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def describe_validation_error(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """One readable message for pydantic's error list, and the first offending field."""
    parts = []
    param = None
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        kind = err.get("type", "")
        if kind == "extra_forbidden":
            msg = f"unknown field '{loc}': this server rejects parameters it would not honour"
        elif kind == "json_invalid":
            msg = f"the body is not valid JSON: {err.get('msg', '')}".rstrip(": ")
            loc = ""
        elif kind == "model_type":
            msg = "the body must be a JSON object"
            loc = ""
        else:
            msg = f"{loc}: {err.get('msg', 'invalid value')}" if loc else err.get("msg", "invalid value")
        parts.append(msg)
        param = param or (loc.split(".")[0] if loc else None)
    more = len(exc.errors()) - 5
    if more > 0:
        parts.append(f"... and {more} more")
    return "; ".join(parts), param


def install_handlers(app: FastAPI) -> None:
    """Route every error FastAPI or Starlette would raise through the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc)
        return APIError(400, message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _: ClientDisconnect) -> Response:
        # Raised while reading a body. A handler of its own, not the catch-all below, whose
        # 500 Starlette re-raises for uvicorn to log as a ~60-line traceback: one debug line
        # per disconnect, so that hanging up mid-upload cannot flood the logs.
        logger.debug("client disconnected while sending the body of %s %s", request.method, request.url.path)
        return Response(status_code=499)  # never sent: the connection is gone

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The details stay in the server's log: a client learns that it failed, not how.
        logger.error("internal error answering %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, f"internal error ({type(exc).__name__}); the server log has the details",
                                       None, "internal_error"), status_code=500)
