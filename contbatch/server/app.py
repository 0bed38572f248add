"""The OpenAI-compatible FastAPI app around one running `ContinuousBatchingManager`.

`build_app` takes a built (not necessarily started) manager and the model's tokenizer; the
app's lifespan starts the engine and stops it, so one process serves one engine. Routes read
raw bodies themselves (size and time limits, `bodies.py`) rather than through FastAPI's body
injection, which would answer 422 with its own error shape, and hand them to the worker pool
(`preparation.py` on `workers.py`): parsing, templating and tokenizing never run on the event
loop. Only the engine submission and the response stay on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .. import __version__
from ..engine.manager import ContinuousBatchingManager
from .async_engine import AsyncEngine
from .admin import add_admin_routes
from .adapter_routes import add_adapter_routes
from .bodies import read_body
from .errors import APIError, install_handlers
from .gate import Gate, ServerState
from .responses import Job, ResponseWriter
from .metrics import CONTENT_TYPE, ServerMetrics
from .params import Limits
from .preparation import Preparer
from .responses_api import ResponseStore, add_responses_routes
from .settings import ServerSettings
from .stats import EngineStats
from .ui import add_ui_routes
from .workers import WorkerPool


def build_app(manager: ContinuousBatchingManager, tokenizer, settings: ServerSettings) -> FastAPI:
    resolved = manager.resolved_config
    vocab = manager.model.get_input_embeddings().num_embeddings
    limits = Limits.build(resolved, settings.max_model_len, vocab, manager.defaults.generation_config)
    body_limit = settings.body_limit(limits.max_model_len)
    state = ServerState(warm=manager.is_warm)
    metrics = ServerMetrics(manager.stats, resolved.num_blocks, settings.model_name, lambda: state.inflight)
    engine = AsyncEngine(manager, metrics)
    stats = EngineStats(manager.stats, resolved.num_blocks, resolved.block_size, settings.model_name)
    manager.register_result_handler(stats.on_output)
    writer = ResponseWriter(engine, tokenizer, lambda: state.draining)
    preparer = Preparer(tokenizer, limits, settings)
    preparer.adapter_names = manager.adapter_names
    pool = WorkerPool(settings.worker_threads, settings.max_queued_jobs)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if not manager.is_running():  # compiled steps warm up behind it: /health says so meanwhile
            await asyncio.to_thread(manager.start, wait_warm=False)
        sampler = asyncio.create_task(stats.run())  # the dashboard's history (stats.py)
        yield
        sampler.cancel()
        # Reached once the server has drained (or given up on draining): fail what is left.
        pool.close()
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
    app.state.max_body_bytes = body_limit
    app.state.workers = pool
    app.state.tool_call_parser = f"{preparer.toolbox.fmt.name} ({preparer.toolbox.reason})"

    async def body(request: Request) -> bytes:
        return await read_body(request, body_limit, settings.body_timeout_s)

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": created, "owned_by": "contbatch",
                "root": settings.model_root or settings.model_name, "parent": None,
                "max_model_len": limits.max_model_len}

    # -- service routes ------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not manager.is_running():
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        if not manager.is_warm():
            raise APIError(503, "the engine is warming up (compiling its steps)", code="engine_warming")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def adapter_card(name: str, info: dict) -> dict:  # a LoRA adapter: a model whose parent is the base
        return {**model_card(), "id": name, "root": info["path"], "parent": settings.model_name}

    @app.get("/v1/models")
    async def list_models() -> dict:
        adapters = [adapter_card(name, info) for name, info in manager.list_adapters().items()]
        return {"object": "list", "data": [model_card(), *adapters]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        adapters = manager.list_adapters()
        if model_id in adapters and model_id not in settings.served_model_names:
            return adapter_card(model_id, adapters[model_id])
        if model_id not in settings.served_model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return model_card()

    def adapter_of(name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, or None for the base model."""
        return None if name is None or name in settings.served_model_names else name

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return await pool.run(preparer.tokenize, await body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        return await pool.run(preparer.detokenize, await body(request))

    add_admin_routes(app, manager, settings.weights_dir, body)
    add_adapter_routes(app, manager, settings, body)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    add_ui_routes(app, stats)  # GET / (playground), /dashboard, /static/*, /stats

    # -- generation ----------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        work = await pool.run(preparer.completion, await body(request))
        req = work.req
        if not await engine.compile_grammars(work.params, request, work.structured_param):
            return Response(status_code=499)  # the client is gone; nobody reads this
        adapter = adapter_of(req.model)
        sub = engine.submit([p.token_ids for p in work.prompts], work.params, req.stream, "cmpl", adapter)
        job = Job(chat=False, sub=sub, model=adapter or settings.model_name, prompts=work.prompts, n=req.n,
                  logprobs=req.logprobs is not None, echo=req.echo,
                  include_usage=bool(req.stream_options and req.stream_options.include_usage))
        return await writer.respond(job, request, req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        work = await pool.run(preparer.chat, await body(request))
        req = work.req
        if not await engine.compile_grammars(work.params, request, work.structured_param):
            return Response(status_code=499)
        adapter = adapter_of(req.model)
        sub = engine.submit([work.prompts[0].token_ids], work.params, req.stream, "chatcmpl", adapter)
        job = Job(chat=True, sub=sub, model=adapter or settings.model_name, prompts=work.prompts, n=req.n,
                  logprobs=req.logprobs,
                  include_usage=bool(req.stream_options and req.stream_options.include_usage), tools=work.tools)
        return await writer.respond(job, request, req.stream)

    add_responses_routes(app, pool=pool, preparer=preparer, engine=engine, writer=writer, metrics=metrics,
                         store=ResponseStore(settings.responses_store_size, settings.responses_store_bytes),
                         model=settings.model_name, body=body)  # POST /v1/responses, GET/DELETE /v1/responses/{id}
    return app
