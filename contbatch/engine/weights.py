"""New weights for an attached model, in place: what an RL loop does between rollout rounds.

The engine holds no copy of the weights: its steps read the model's own parameters. So an
update is a copy into those tensors while the engine is paused, plus what the copy makes
stale on the engine's side (the prefix cache, the KV of requests in flight), which
`EngineCore.weights_changed` handles. Everything is checked before the first copy: a bad
name or shape changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

INFLIGHT_POLICIES = ("recompute", "keep", "abort")


def check_inflight(inflight: str) -> None:
    if inflight not in INFLIGHT_POLICIES:
        raise ValueError(f"inflight must be one of {INFLIGHT_POLICIES}, got {inflight!r}")


def weight_pairs(model: torch.nn.Module, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) pairs, every one checked: the name is one of the model's parameters or
    persistent buffers, the shape matches, and the dtype is the target's or castable to it
    (floating to floating: a trainer in float32 may feed a bfloat16 engine)."""
    targets = model.state_dict(keep_vars=True)
    items = weights.items() if isinstance(weights, Mapping) else weights
    pairs = []
    for entry in items:
        try:
            name, tensor = entry
        except (TypeError, ValueError):
            raise ValueError(f"weights must be a state dict or (name, tensor) pairs, got {type(entry).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(tensor).__name__}")
        target = targets.get(name)
        if target is None:
            close = [n for n in targets if n.endswith(name) or name.endswith(n)][:3]
            hint = f" (did you mean {close}?)" if close else ""
            raise ValueError(f"unknown weight {name!r}: not a parameter or buffer of {type(model).__name__}{hint}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}")
        if tensor.dtype != target.dtype and not (tensor.is_floating_point() and target.is_floating_point()):
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be copied into the model's {target.dtype}")
        pairs.append((target, tensor))
    return pairs


@torch.no_grad()
def copy_weights(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for target, source in pairs:
        target.copy_(source)


def read_safetensors(path: str | Path, allowed_dir: str | Path | None) -> dict[str, torch.Tensor]:
    """A safetensors file that must lie under `allowed_dir` (the server's `--weights-dir`): a
    client names a file, it never reads an arbitrary path."""
    from safetensors.torch import load_file

    if allowed_dir is None:
        raise PermissionError("loading weights from disk is off: start the server with --weights-dir")
    root = Path(allowed_dir).resolve()
    target = (root / path).resolve()
    if not target.is_relative_to(root):
        raise PermissionError(f"{path!r} is outside the weights directory")
    if target.suffix != ".safetensors" or not target.is_file():
        raise FileNotFoundError(f"no .safetensors file {path!r} in the weights directory")
    return load_file(str(target))
