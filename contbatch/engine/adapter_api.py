"""The manager's public LoRA calls (mixed into `ContinuousBatchingManager`, whose state it uses:
`_adapters`, and the admin commands of `control.py`).

Each call that changes the adapters is an admin command: one at a time with the others
(pause, weights, ...), run on the engine thread between two steps. See engine/adapters.py for
what happens to requests, and docs/lora.md for the contracts.
"""

from __future__ import annotations

import logging
import threading

from .adapters import ADAPTER_COMMAND, EngineAdapters

__all__ = ["AdapterControl", "EngineAdapters"]

logger = logging.getLogger("contbatch")


class AdapterControl:
    def load_adapter(self, name: str, path: str, *, timeout: float | None = None, wait: float | None = None) -> None:
        """Load a PEFT LoRA adapter directory under `name`; requests then name it (`adapter=`).
        A bad directory, a rank over `max_lora_rank` or a name already loaded is a `ValueError`."""
        weights = self._adapters.read(name, path)  # files checked here, before the engine is involved
        self._admin_command(ADAPTER_COMMAND, ("load", (name, str(path), weights)), timeout, wait)

    def unload_adapter(self, name: str, *, timeout: float | None = None, wait: float | None = None) -> None:
        """Forget an adapter: a `KeyError` if unknown, a `RuntimeError` while requests use it."""
        self._adapters.check_request(name)
        self._admin_command(ADAPTER_COMMAND, ("unload", (name,)), timeout, wait)

    def update_adapter_weights(self, name: str, state_dict: dict, *, timeout: float | None = None,
                               wait: float | None = None) -> int:
        """Copy new LoRA factors (PEFT keys, the shapes loaded) into adapter `name` in place,
        between two steps; the base model and other adapters are untouched. Returns the
        adapter's new version: new requests never reuse prefix-cache blocks of older versions,
        running ones keep their KV and compute later tokens with the new factors."""
        self._adapters.check_request(name)
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeError("update_adapter_weights() cannot run in a result handler (the engine thread is "
                               "mid-step)")
        version = self._admin_command(ADAPTER_COMMAND, ("update", (name, dict(state_dict))), timeout, wait)
        logger.info("contbatch: adapter %r weights updated to version %d", name, version)
        return version

    def adapter_names(self) -> list[str]:
        """Names of the loaded adapters (any thread: a snapshot)."""
        return list(self._adapters.registry.adapters)

    def list_adapters(self) -> dict[str, dict]:
        """{name: {path, rank, scale, version, resident, modules}} of the loaded adapters."""
        return self._adapters.registry.describe()
