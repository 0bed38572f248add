"""The adapters one base model serves: names, weights, resident slots and their LRU order.

Memory bound: at most `max_loras` adapters are *resident* (their factors on the model's
device, each with a slot index the step's rows name), each of rank at most `max_lora_rank`;
so resident adapter memory is at most `max_loras x max_lora_rank x sum over targeted layers
of (in + out)` elements. Any number more may be registered: they are *parked* in CPU memory
(on a CPU-only machine the same RAM, but the bookkeeping and the bound are the same) and made
resident when a request needs them, in the slot of the least recently used resident adapter
that no live request holds. A request *pins* its adapter from admission to its end, so a slot
never changes under a running request.

Engine-thread state: every mutation runs on the engine thread between two steps (the manager
routes them through its admin commands), which is also the only thread that reads it during a
step (the linear hooks).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .peft_files import LoraWeights

logger = logging.getLogger("contbatch")


@dataclass
class Adapter:
    name: str
    path: str
    weights: LoraWeights
    version: int = 0  # bumped by every weight update: part of the prefix-cache salt
    load: int = 0  # which load of the registry it came from: a name loaded again is another adapter
    slot: int = -1  # resident slot, -1 while parked
    pins: int = 0  # live requests using it


@dataclass
class AdapterRegistry:
    max_loras: int
    max_lora_rank: int
    device: torch.device
    adapters: dict[str, Adapter] = field(default_factory=dict)
    slots: list[Adapter | None] = field(default_factory=list)
    recency: OrderedDict = field(default_factory=OrderedDict)  # resident names, least recently used first
    evictions: int = 0
    loads: int = 0
    _stacks: dict = field(default_factory=dict)  # (slots, module) -> stacked factors; cleared on any change

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and {self.max_lora_rank}")
        self.slots = [None] * self.max_loras

    # -- registration ----------------------------------------------------------------------
    def register(self, name: str, path: str, weights: LoraWeights) -> None:
        """Add an adapter, parked until a request needs it; a name already registered is an error."""
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already loaded: unload it first")
        if weights.rank > self.max_lora_rank:
            raise ValueError(f"adapter {name!r} has rank {weights.rank}, over max_lora_rank={self.max_lora_rank}")
        self.loads += 1
        self.adapters[name] = Adapter(name, path, _moved(weights, torch.device("cpu")), load=self.loads)

    def remove(self, name: str) -> None:
        adapter = self.get(name)
        if adapter.pins:
            raise RuntimeError(f"adapter {name!r} is used by {adapter.pins} running requests: unload it when they end")
        if adapter.slot >= 0:
            self._park(adapter)
        del self.adapters[name]

    def update(self, name: str, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copy new factors into the adapter's tensors in place (resident or parked); returns its new version."""
        adapter = self.get(name)
        for module, (a, b) in factors.items():
            old_a, old_b = adapter.weights.factors[module]
            old_a.copy_(a)
            old_b.copy_(b)
        adapter.version += 1
        self._stacks.clear()
        return adapter.version

    def get(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise KeyError(f"adapter {name!r} is not loaded (loaded: {sorted(self.adapters) or 'none'})")
        return adapter

    # -- residency -------------------------------------------------------------------------
    def acquire(self, name: str) -> int | None:
        """Pin the adapter for one request and return its slot, making it resident first
        (parking the least recently used unpinned one if no slot is free); None when every
        slot is held by running requests (the request waits)."""
        adapter = self.get(name)
        if adapter.slot < 0:
            slot = self._free_slot()
            if slot is None:
                return None
            adapter.weights = _moved(adapter.weights, self.device)
            adapter.slot = slot
            self.slots[slot] = adapter
            self._stacks.clear()
        self.recency[name] = None
        self.recency.move_to_end(name)
        adapter.pins += 1
        return adapter.slot

    def release(self, name: str) -> None:
        adapter = self.adapters.get(name)
        if adapter is not None and adapter.pins > 0:
            adapter.pins -= 1

    def _free_slot(self) -> int | None:
        if None in self.slots:
            return self.slots.index(None)
        for name in self.recency:  # least recently used first
            victim = self.adapters[name]
            if not victim.pins:
                slot = victim.slot
                self._park(victim)
                self.evictions += 1
                return slot
        return None

    def _park(self, adapter: Adapter) -> None:
        self._stacks.clear()
        self.slots[adapter.slot] = None
        adapter.slot = -1
        adapter.weights = _moved(adapter.weights, torch.device("cpu"))
        self.recency.pop(adapter.name, None)

    # -- what a step reads -----------------------------------------------------------------
    def factors(self, slot: int, module: str) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        adapter = self.slots[slot]
        if adapter is None:
            return None
        ab = adapter.weights.factors.get(module)
        return None if ab is None else (ab[0], ab[1], adapter.weights.scale)

    def stacked(self, slots: tuple[int, ...], module: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The factors of `slots` for one layer as `A [G, R, in]` and `scale * B^T [G, R, out]`,
        ranks zero-padded to the largest (zero rank rows add exact zeros), a slot without
        factors for this layer all zeros; None when none has any. Cached until anything changes."""
        key = (slots, module)
        if key not in self._stacks:
            found = [self.factors(s, module) for s in slots]
            present = [f for f in found if f is not None]
            if not present:
                self._stacks[key] = None
            else:
                rank = max(a.shape[0] for a, _, _ in present)
                a0, b0, _ = present[0]
                a_all = a0.new_zeros((len(slots), rank, a0.shape[1]))
                bt_all = b0.new_zeros((len(slots), rank, b0.shape[0]))
                for i, f in enumerate(found):
                    if f is not None:
                        a, b, scale = f
                        a_all[i, : a.shape[0]] = a
                        bt_all[i, : a.shape[0]] = b.T * scale
                self._stacks[key] = (a_all, bt_all)
        return self._stacks[key]

    def salt(self, name: str) -> int:
        """The prefix-cache salt of a request on this adapter: which load it is and its weight
        version (a name unloaded and loaded again, or updated, never reuses older blocks)."""
        adapter = self.get(name)
        return hash(("contbatch-lora", adapter.load, adapter.version))

    def resident(self) -> list[str]:
        return [a.name for a in self.slots if a is not None]

    def describe(self) -> dict:
        return {name: {"path": a.path, "rank": a.weights.rank, "scale": a.weights.scale, "version": a.version,
                       "resident": a.slot >= 0, "modules": len(a.weights.factors)}
                for name, a in list(self.adapters.items())}


def _moved(weights: LoraWeights, device: torch.device) -> LoraWeights:
    if all(a.device == device for a, _ in weights.factors.values()):
        return weights
    return LoraWeights(weights.rank, weights.scale,
                       {m: (a.to(device), b.to(device)) for m, (a, b) in weights.factors.items()})
