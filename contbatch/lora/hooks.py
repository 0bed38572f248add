"""The LoRA contribution, added to a linear layer's output by a forward hook.

For each adapter slot in the step (`segments.py`): `out[rows] += (x[rows] @ A^T) @ (scale * B)^T`;
rows of no adapter add exact zeros. The products come back to their rows by a gather (a CPU
scatter-add sorts its index on every call). The groups run as two batched products padded to
the largest group (the registry's stacked factors, ranks zero-padded to the largest), or one
group at a time where padding would more than double the rows (`segments.lora_products`). A forward
hook runs after whatever forward the layer has, so it composes with the CPU linear router
(`cpu/routers/linear.py` patches `forward`; hooks live apart from it) and with any kernel the
router chose. The fused CPU decoder layers call their linears' kernels themselves: they ask
each hook for its factors (`add_lora.lora_factors`) and run the same ops in their one call
(`cpu/routers/layer.py`, checked bit-identical against the layer's own forward, which goes
through here).

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
from .segments import lora_products

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
            logger.info("contbatch: LoRA hooks on %d linear layers (the one-call CPU decoder layer runs their "
                        "products itself)", len(self.handles))

    def remove_all(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()

    def _hook(self, name: str):
        registry, active_step = self.registry, self.active_step

        def add_lora(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            meta = active_step()
            step = getattr(meta, "lora", None) if meta is not None else None
            factors = lora_factors(step)
            if factors is None:
                return None
            x = args[0].reshape(-1, module.in_features)
            out = output.reshape(-1, module.out_features)  # a view where it can be: then updated in place
            if x.shape[0] != step.num_tokens:
                raise RuntimeError(f"LoRA on {name!r}: the layer saw {x.shape[0]} rows in a step of "
                                   f"{step.num_tokens} tokens (only per-token layers can take adapters)")
            out.add_(lora_products(x, *factors, step))  # factors: [G, R, in], [G, R, out] (scale folded in)
            return out.view(output.shape)

        def lora_factors(step) -> tuple[torch.Tensor, torch.Tensor] | None:
            """This layer's stacked factors for a step's groups, None where none applies: what
            the fused CPU layer (cpu/routers/layer.py) asks a LoRA hook for, to run the same ops
            inside its one call."""
            return None if step is None else registry.stacked(step.slots, name)

        add_lora.lora_factors = lora_factors
        return add_lora
