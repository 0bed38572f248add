"""Reading a PEFT LoRA adapter directory: `adapter_config.json` + `adapter_model.safetensors`.

The contract: a LoRA adapter adds `scale * B @ A` to some linear layers' weights, where for
each targeted layer `A` is `[r, in_features]` and `B` is `[out_features, r]`, and `scale` is
`lora_alpha / r` (or `lora_alpha / sqrt(r)` with `use_rslora`). We keep `A`, `B` and `scale`
apart and never merge them into the base weight, so one base model serves many adapters.

Only what the engine applies exactly is accepted; the rest is a clear `ValueError` naming the
field: another PEFT method (IA3, ...), DoRA, `fan_in_fan_out`, LoRA biases, `modules_to_save`,
per-module rank or alpha patterns, layer replication, activated LoRA, trainable tokens, LoRA on
parameters, a pickled `adapter_model.bin` without safetensors, and a tensor whose shape does
not fit its layer.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclass
class LoraWeights:
    """One adapter's low-rank factors, keyed by the model's module name (`named_modules`)."""

    rank: int
    scale: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.factors.values())


def lora_scale(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
    return float(alpha) / (math.sqrt(rank) if rslora else rank)


def read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} is not a PEFT LoRA adapter: {CONFIG_FILE} is missing")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file!r} could not be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file!r} must hold a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{file!r}: peft_type {kind!r} is not supported (only LORA)")
    refused = {
        "use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights",
        "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        # PEFT fields that change what the adapter computes beyond `scale * B @ A`:
        "lora_bias": "LoRA biases (lora_bias)", "layer_replication": "layer_replication",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
        "trainable_token_indices": "trainable tokens (trainable_token_indices)",
        "target_parameters": "LoRA on parameters (target_parameters)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"{file!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{file!r}: LoRA biases (bias={config['bias']!r}) are not supported")
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"{file!r}: r must be a positive integer, got {r!r}")
    return config


def _module_name(key: str) -> tuple[str, str] | None:
    """('model.layers.0.self_attn.q_proj', 'A') for a PEFT tensor key, None for any other key."""
    name = key.removeprefix(_PREFIX)
    for part in ("A", "B"):
        for tail in (f".lora_{part}.weight", f".lora_{part}.default.weight"):
            if name.endswith(tail):
                return name[: -len(tail)], part
    return None


def load_lora(path: str, model: torch.nn.Module) -> LoraWeights:
    """The adapter at `path`, checked against `model`'s linear layers, in the model's dtype."""
    config = read_config(path)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        pickled = " (adapter_model.bin is not read: save with safe_serialization=True)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise ValueError(f"{path!r} is not a PEFT LoRA adapter: {WEIGHTS_FILE} is missing{pickled}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(file)
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{file!r} could not be read: {exc}") from None
    rank = config["r"]
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        found = _module_name(key)
        if found is None:
            raise ValueError(f"{file!r}: unexpected tensor {key!r} (only lora_A / lora_B weights are supported)")
        pieces.setdefault(found[0], {})[found[1]] = tensor
    if not pieces:
        raise ValueError(f"{file!r} holds no LoRA weights")
    modules = dict(model.named_modules())
    factors = {}
    for name, ab in sorted(pieces.items()):
        layer = modules.get(name)
        if not isinstance(layer, torch.nn.Linear):
            raise ValueError(f"{file!r}: {name!r} is not a linear layer of this model")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{file!r}: {name!r} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, layer.in_features) or tuple(b.shape) != (layer.out_features, rank):
            raise ValueError(f"{file!r}: {name!r} has A {tuple(a.shape)} and B {tuple(b.shape)}; expected "
                             f"{(rank, layer.in_features)} and {(layer.out_features, rank)} for r={rank}")
        w = layer.weight
        factors[name] = (a.to(w.device, w.dtype).contiguous(), b.to(w.device, w.dtype).contiguous())
    scale = lora_scale(config.get("lora_alpha", rank), rank, bool(config.get("use_rslora")))
    return LoraWeights(rank, scale, factors)


Factors = dict[str, tuple[torch.Tensor, torch.Tensor]]


def checked_update(current: LoraWeights, state_dict: dict[str, torch.Tensor]) -> Factors:
    """New factors for `update_adapter_weights`: PEFT keys (with or without the
    `base_model.model.` prefix) of the modules the adapter already targets, same shapes;
    modules not named keep their factors. Checked in full before anything is copied."""
    new = {name: list(ab) for name, ab in current.factors.items()}
    for key, tensor in state_dict.items():
        found = _module_name(key)
        if found is None or found[0] not in new:
            raise ValueError(f"update_adapter_weights: {key!r} is not a LoRA weight of this adapter")
        index = 0 if found[1] == "A" else 1
        old = new[found[0]][index]
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(old.shape):
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"update_adapter_weights: {key!r} has shape {shape}, expected {tuple(old.shape)}")
        new[found[0]][index] = tensor.detach().to(old.device, old.dtype).contiguous()
    return {name: (a, b) for name, (a, b) in new.items()}
