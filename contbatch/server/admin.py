"""Admin routes for RL loops: pause, resume, drop the prefix cache, load new weights.

They sit behind the API key like every other route (start the server with `--api-key` when
clients are not trusted: docs/security.md). Weights are read only from safetensors files
under the folder named at start with `--weights-dir`: a client names a file, never a path
outside it, and without that flag the route answers 403. Each call runs off the event loop:
pausing waits for the step in flight, and an update copies every tensor.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request

from ..engine.manager import ContinuousBatchingManager
from ..engine.weights import INFLIGHT_POLICIES, read_safetensors
from .errors import APIError

ADMIN_TIMEOUT_S = 600.0


def add_admin_routes(app: FastAPI, manager: ContinuousBatchingManager, weights_dir: str | None, body) -> None:
    def status() -> dict:
        return {"paused": manager.is_paused(), "weight_version": manager.weight_version}

    @app.post("/pause")
    async def pause() -> dict:
        await asyncio.to_thread(manager.pause, ADMIN_TIMEOUT_S)
        return status()

    @app.post("/resume")
    async def resume() -> dict:
        await asyncio.to_thread(manager.resume, ADMIN_TIMEOUT_S)
        return status()

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        freed = await asyncio.to_thread(manager.reset_prefix_cache, ADMIN_TIMEOUT_S)
        return {**status(), "freed_blocks": freed}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> dict:
        try:
            req = json.loads(await body(request) or b"{}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json")
        if not isinstance(req, dict) or not isinstance(req.get("path"), str):
            raise APIError(400, "expected {\"path\": \"<file>.safetensors\", \"inflight\": \"recompute\"}", "path")
        inflight = req.get("inflight", "recompute")
        if inflight not in INFLIGHT_POLICIES:
            raise APIError(400, f"inflight must be one of {list(INFLIGHT_POLICIES)}", "inflight")
        try:
            weights = await asyncio.to_thread(read_safetensors, req["path"], weights_dir)
        except PermissionError as exc:
            raise APIError(403, str(exc), "path", "forbidden")
        except FileNotFoundError as exc:
            raise APIError(404, str(exc), "path", "not_found")
        try:
            version = await asyncio.to_thread(manager.update_weights, weights, inflight=inflight,
                                              timeout=ADMIN_TIMEOUT_S)
        except ValueError as exc:  # a name or shape the model does not have: nothing was copied
            raise APIError(400, str(exc), "path", "invalid_weights")
        return {**status(), "weight_version": version, "tensors": len(weights)}
