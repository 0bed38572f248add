"""Admin routes for RL loops: pause, resume, drop the prefix cache, load new weights.

They sit behind the API key like every other route (start the server with `--api-key` when
clients are not trusted: docs/security.md). They run one at a time (the manager's admin lock):
a call that arrives while another runs waits its turn for up to `ADMIN_WAIT_S`, then gets 409
naming the operation in progress. Weights are read only from safetensors files under the
folder named at start with `--weights-dir`: a client names a file, never a path outside it,
and without that flag the route answers 403; every other bad path or file is a 400 and changes
nothing. Each call runs off the event loop: pausing waits for the step in flight, and an
update reads and copies every tensor.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from ..engine.control import AdminBusy
from ..engine.manager import ContinuousBatchingManager
from ..engine.weights import read_safetensors
from .errors import APIError
from .preparation import parse_body
from .schemas import UpdateWeightsRequest

ADMIN_WAIT_S = 30.0  # for another admin operation to end; then 409
ADMIN_TIMEOUT_S = 600.0  # for the operation itself


def add_admin_routes(app: FastAPI, manager: ContinuousBatchingManager, weights_dir: str | None, body) -> None:
    def status() -> dict:
        return {"paused": manager.is_paused(), "weight_version": manager.weight_version}

    async def run(call, *args, **kwargs):
        try:
            return await asyncio.to_thread(call, *args, timeout=ADMIN_TIMEOUT_S, wait=ADMIN_WAIT_S, **kwargs)
        except AdminBusy as exc:
            raise APIError(409, f"{exc}; retry when it has ended", code="admin_operation_in_progress",
                           headers={"Retry-After": "1"}) from None
        except RuntimeError as exc:  # stopped or destroyed meanwhile
            raise APIError(503, f"the engine is not running: {exc}", code="engine_unavailable") from None

    @app.post("/pause")
    async def pause() -> dict:
        await run(manager.pause)
        return status()

    @app.post("/resume")
    async def resume() -> dict:
        await run(manager.resume)
        return status()

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        freed = await run(manager.reset_prefix_cache)
        return {**status(), "freed_blocks": freed}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> dict:
        req = parse_body(await body(request), UpdateWeightsRequest)
        try:
            weights = await asyncio.to_thread(read_safetensors, req.path, weights_dir, manager.model)
        except PermissionError as exc:
            raise APIError(403, str(exc), "path", "forbidden") from None
        except ValueError as exc:
            raise APIError(400, str(exc), "path", "invalid_weights") from None
        try:
            version = await run(manager.update_weights, weights, inflight=req.inflight)
        except ValueError as exc:  # a dtype the model cannot take: nothing was copied
            raise APIError(400, str(exc), "path", "invalid_weights") from None
        return {**status(), "weight_version": version, "tensors": len(weights)}
