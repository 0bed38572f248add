"""OpenAI's Responses API: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`.

    schemas.py   the request body, strict
    convert.py   input items, tools, text format -> conversation rows, ToolRequest, StructuredOutput
    store.py     the bounded in-memory store behind previous_response_id and GET
    prepare.py   the body -> prompt and params (on the worker pool)
    objects.py   response objects, output items, and the stream events that build them
    writer.py    one response object, or its event stream
    routes.py    the routes

docs/tools.md describes the behaviour.
"""

from __future__ import annotations

from .routes import add_responses_routes
from .store import ResponseStore

__all__ = ["ResponseStore", "add_responses_routes"]
