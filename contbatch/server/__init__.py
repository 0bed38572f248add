"""The OpenAI-compatible HTTP server: `contbatch serve`, or `build_app()` from Python.

    app.py          routes, and the lifespan that starts and stops the engine
    bodies.py       reading a body: size limit (413), time limit (408)
    workers.py      the bounded thread pool that prepares requests off the event loop
    preparation.py  body -> validated request, prompts and params (runs on the pool)
    schemas.py      strict request models (unknown generation parameters are rejected)
    params.py       request fields -> SamplingParams, context and budget checks
    prompts.py      text, token ids and chat messages -> prompt token ids
    async_engine.py engine thread -> asyncio: per-request queues, cancellation
    responses.py    JSON bodies and SSE streams (ResponseWriter), client disconnects
    formatting.py   OpenAI response shapes: choices, chunks, logprobs, usage
    tools/          tool calling: call formats, grammars, parsing, prompt rendering
    responses_api/  the Responses API: /v1/responses, its store, objects and events
    metrics.py      Prometheus metrics, vLLM's names with a contbatch: prefix
    stats.py        the dashboard's JSON (GET /stats): engine history, recent requests
    ui.py           the playground (GET /) and dashboard pages, from static/
    gate.py         503 while draining, API keys (not for the pages), requests in flight
    errors.py       OpenAI's error shape for every failure
    draining.py     uvicorn with a drain phase on SIGTERM/SIGINT
    connections.py  uvicorn's h11 protocol with a header read timeout
    serve.py        the CLI
    settings.py     HTTP policies: names, keys, limits

Imports are lazy so that `contbatch generate` does not pay for FastAPI.
"""

from __future__ import annotations

__all__ = ["ServerSettings", "build_app"]


def __getattr__(name: str):
    if name == "build_app":
        from .app import build_app

        return build_app
    if name == "ServerSettings":
        from .settings import ServerSettings

        return ServerSettings
    raise AttributeError(name)
