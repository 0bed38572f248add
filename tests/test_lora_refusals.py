"""Adapters the engine cannot apply exactly, written by PEFT itself, are refused at load with a
`ValueError` that names the reason (docs/lora.md, "What is accepted"); the manager is left
with no adapter loaded and still serves the base model."""

from __future__ import annotations

import os

import pytest

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager
from conftest import make_tiny_model, random_prompts, reference_generate
from lora_adapters import ATTENTION, write_adapter


@pytest.fixture(scope="module")
def base():
    return make_tiny_model("llama", seed=4)


@pytest.fixture
def manager(base):
    m = ContinuousBatchingManager(base, config=ContinuousBatchingConfig(block_size=4))
    m.start()
    yield m
    m.stop()
    m.destroy()


def _ia3(model, path: str) -> str:
    import copy

    from peft import IA3Config, get_peft_model

    config = IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    get_peft_model(copy.deepcopy(model), config).save_pretrained(path)
    return path


def _without_weights(model, path: str) -> str:
    write_adapter(model, path)
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    return path


def _pickled(model, path: str) -> str:
    """PEFT's `safe_serialization=False`: adapter_model.bin only."""
    import copy

    from peft import LoraConfig, get_peft_model

    get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(
        path, safe_serialization=False)
    return path


def _with_config(key: str, value):
    """A PEFT LoRA adapter whose config also sets `key` (as PEFT writes it for that feature)."""
    import json

    def write(model, path: str) -> str:
        write_adapter(model, path)
        file = os.path.join(path, "adapter_config.json")
        with open(file) as f:
            config = json.load(f)
        config[key] = value
        with open(file, "w") as f:
            json.dump(config, f)
        return path

    return write


CASES = {
    "dora": (lambda m, p: write_adapter(m, p, use_dora=True), "DoRA is not supported"),
    "ia3": (_ia3, "peft_type 'IA3' is not supported"),
    "lora-bias": (lambda m, p: write_adapter(m, p, lora_bias=True), r"LoRA biases \(lora_bias\)"),
    "another-base": (lambda m, p: write_adapter(make_tiny_model("qwen3"), p, targets=ATTENTION),  # head_dim 32
                     r"'model.layers.0.self_attn.k_proj' has A \(8, 64\) and B \(64, 8\); "
                     r"expected \(8, 64\) and \(32, 8\)"),
    "no-weights": (_without_weights, "adapter_model.safetensors is missing$"),
    "pickled": (_pickled, "adapter_model.bin is not read: save with safe_serialization=True"),
    "layer-replication": (_with_config("layer_replication", [[0, 2], [1, 2]]), "layer_replication is not supported"),
    "activated-lora": (_with_config("alora_invocation_tokens", [5, 6]),
                       r"activated LoRA \(alora_invocation_tokens\) is not supported"),
    "trainable-tokens": (_with_config("trainable_token_indices", [3, 4]),
                         r"trainable tokens \(trainable_token_indices\) is not supported"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_at_load_with_the_reason(base, manager, tmp_path, case):
    write, message = CASES[case]
    path = write(base, str(tmp_path / case))
    with pytest.raises(ValueError, match=message):
        manager.load_adapter("bad", path)
    assert manager.list_adapters() == {}
    prompt = random_prompts(1, 6, 6, seed=3)[0]
    rid = manager.add_request(prompt, max_new_tokens=4)
    assert manager.get_result(rid, timeout=60).generated_tokens == reference_generate(base, prompt, 4)
