"""Recurrent state beside the paged KV cache: one slot per request for every recurrent layer.

A state-space, linear-attention or short-convolution layer (a hybrid model's Mamba, Gated
DeltaNet or conv mixer) carries what it has read so far in fixed-size tensors: a convolution
window and a recurrent state, per layer, per request. They cannot live in KV blocks (they are
not per token), so each request holds a *slot*: row `slot` of every recurrent layer's state
tensors `[capacity, ...]`.

Contract (the engine core keeps it; `attention/recurrent.py` reads and writes the rows):
- a request's slot is assigned when it computes its first token (`assign`), so a request that
  starts over (soft reset, stale weights) gets a clean slot, and it is released when the
  request ends (`release`, from the core's one retire path);
- a request moved to the host tier keeps its slot: the state is a few rows, not blocks, and
  it must survive exactly as the KV does (on a GPU it stays in device memory meanwhile);
- tensors are made on the first write of each layer's state (their shapes come from the
  layer itself, as transformers' own cache learns them) and grow by doubling when more
  requests hold slots than rows exist. Rows are zeroed when assigned; a fresh request reads
  none of them anyway (the layer starts from its own zero state, as in `generate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerStates:
    """One recurrent layer's states, by state index (a layer may keep several, e.g. separate
    convolution windows for its queries, keys and values)."""

    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # [capacity, ..., kernel]
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)  # [capacity, ...]
    kernel_size: dict[int, int] = field(default_factory=dict)


class RecurrentStateCache:
    def __init__(self, device: torch.device | str, initial_slots: int = 8) -> None:
        self.device = torch.device(device)
        self.capacity = max(1, initial_slots)
        self.layers: dict[int, LayerStates] = {}
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))

    # -- slots -----------------------------------------------------------------------------
    def assign(self, request_id: str) -> int:
        """A clean slot for a request computing its first token (its old one, if any, is
        given back first)."""
        self.release(request_id)
        if not self._free:
            self._grow()
        slot = self._free.pop()
        for states in self.layers.values():
            for t in (*states.conv.values(), *states.recurrent.values()):
                t[slot].zero_()
        self.slot_of[request_id] = slot
        return slot

    def slot(self, request_id: str) -> int:
        """The slot of a request that has computed tokens before this step."""
        try:
            return self.slot_of[request_id]
        except KeyError:
            raise RuntimeError(
                f"request {request_id!r} continues a sequence but holds no recurrent state; a recurrent "
                "model's tokens can only be computed in order from its first one"
            ) from None

    def release(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        self.slot_of.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    @property
    def num_assigned(self) -> int:
        return len(self.slot_of)

    # -- rows ------------------------------------------------------------------------------
    def read(self, layer_idx: int, slots: torch.Tensor) -> LayerStates:
        """Copies of the rows `slots` of one layer's states (what a step's rows start from)."""
        states = self.layers.get(layer_idx)
        if states is None:
            return LayerStates()
        return LayerStates(
            {i: t.index_select(0, slots) for i, t in states.conv.items()},
            {i: t.index_select(0, slots) for i, t in states.recurrent.items()},
            dict(states.kernel_size),
        )

    def write(self, layer_idx: int, slots: torch.Tensor, new: LayerStates) -> None:
        """Store the rows a step computed (`new`'s tensors are `[len(slots), ...]`)."""
        states = self.layers.setdefault(layer_idx, LayerStates())
        for mine, theirs in ((states.conv, new.conv), (states.recurrent, new.recurrent)):
            for i, rows in theirs.items():
                if rows is None:
                    continue
                table = mine.get(i)
                if table is None or table.shape[1:] != rows.shape[1:] or table.dtype != rows.dtype:
                    table = mine[i] = torch.zeros((self.capacity, *rows.shape[1:]), dtype=rows.dtype,
                                                  device=self.device)
                table.index_copy_(0, slots, rows.to(table.device))
        states.kernel_size.update({i: k for i, k in new.kernel_size.items() if k is not None})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.layers.values()
                   for t in (*s.conv.values(), *s.recurrent.values()))

    @property
    def bytes_per_request(self) -> int:
        return self.nbytes // self.capacity

    def _grow(self) -> None:
        old = self.capacity
        self.capacity *= 2
        for states in self.layers.values():
            for table in (states.conv, states.recurrent):
                for i, t in table.items():
                    table[i] = torch.cat([t, torch.zeros((old, *t.shape[1:]), dtype=t.dtype, device=t.device)])
        self._free.extend(range(self.capacity - 1, old - 1, -1))
