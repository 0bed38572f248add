"""Loading models: the embedded GGUF converted once into an empty cache, and `.gguf` paths."""

from __future__ import annotations

import torch
from transformers import AutoConfig

from contbatch.setup import loading as models

from conftest import reference_generate


def test_gguf_conversion_and_gguf_path_from_an_empty_cache(tmp_path, monkeypatch, default_model):
    """From an empty `$CONTBATCH_CACHE`: loading a `.gguf` path works and writes nothing;
    the default model is converted once into a safetensors folder (no `.tmp` left) with a
    manifest and its architecture named, later loads read that folder, and its weights,
    tokenizer and greedy tokens are the GGUF's.
    (Dequantization is the slow part: the real one runs once, shared by both loads.)"""
    cache = tmp_path / "cache"
    monkeypatch.setenv("CONTBATCH_CACHE", str(cache))
    real, memo, calls = models._load_gguf, {}, []

    def load_gguf_once(path, dtype):
        calls.append(path.name)
        if (str(path), dtype) not in memo:
            memo[(str(path), dtype)] = real(path, dtype)
        return memo[(str(path), dtype)]

    monkeypatch.setattr(models, "_load_gguf", load_gguf_once)
    gguf = models.default_gguf_path()
    assert gguf.suffix == ".gguf" and gguf.exists()
    from_gguf, tok = models.load_model(gguf, dequantize=True)  # today's float path
    assert not from_gguf.training and not cache.exists()  # a .gguf path writes nothing

    folder = models.default_model_dir()
    assert folder == cache / models.DEFAULT_MODEL_NAME
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (folder / name).exists(), name
    assert not list(cache.glob("*.tmp*")) and (folder / "contbatch_manifest.json").is_file()
    # Named, other tools load the causal LM (with its head), not a bare LlamaModel.
    assert AutoConfig.from_pretrained(str(folder)).architectures == ["LlamaForCausalLM"]
    converted, ctok = models.load_model()  # reads the folder
    assert models.default_model_dir() == folder and calls == [gguf.name, gguf.name]  # converted once

    theirs = from_gguf.state_dict()
    for name, tensor in converted.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    text = "Continuous batching: 🌍 café"
    assert ctok.encode(text) == tok.encode(text) and ctok.eos_token_id == tok.eos_token_id
    prompt = tok.encode("The capital of France is")
    assert reference_generate(converted, prompt, 4) == reference_generate(from_gguf, prompt, 4)
    session_model, _ = default_model  # what the suite's own cache holds is the same model
    assert reference_generate(session_model, prompt, 4) == reference_generate(converted, prompt, 4)
