"""The OpenAI-compatible FastAPI app around one running `ContinuousBatchingManager`.

`build_app` takes a built (not necessarily started) manager and the model's tokenizer; the
app's lifespan starts the engine and stops it, so one process serves one engine. Routes parse
raw bodies themselves (size limit, strict schema, OpenAI-shaped errors) rather than through
FastAPI's body injection, which would answer 422 with its own error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from .. import __version__
from ..engine.manager import ContinuousBatchingManager
from .async_engine import AsyncEngine
from .errors import APIError, bad_request, describe_validation_error, install_handlers
from .gate import Gate, ServerState
from .generation import Generator, Job
from .metrics import CONTENT_TYPE, ServerMetrics
from .params import Limits, max_new_tokens, sampling_params
from .prompts import chat_prompt, completion_prompts, decode
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from .settings import ServerSettings

logger = logging.getLogger("contbatch.server")

M = TypeVar("M", bound=BaseModel)


def build_app(manager: ContinuousBatchingManager, tokenizer, settings: ServerSettings) -> FastAPI:
    resolved = manager.resolved_config
    vocab = manager.model.get_input_embeddings().num_embeddings
    limits = Limits.build(resolved, settings.max_model_len, vocab, manager.defaults.generation_config)
    state = ServerState()
    metrics = ServerMetrics(manager.stats, resolved.num_blocks, settings.model_name, lambda: state.inflight)
    engine = AsyncEngine(manager, metrics)
    generator = Generator(engine, tokenizer, lambda: state.draining)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if not manager.is_running():
            await asyncio.to_thread(manager.start)
        yield
        # Reached once the server has drained (or given up on draining): fail what is left.
        await asyncio.to_thread(manager.stop, True)

    app = FastAPI(title="contbatch", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    install_handlers(app)
    app.add_middleware(Gate, state=state, api_keys=settings.api_keys)
    app.state.server_state = state
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.limits = limits
    app.state.settings = settings

    async def parse(request: Request, model: type[M]) -> M:
        return validate(await _read_body(request, settings.max_body_bytes), model)

    def validate(body: bytes, model: type[M]) -> M:
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as exc:
            message, param = describe_validation_error(exc)
            raise APIError(400, message, param) from None
        name = getattr(parsed, "model", None)
        if name is not None and name not in settings.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{settings.model_name}`.",
                           "model", "model_not_found")
        return parsed

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": created, "owned_by": "contbatch",
                "root": settings.model_root or settings.model_name, "parent": None,
                "max_model_len": limits.max_model_len}

    # -- service routes ------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not manager.is_running():
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if model_id not in settings.served_model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await _read_body(request, settings.max_body_bytes)
        try:  # vLLM's two forms: {"prompt": ...} or {"messages": [...]}
            chat = "messages" in json.loads(body)
        except (ValueError, TypeError):
            chat = False  # not a JSON object: the schema below says what is wrong
        req = validate(body, TokenizeChatRequest if chat else TokenizeCompletionRequest)
        if isinstance(req, TokenizeChatRequest):
            ids = chat_prompt(tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message,
                              req.add_special_tokens).token_ids
        else:
            ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        out = {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await parse(request, DetokenizeRequest)
        return {"prompt": decode(tokenizer, req.tokens, "tokens")}

    # -- generation ----------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        if req.suffix is not None:
            raise bad_request("suffix is not supported: this engine generates left to right only", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of ({req.best_of}) must equal n ({req.n}): this server does not rank "
                              "hidden samples", "best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs needs prompt logprobs, which this engine does not compute; "
                              "drop one of them", "echo")
        prompts = completion_prompts(tokenizer, req.prompt, req.add_special_tokens)
        want_lp = req.logprobs is not None
        params = [
            sampling_params(
                req, limits, max_new_tokens(req.max_tokens, 16, len(p.token_ids), limits, "max_tokens", "prompt"),
                want_lp, req.logprobs or 0, settings.max_n,
            )
            for p in prompts
        ]
        sub = engine.submit([p.token_ids for p in prompts], params, req.stream, "cmpl")
        job = Job(False, sub, settings.model_name, prompts, req.n, want_lp, echo=req.echo,
                  include_usage=bool(req.stream_options and req.stream_options.include_usage))
        return await generator.respond(job, request, req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        prompt = chat_prompt(tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        budget = max_new_tokens(requested, None, len(prompt.token_ids), limits, param, "messages")
        params = sampling_params(req, limits, budget, req.logprobs, req.top_logprobs or 0, settings.max_n)
        sub = engine.submit([prompt.token_ids], [params], req.stream, "chatcmpl")
        job = Job(True, sub, settings.model_name, [prompt], req.n, req.logprobs,
                  include_usage=bool(req.stream_options and req.stream_options.include_usage))
        return await generator.respond(job, request, req.stream)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    size = 0
    chunks = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)

