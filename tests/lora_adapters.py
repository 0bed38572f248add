"""For the tests: LoRA adapters written by PEFT itself, PEFT's merged reference model, and one
engine run of a batch of requests on adapters.

The reference never goes through contbatch/lora/: PEFT wraps a copy of the base model
(`LoraConfig` + `get_peft_model`), the test gives its factors seeded random values (B nonzero,
else the adapter would change nothing), PEFT writes the directory (`save_pretrained`), and
`PeftModel.from_pretrained(copy, dir).merge_and_unload()` is the model whose `model.generate`
tokens the engine (base weights, adapters unmerged) must reproduce.
"""

from __future__ import annotations

import copy
import os

import torch

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from contbatch.cpu.routers.layer import LayerRouter
from conftest import reference_generate

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def write_adapter(model: torch.nn.Module, path: str, *, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                  targets=ATTENTION + MLP, rslora: bool = False, std: float = 0.1, **config) -> str:
    """A PEFT LoRA adapter directory for `model`, written by PEFT, with A and B drawn from
    N(0, std^2) by a generator seeded with `seed`. `config`: more `LoraConfig` fields (e.g.
    `use_dora=True`, for the refusal tests)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, **config)
    wrapped = get_peft_model(copy.deepcopy(model), lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(wrapped.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    wrapped.save_pretrained(path)
    return path


def merged(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """PEFT's own merge of the adapter at `path` into a copy of `model`: the reference."""
    from peft import PeftModel

    out = PeftModel.from_pretrained(copy.deepcopy(model), path).merge_and_unload()
    return out.eval()


def references(model: torch.nn.Module, paths: dict[str, str]) -> dict:
    """{None: the base model, name: its merged reference} for every adapter in `paths`."""
    return {None: model, **{name: merged(model, path) for name, path in paths.items()}}


def expected(refs: dict, prompts: list[list[int]], names: list, max_new: int) -> list[list[int]]:
    """Each row's reference tokens: `model.generate` greedy on the merged model of its adapter."""
    return [reference_generate(refs[n], p, max_new) for p, n in zip(prompts, names)]


def served(model: torch.nn.Module, config: ContinuousBatchingConfig, prompts: list[list[int]], names: list,
           paths: dict[str, str], max_new: int) -> tuple[list[list[int]], dict]:
    """The engine's greedy tokens for `prompts` on the adapters `names` (None: the base), with
    every adapter of `paths` loaded; and the manager's stats, with the speculative proposals and
    the one-call CPU layers' checked kinds of step (`fused_checked`) and verdict (`fused_enabled`)."""
    manager = ContinuousBatchingManager(model, config=config)
    manager.start()
    try:
        for name, path in paths.items():
            manager.load_adapter(name, path)
        ids = manager.add_requests(prompts, max_new_tokens=max_new, adapters=names)
        outs = {rid: manager.get_result(rid, timeout=300) for rid in ids}
        for out in outs.values():
            assert out.error is None, out.error
        stats = manager.stats()
        stats["spec_draft_tokens"] = sum(o.spec_draft_tokens for o in outs.values())
        routers = getattr(getattr(manager, "_routers", None), "routers", ())
        layer = next((r for r in routers if isinstance(r, LayerRouter)), None)
        stats["fused_checked"] = set() if layer is None else {kind for _, _, kind in layer.shared.checked}
        stats["fused_enabled"] = layer is not None and layer.shared.enabled
    finally:
        manager.stop()
        manager.destroy()
    return [outs[rid].generated_tokens for rid in ids], stats


def write_adapters(model: torch.nn.Module, root, specs: dict[str, dict]) -> dict[str, str]:
    """{name: directory} of adapters `write_adapter` writes under `root`, one per spec (its keywords)."""
    return {name: write_adapter(model, os.path.join(str(root), name), **spec) for name, spec in specs.items()}
