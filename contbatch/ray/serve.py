"""Ray Serve: one engine per replica behind one endpoint.

Two deployments. `ContbatchServer` replicas each build an engine and the single-process
server's FastAPI app (`build_app`) in their constructor; Serve runs the app's lifespan, which
starts the engine. `ContbatchFront` is the HTTP ingress: it reads a request's body, keys it by
its prompt's first block, and forwards it over a handle whose request router
(`PrefixAwareRouter`) picks the replica; the replica runs it through its app
(`forwarding.py`). The front holds no model and no state: every answer, error and metric comes
from a replica's app. Method names follow Ray Serve LLM's `LLMServer` (`chat`, `completions`,
`check_health`, `reset_prefix_cache`, `record_routing_stats`) so that an adapter to
`ray.serve.llm` stays small.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..engine.manager import ContinuousBatchingManager
from ..server.app import build_app
from ..server.errors import error_body
from ..server.settings import MAX_SIZED_BODY_BYTES, ServerSettings
from .draining import FLUSH_S, FrontDrain, shutting_down_body
from .forwarding import DRAIN_ENDED, forward_body, replica_lost, run_asgi
from .routing import REPLICA_HEADER, HTTPCall, PrefixAwareRouter, prefix_key
from .spec import EngineSpec

logger = logging.getLogger("contbatch.ray")

SERVE_NAMESPACE = "serve"
DEFAULT_APP_NAME = "contbatch"


@dataclass(frozen=True)
class ServeOptions:
    """How many replicas, how big, how loaded; and the HTTP proxy's address."""

    num_replicas: int = 1
    min_replicas: int | None = None  # set (with max_replicas) to autoscale instead
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0  # autoscaling target per replica
    max_ongoing_requests: int = 64  # per replica; Serve queues beyond it (the engine batches these)
    num_cpus: float = 1.0  # per replica; fractional is fine (two replicas on a 2-core machine: 0.5)
    num_gpus: float = 0.0
    prefix_routing: bool = True  # False: Serve's default power-of-two-choices router
    imbalance_threshold: int = 8  # requests in flight beyond the least-loaded replica that demote a prefix owner
    front_cpus: float = 0.1  # the ingress only forwards
    host: str = "127.0.0.1"
    port: int = 8000
    app_name: str = DEFAULT_APP_NAME

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("autoscaling needs both min_replicas and max_replicas")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")

    def replica_options(self) -> dict:
        """`Deployment.options` for `ContbatchServer`."""
        scaling = (
            {"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                    "initial_replicas": max(self.min_replicas, 1),
                                    "target_ongoing_requests": self.target_ongoing_requests}}
            if self.min_replicas is not None else {"num_replicas": self.num_replicas}
        )
        router = {}
        if self.prefix_routing:
            router["request_router_config"] = RequestRouterConfig(
                request_router_class=f"{PrefixAwareRouter.__module__}.{PrefixAwareRouter.__qualname__}",
                request_router_kwargs={"imbalance_threshold": self.imbalance_threshold})
        return {**scaling, **router, "max_ongoing_requests": self.max_ongoing_requests,
                "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}}


@serve.deployment(name="ContbatchServer", health_check_period_s=2, health_check_timeout_s=30)
@serve.ingress()
class ContbatchServer:
    """One replica: one engine, served by the single-process server's app."""

    def __init__(self, spec: EngineSpec, settings: ServerSettings) -> None:
        model, tokenizer = spec.load()
        self.manager = ContinuousBatchingManager(model, None, spec.config, tokenizer=tokenizer)
        self.settings = settings
        self._app = build_app(self.manager, tokenizer, settings)  # its lifespan starts the engine
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        logger.info("contbatch.ray: replica %s resolved %s", self.replica_id,
                    json.dumps(self.manager.resolved_config.as_dict()))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app

    async def handle_http(self, call: HTTPCall) -> AsyncIterator[dict | bytes]:
        """A request forwarded by the front: the response head, then its body chunks."""
        async for part in run_asgi(self._app, call, self.replica_id):
            yield part

    # -- LLMServer-style methods for handle callers (trusted: inside the cluster) -------------
    async def chat(self, body: dict) -> AsyncIterator[dict]:
        """/v1/chat/completions for a handle caller: the response (or error) as one dict, or
        with `stream` each event's dict."""
        async for item in self._openai("/v1/chat/completions", body):
            yield item

    async def completions(self, body: dict) -> AsyncIterator[dict]:
        """/v1/completions for a handle caller, as `chat`."""
        async for item in self._openai("/v1/completions", body):
            yield item

    async def _openai(self, path: str, body: dict) -> AsyncIterator[dict]:
        headers = [(b"content-type", b"application/json")]
        if self.settings.api_keys:
            headers.append((b"authorization", f"Bearer {self.settings.api_keys[0]}".encode()))
        call = HTTPCall("POST", path, b"", headers, json.dumps(body).encode())
        head, buf = None, b""
        async for part in run_asgi(self._app, call, self.replica_id):
            if head is None:
                head = part
                continue
            buf += part
            while head["status"] == 200 and b"\n\n" in buf and bool(body.get("stream")):
                event, buf = buf.split(b"\n\n", 1)
                data = event.decode().removeprefix("data: ")
                if data != "[DONE]":
                    yield json.loads(data)
        if buf.strip():
            yield json.loads(buf)

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy (it is replaced)."""
        if not self.manager.is_running():
            raise RuntimeError(f"replica {self.replica_id}: the contbatch engine thread is not running")

    async def reset_prefix_cache(self) -> int:
        import asyncio

        return await asyncio.to_thread(self.manager.reset_prefix_cache, 30.0)

    def record_routing_stats(self) -> dict:
        """Serve polls this for its routers; also what tests and benchmarks read."""
        s = self.manager.stats()
        return {"replica": self.replica_id, "running": s.get("running", 0), "waiting": s.get("waiting", 0),
                "prefix_cache_queries": s.get("prefix_cache_queries", 0),
                "prefix_cache_hits": s.get("prefix_cache_hits", 0)}

    def resolved_config(self) -> dict:
        return self.manager.resolved_config.as_dict()


@serve.deployment(name="ContbatchFront")
class ContbatchFront:
    """The HTTP ingress: reads a request, keys it by its prompt, forwards it to a replica.

    A plain deployment whose `__call__` takes every path (Serve allows one FastAPI ingress
    per application, and that is the replicas' app). `drain` is what `contbatch serve
    --ray-replicas` calls on a shutdown signal, before Serve tears down (`draining.py`)."""

    def __init__(self, replicas, settings: ServerSettings) -> None:
        self.replicas = replicas.options(stream=True, method_name="handle_http")
        # A replica sizes its own limit from its context; the front only stops bodies no replica
        # would accept (it must hold the body to key it): the configured limit, else the largest sized one.
        self.max_body = settings.max_body_bytes or MAX_SIZED_BODY_BYTES
        self._drain = FrontDrain()

    async def __call__(self, request: Request) -> Response:
        if self._drain.draining:
            return JSONResponse(shutting_down_body(), status_code=503, headers={"Retry-After": "5", "Connection": "close"})
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                return JSONResponse(error_body(413, f"request body exceeds {self.max_body} bytes"), status_code=413)
        call = HTTPCall(request.method, request.url.path, request.url.query.encode(), list(request.headers.raw),
                        bytes(body), prefix_key(bytes(body)) if request.method == "POST" else None,
                        request.headers.get(REPLICA_HEADER))
        parts = self.replicas.remote(call)
        self._drain.enter(parts)
        try:
            head = await parts.__anext__()
        except BaseException as exc:  # the replica died or could not be reached before answering, or the drain ended it
            self._drain.leave(parts)
            if not isinstance(exc, Exception):  # cancelled: the client went away
                raise
            if self._drain.stopping.is_set():
                return JSONResponse(shutting_down_body(DRAIN_ENDED), status_code=503)
            logger.warning("contbatch.ray: request to %s failed before its response: %r", call.path, exc)
            return JSONResponse(replica_lost(exc), status_code=503)
        return self._drain.response(forward_body(parts, head, self._drain.stopping), parts, status_code=head["status"],
                                    headers=dict(head["headers"]))

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests (503), let those in flight finish for up to `timeout_s`, then end
        the rest with an error; returns how many were ended. Not undone: Serve's teardown follows."""
        return await self._drain.drain(timeout_s)


def build_serve_app(spec: EngineSpec, settings: ServerSettings, options: ServeOptions):
    """The Serve application: the front bound to the replicas (deploy with `serve.run`)."""
    replicas = ContbatchServer.options(**options.replica_options()).bind(spec, settings)
    return ContbatchFront.options(num_replicas=1, max_ongoing_requests=100_000,
                                  ray_actor_options={"num_cpus": options.front_cpus}).bind(replicas, settings)


def run_serve(spec: EngineSpec, settings: ServerSettings, options: ServeOptions, *, blocking: bool = False):
    """Start Serve's HTTP proxy on `options.host:port` and deploy; returns the front's handle.
    `ray.init` first (or let this join/start a cluster as Ray's defaults do)."""
    serve.start(http_options={"host": options.host, "port": options.port})
    logger.info("contbatch.ray: serving %s on http://%s:%d with %s", spec.model or "default model",
                options.host, options.port, json.dumps(asdict(options)))
    return serve.run(build_serve_app(spec, settings, options), name=options.app_name, route_prefix="/",
                     blocking=blocking)


def drain_front(timeout_s: float, app_name: str = DEFAULT_APP_NAME) -> int | None:
    """Drain the app's front (`ContbatchFront.drain`): returns how many requests it had to end,
    or None if it could not be reached (Serve's teardown then cuts what is in flight)."""
    front = serve.get_deployment_handle("ContbatchFront", app_name)
    try:
        return front.drain.remote(timeout_s).result(timeout_s=timeout_s + FLUSH_S + 10)
    except Exception as exc:  # the front is gone or being replaced: nothing left to drain through it
        logger.warning("contbatch.ray: could not drain the front (%r); stopping Serve now", exc)
        return None


def replica_actors(app_name: str = DEFAULT_APP_NAME) -> dict[str, ray.actor.ActorHandle]:
    """The live `ContbatchServer` replica actors of an app, by replica id (the id responses
    carry in `x-contbatch-replica`, and a request may pin): to kill one, or to list them."""
    prefix = f"SERVE_REPLICA::{app_name}#ContbatchServer#"
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == SERVE_NAMESPACE and entry["name"].startswith(prefix):
            out[entry["name"][len(prefix):]] = ray.get_actor(entry["name"], namespace=SERVE_NAMESPACE)
    return out
