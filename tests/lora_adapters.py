"""For the tests: PEFT-format LoRA adapters with random factors, and the merged reference model.

The reference is built here, independently of contbatch/lora/: the adapter is merged into a
copy of the base model (W + scale * B @ A) and run with `model.generate`.
"""

from __future__ import annotations

import copy
import json
import math
import os

import torch
from safetensors.torch import save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def write_adapter(model: torch.nn.Module, path: str, *, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                  targets=ATTENTION + MLP, rslora: bool = False, std: float = 0.1) -> str:
    """A PEFT LoRA adapter directory for `model` with random A and (nonzero) B."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            a = torch.randn(rank, module.in_features, generator=gen) * std
            b = torch.randn(module.out_features, rank, generator=gen) * std
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "use_rslora": rslora, "bias": "none", "fan_in_fan_out": False, "task_type": "CAUSAL_LM"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return path


def merged(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """A copy of `model` with the adapter at `path` merged into its weights."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    r = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    out = copy.deepcopy(model)
    modules = dict(out.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[key.replace("lora_A", "lora_B")]
                modules[name].weight += scale * (b.double() @ a.double()).float()
    return out
