"""The Responses routes: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A POST goes the way of a chat completion: body read under the size and time limits, prepared
on the worker pool, its grammar compiled (the request waits, holding no thread), submitted,
then answered (`writer.py`). Behind the same API keys, with the same error shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..async_engine import AsyncEngine
from ..metrics import ServerMetrics
from ..preparation import Preparer
from ..responses import ResponseWriter
from ..workers import WorkerPool
from .prepare import ResponsesPreparer
from .store import ResponseStore
from .writer import ResponsesWriter


def add_responses_routes(app: FastAPI, *, pool: WorkerPool, preparer: Preparer, engine: AsyncEngine,
                         writer: ResponseWriter, metrics: ServerMetrics, store: ResponseStore, model: str,
                         body: Callable[[Request], Awaitable[bytes]]) -> None:
    prepare = ResponsesPreparer(preparer, store)
    respond = ResponsesWriter(writer, store, metrics, model)
    metrics.count_stored(lambda: len(store))
    app.state.responses_store = store

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        work = await pool.run(prepare.prepare, await body(request))
        if not await engine.compile_grammars([work.params], request, work.structured_param):
            return Response(status_code=499)  # the client is gone; nobody reads this
        sub = engine.submit([work.prompt.token_ids], [work.params], work.req.stream, "resp")
        metrics.response_accepted(work.req.stream)
        return await respond.respond(work, sub, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return store.get(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
