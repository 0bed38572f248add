"""Admin routes for LoRA adapters at run time (vLLM's names): `POST /v1/load_lora_adapter`
{"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter` {"lora_name"}.

Behind the API key like every route, and one at a time with the other admin operations (the
manager's admin lock: 409 past `ADMIN_WAIT_S`). A client names an adapter directory under the
server's `--weights-dir`, never an arbitrary path (403 without that flag). A loaded adapter is
served as a model: requests choose it by `model`, and `/v1/models` lists it with the base as
its parent. Errors in the OpenAI format: a bad directory or name 400, an unknown adapter 404
(`model_not_found`), an adapter still used by running requests 409.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import FastAPI, Request
from pydantic import Field

from ..engine.control import AdminBusy
from ..engine.manager import ContinuousBatchingManager
from .admin import ADMIN_TIMEOUT_S, ADMIN_WAIT_S
from .errors import APIError
from .preparation import parse_body
from .schemas import Strict
from .settings import ServerSettings


class LoadAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, max_length=128)


def adapter_dir(path: str, allowed_dir: str | None) -> Path:
    """The directory `path` names under `allowed_dir`: PermissionError without one, ValueError outside it."""
    if allowed_dir is None:
        raise PermissionError("loading adapters from disk is off: start the server with --weights-dir")
    if "\x00" in path:
        raise ValueError("the path holds a NUL byte")
    root = Path(allowed_dir).resolve()
    try:
        target = (root / path).resolve()
        is_dir = target.is_dir()
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"the path cannot be resolved: {exc}") from None
    if root != target and root not in target.parents:
        raise ValueError("the path is outside the weights directory")
    if not is_dir:
        raise ValueError(f"{path!r} is not a directory in the weights directory")
    return target


def add_adapter_routes(app: FastAPI, manager: ContinuousBatchingManager, settings: ServerSettings, body) -> None:
    async def run(call, *args):
        try:
            return await asyncio.to_thread(call, *args, timeout=ADMIN_TIMEOUT_S, wait=ADMIN_WAIT_S)
        except AdminBusy as exc:
            raise APIError(409, f"{exc}; retry when it has ended", code="admin_operation_in_progress",
                           headers={"Retry-After": "1"}) from None
        except KeyError as exc:
            raise APIError(404, str(exc.args[0]), "lora_name", "model_not_found") from None
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_path", "invalid_adapter") from None
        except RuntimeError as exc:  # in use by running requests, or an engine that cannot serve adapters
            raise APIError(409, str(exc), "lora_name", "adapter_unavailable") from None

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict:
        req = parse_body(await body(request), LoadAdapterRequest)
        if req.lora_name in settings.served_model_names:
            raise APIError(400, f"`{req.lora_name}` is the base model's name", "lora_name", "invalid_adapter")
        try:
            path = adapter_dir(req.lora_path, settings.weights_dir)
        except PermissionError as exc:
            raise APIError(403, str(exc), "lora_path", "forbidden") from None
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_path", "invalid_adapter") from None
        await run(manager.load_adapter, req.lora_name, str(path))
        return {"object": "lora_adapter", "id": req.lora_name, "loaded": True}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict:
        req = parse_body(await body(request), UnloadAdapterRequest)
        await run(manager.unload_adapter, req.lora_name)
        return {"object": "lora_adapter", "id": req.lora_name, "loaded": False}
