"""LoRA adapters of ranks 8 and 64 on the default model (the embedded SmolLM2-135M), against
PEFT: rows of two adapters (one rsLoRA) and of the base in one batch, prefilled in chunks,
each equal to `model.generate` on PEFT's merge of its adapter (tests/lora_adapters.py).
Marked slow (two PEFT merges of the model and ten reference generations per rank): `make
test-all` runs them."""

from __future__ import annotations

import pytest

from contbatch import ContinuousBatchingConfig
from lora_adapters import ATTENTION, expected, references, served, write_adapters

MAX_NEW = 8
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
         "Water boils at", "The three primary colors are"]


@pytest.mark.slow
@pytest.mark.parametrize("rank", [8, 64])
def test_ranks_on_the_default_model_match_peft(default_model, tmp_path, rank):
    model, tok = default_model
    # A small std: a trained adapter nudges the model; a large one would make it a random net.
    specs = {"full": dict(rank=rank, alpha=2 * rank, seed=1, std=0.02),
             "attn": dict(rank=rank, alpha=16, seed=2, std=0.02, targets=ATTENTION, rslora=True)}
    paths = write_adapters(model, tmp_path, specs)
    refs = references(model, paths)
    prompts = [tok.encode(t) for t in TEXTS]
    names = ["full", None, "attn", "full", "attn"]
    want = expected(refs, prompts, names, MAX_NEW)
    assert want != expected(refs, prompts, [None] * len(prompts), MAX_NEW)  # the adapters change the tokens
    config = ContinuousBatchingConfig(block_size=16, max_batch_tokens=16)  # prompts prefilled in chunks
    got, _ = served(model, config, prompts, names, paths, MAX_NEW)
    assert got == want
