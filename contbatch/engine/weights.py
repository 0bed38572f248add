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
    summary = getattr(model, "contbatch_quantization", None)  # setup/quantize.py's record of quantized layers
    if summary is not None:
        raise ValueError(f"update_weights() takes float weights, and {summary.quantized_layers} of this model's linear "
                         f"layers hold packed {summary.method} weights (quantized at load): load the model without "
                         "quantization (or with dequantize=True) to update its weights")
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
        target = check_target(model, targets, name, tuple(tensor.shape))
        if tensor.dtype != target.dtype and not (tensor.is_floating_point() and target.is_floating_point()):
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be copied into the model's {target.dtype}")
        pairs.append((target, tensor))
    return pairs


def check_target(model: torch.nn.Module, targets: Mapping[str, torch.Tensor], name: str,
                 shape: tuple[int, ...]) -> torch.Tensor:
    """The model's tensor called `name`, or `ValueError` if it has none or another shape."""
    target = targets.get(name)
    if target is None:
        close = [n for n in targets if isinstance(name, str) and (n.endswith(name) or name.endswith(n))][:3]
        hint = f" (did you mean {close}?)" if close else ""
        raise ValueError(f"unknown weight {name!r}: not a parameter or buffer of {type(model).__name__}{hint}")
    if shape != tuple(target.shape):
        raise ValueError(f"{name}: shape {shape} does not match the model's {tuple(target.shape)}")
    return target


@torch.no_grad()
def copy_weights(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for target, source in pairs:
        target.copy_(source)


MAX_PATH_BYTES = 4096  # PATH_MAX on Linux; a component holds at most 255 bytes (NAME_MAX)


def weights_file(path: str, allowed_dir: str | Path | None) -> Path:
    """The `.safetensors` file `path` names under `allowed_dir` (the server's `--weights-dir`):
    a client names a file, it never reads an arbitrary path. `PermissionError` when loading from
    disk is off; `ValueError` naming the problem for every other bad path (NUL bytes, text that
    is not UTF-8, over-long names, symlink loops, a path outside the folder, a directory, a
    missing file)."""
    if allowed_dir is None:
        raise PermissionError("loading weights from disk is off: start the server with --weights-dir")
    if not isinstance(path, str) or not path:
        raise ValueError("path must be a non-empty string naming a .safetensors file in the weights directory")
    if "\x00" in path:
        raise ValueError("the path holds a NUL byte")
    try:
        raw = path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the path is not valid Unicode text (a lone surrogate)") from None
    if len(raw) > MAX_PATH_BYTES or any(len(part.encode()) > 255 for part in path.split("/")):
        raise ValueError(f"the path is too long (at most {MAX_PATH_BYTES} bytes, 255 per name)")
    root = Path(allowed_dir).resolve()
    try:
        target = (root / path).resolve()
        is_file = target.is_file()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise ValueError(f"the path {path!r} cannot be resolved: {exc}") from None
    if not target.is_relative_to(root):
        raise ValueError(f"{path!r} is outside the weights directory")
    if target.suffix != ".safetensors":
        raise ValueError(f"{path!r} is not a .safetensors file")
    if not is_file:
        what = "a directory" if target.is_dir() else "not an existing file"
        raise ValueError(f"{path!r} is {what} in the weights directory")
    return target


def read_safetensors(path: str, allowed_dir: str | Path | None, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of a `.safetensors` file under `allowed_dir` (`weights_file`), their names
    and shapes checked against `model` from the file's header before any tensor is read (a
    file larger than the model is never loaded). A file that is empty, truncated or corrupt is
    a `ValueError` naming it."""
    from safetensors import safe_open

    target = weights_file(path, allowed_dir)
    targets = model.state_dict(keep_vars=True)

    def unreadable(exc: Exception) -> ValueError:  # SafetensorError, OSError, a header that does not parse
        return ValueError(f"{path!r} is not a valid safetensors file: {type(exc).__name__}: {exc}")

    try:
        handle = safe_open(str(target), framework="pt")
    except Exception as exc:
        raise unreadable(exc) from None
    with handle as f:
        try:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except Exception as exc:
            raise unreadable(exc) from None
        for name, shape in shapes.items():
            check_target(model, targets, name, shape)
        try:
            return {name: f.get_tensor(name) for name in shapes}
        except Exception as exc:
            raise unreadable(exc) from None
