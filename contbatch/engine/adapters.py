"""The manager's LoRA adapters: loading, unloading, weight updates, and requests that use one.

What runs where: files are read and checked in the caller's thread; the registry
(`lora/registry.py`) changes only on the engine thread, through the manager's admin commands
(one at a time, between two steps, the step in flight applied first). A request naming an
adapter is checked at submission (an unknown name is a `KeyError` there); on the engine thread
it is *admitted*: its adapter is pinned and made resident, its rows get that slot
(`RequestState.lora_slot`) and its prefix-cache blocks a salt of the adapter's name and
weight version (`RequestState.cache_salt`), so two adapters, or two versions of one, never
share KV. A request whose adapter finds every resident slot held by running requests waits
here, in arrival order, until a slot frees. Its end unpins the adapter.

Refused, with the reason, at the first load: tensor parallelism (the adapters would have to be
sharded as their layers are), and compiled steps or CUDA graphs (a replayed or traced step
would not see which rows use which adapter).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

from .. import context
from ..config import ResolvedConfig
from ..lora.hooks import LoraHooks
from ..lora.peft_files import checked_update, load_lora
from ..lora.registry import AdapterRegistry
from ..requests import RequestState, RequestStatus

logger = logging.getLogger("contbatch")

ADAPTER_COMMAND = "adapter"  # the admin command's inbox kind (control.py)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$")


def refusal(resolved: ResolvedConfig, tensor_parallel: object | None) -> str | None:
    """Why this engine cannot serve adapters, or None."""
    if tensor_parallel is not None:
        return "LoRA adapters are not supported under tensor parallelism (they would be sharded as their layers are)"
    if resolved.decode_compile is not None or resolved.varlen_compile is not None or resolved.use_cuda_graph:
        return ("LoRA adapters need eager steps: turn off compiled steps (default_compile_level=0) and CUDA "
                "graphs (use_cuda_graph=False)")
    return None


def _gone(state: RequestState) -> str:
    return f"adapter {state.adapter!r} was unloaded before the request ran"


@dataclass
class EngineAdapters:
    model: torch.nn.Module
    resolved: ResolvedConfig
    tensor_parallel: object | None
    held: list[RequestState] = field(default_factory=list)  # admitted, waiting for a free slot
    registry: AdapterRegistry | None = None
    hooks: LoraHooks | None = None

    def __post_init__(self) -> None:
        device = next(self.model.parameters()).device
        self.registry = AdapterRegistry(self.resolved.max_loras, self.resolved.max_lora_rank, device)
        self.hooks = LoraHooks(self.model, self.registry, context.active_step)

    # -- caller's thread -------------------------------------------------------------------
    def read(self, name: str, path: str):
        """Check the name and engine, and read the adapter's files (no engine state touched)."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"adapter name {name!r} must be 1-128 letters, digits or ._:/@- (starting with a "
                             "letter or digit)")
        why = refusal(self.resolved, self.tensor_parallel)
        if why is not None:
            raise RuntimeError(why)
        weights = load_lora(str(path), self.model)
        out = self.model.get_output_embeddings()
        named = {m: n for n, m in self.model.named_modules()}
        if out is not None and named.get(out) in weights.factors:
            raise ValueError(f"adapter {name!r} targets the output head {named[out]!r}: only per-token layers are "
                             "supported")
        return weights

    def attach(self, groups: list[list[RequestState]], adapters) -> None:
        """Name each group's adapter (one name or None per group), all checked first."""
        if adapters is None:
            return
        if len(adapters) != len(groups):
            raise ValueError(f"got {len(adapters)} adapters for {len(groups)} inputs")
        for name in set(adapters):
            self.check_request(name)
        for states, name in zip(groups, adapters):
            for state in states:
                state.adapter = name

    def check_request(self, adapter: str | None) -> None:
        if adapter is not None and adapter not in self.registry.adapters:
            raise KeyError(f"adapter {adapter!r} is not loaded (loaded: {sorted(self.registry.adapters) or 'none'})")

    # -- engine thread: admin commands -----------------------------------------------------
    def command(self, op: str, args: tuple):
        if op == "load":
            name, path, weights = args
            self.registry.register(name, path, weights)
            self.hooks.sync()
            logger.info("contbatch: adapter %r loaded from %s (rank %d, scale %g, %d layers)", name, path,
                        weights.rank, weights.scale, len(weights.factors))
            return None
        if op == "unload":
            self.registry.remove(args[0])
            self.hooks.sync()
            logger.info("contbatch: adapter %r unloaded", args[0])
            return None
        if op == "update":
            name, state_dict = args
            return self.registry.update(name, checked_update(self.registry.get(name).weights, state_dict))
        raise ValueError(f"unknown adapter operation {op!r}")

    # -- engine thread: requests -----------------------------------------------------------
    def admit(self, state: RequestState, core) -> None:
        """Hand the request to the scheduler once its adapter holds a slot (at once without one)."""
        if state.adapter is None:
            core.scheduler.add(state)
        elif state.adapter not in self.registry.adapters:
            core.retire(state, RequestStatus.FAILED, _gone(state))
        elif self.held or not self._pin(state):
            self.held.append(state)
        else:
            core.scheduler.add(state)

    def _pin(self, state: RequestState) -> bool:
        slot = self.registry.acquire(state.adapter)
        if slot is None:
            return False
        state.lora_slot = slot
        state.cache_salt = self.registry.salt(state.adapter)
        return True

    def retry(self, core) -> None:
        """Admit held requests, in order, while their adapters find slots."""
        while self.held:
            state = self.held[0]
            if state.adapter not in self.registry.adapters:
                self.held.pop(0)
                core.retire(state, RequestStatus.FAILED, _gone(state))
            elif self._pin(state):
                core.scheduler.add(self.held.pop(0))
            else:
                return

    def finished(self, state: RequestState) -> None:
        """A request's output was published: at its end, unpin its adapter (once)."""
        if state.status.is_done and state.lora_slot >= 0:
            state.lora_slot = -1
            self.registry.release(state.adapter)

    def cancel(self, request_id: str, core) -> None:
        """Cancel a request, held here or handed to the core."""
        for i, state in enumerate(self.held):
            if state.request_id == request_id:
                del self.held[i]
                core.retire(state, RequestStatus.CANCELLED)
                return
        core.cancel(request_id)

    def take_held(self) -> list[RequestState]:
        held, self.held = self.held, []
        return held

    def close(self) -> None:
        self.hooks.remove_all()

    def stats(self) -> dict:
        r = self.registry
        return {"lora_loaded": len(r.adapters), "lora_resident": len(r.resident()), "lora_evictions": r.evictions,
                "lora_waiting": len(self.held)}
