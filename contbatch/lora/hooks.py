"""The LoRA contribution, added to a linear layer's output by a forward hook.

For each adapter slot in the step (`segments.py`): `out[rows] += scale * (x[rows] @ A^T) @ B^T`,
by `index_add_`, so rows of other adapters and rows of none are untouched. A step of several
adapters runs them as two batched products over its groups padded to the largest (the
registry's stacked factors, ranks zero-padded to the largest): the count of ops per layer stays
the same whatever the number of adapters in the batch. A forward hook
runs after whatever forward the layer has, so it composes with the CPU linear router
(`cpu/routers/linear.py` patches `forward`; hooks live apart from it) and with any kernel the
router chose. The fused decoder layers call their linears' kernels themselves: a layer with a
hooked linear runs its own forward instead (`cpu/routers/layer.py`), which goes through here.

Outside an engine step (the user's own forward on the same model), or in a step without
adapter rows, the hook returns the base output unchanged. Hooks are installed on the layers
some loaded adapter targets, and removed when the last adapter targeting a layer goes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from .registry import AdapterRegistry

logger = logging.getLogger("contbatch")


class LoraHooks:
    def __init__(self, model: torch.nn.Module, registry: AdapterRegistry, active_step: Callable[[], Any]) -> None:
        self.modules = dict(model.named_modules())
        self.registry = registry
        self.active_step = active_step
        self.handles: dict[str, torch.utils.hooks.RemovableHandle] = {}

    def sync(self) -> None:
        """Hooks on exactly the layers some registered adapter targets."""
        wanted = {m for a in self.registry.adapters.values() for m in a.weights.factors}
        for name in set(self.handles) - wanted:
            self.handles.pop(name).remove()
        added = sorted(wanted - set(self.handles))
        for name in added:
            self.handles[name] = self.modules[name].register_forward_hook(self._hook(name))
        if added:
            logger.info("contbatch: LoRA hooks on %d linear layers (decoder layers holding them run their own "
                        "forward, not the one-call CPU layer)", len(self.handles))

    def remove_all(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()

    def _hook(self, name: str):
        registry, active_step = self.registry, self.active_step

        def add_lora(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            meta = active_step()
            step = getattr(meta, "lora", None) if meta is not None else None
            if step is None:
                return None
            x = args[0].reshape(-1, module.in_features)
            out = output.reshape(-1, module.out_features)  # a view where it can be: then updated in place
            if x.shape[0] != step.num_tokens:
                raise RuntimeError(f"LoRA on {name!r}: the layer saw {x.shape[0]} rows in a step of "
                                   f"{step.num_tokens} tokens (only per-token layers can take adapters)")
            if step.padded is not None:
                stacked = registry.stacked(step.slots, name)
                if stacked is not None:
                    a, bt = stacked  # [G, R, in], [G, R, out] (scale folded in)
                    xs = x.index_select(0, step.padded).view(len(step.slots), -1, module.in_features)
                    h = torch.bmm(xs, a.transpose(1, 2)).masked_fill_(~step.keep, 0)
                    out.index_add_(0, step.padded, torch.bmm(h, bt).view(-1, module.out_features))
                return out.view(output.shape)
            for slot, rows in step.groups:
                factors = registry.factors(slot, name)
                if factors is None:
                    continue
                a, b, scale = factors
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T, alpha=scale)
            return out.view(output.shape)

        return add_lora
