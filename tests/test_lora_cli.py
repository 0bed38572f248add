"""`contbatch generate --lora NAME=PATH`: every prompt on the adapter, equal to the merged
model's greedy tokens; bad flags and unsupported setups refused at start with the reason."""

from __future__ import annotations

import json

import pytest

from contbatch import load_model
from contbatch.cli import main
from conftest import reference_generate
from lora_adapters import merged, write_adapter


def test_generate_with_an_adapter(tiny_dir, tmp_path):  # noqa: F811
    model, tok = load_model(tiny_dir)
    path = write_adapter(model, str(tmp_path / "ad"), rank=8, alpha=16, seed=5, std=0.3)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\nOnce upon a time\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", str(tiny_dir), "--input", str(prompts), "--output", str(out), "--quiet",
            "--max-new-tokens", "6", "--ignore-eos", "--no-chat-template", "--block-size", "16",
            "--lora", f"ad={path}"]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ref = merged(model, path)
    for row in rows:
        ids = tok.encode(row["prompt"])
        assert row["generated_tokens"] == reference_generate(ref, ids, 6) != reference_generate(model, ids, 6)


@pytest.mark.parametrize("extra, message", [
    (["--lora", "no-equals-sign"], None),
    (["--lora", "a=/x", "--adapter", "b"], "not one of the --lora names"),
    (["--lora", "a=/x", "--lora", "a=/y"], "given twice"),
    (["--lora", "a=/x", "--tensor-parallel-size", "2"], "tensor parallelism"),
    (["--lora", "a=/x", "--ray-replicas", "2"], "Ray replicas"),
])
def test_bad_lora_flags(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--quiet", *extra])
    text = str(exc.value.code) + capsys.readouterr().err
    assert ("NAME=PATH" if message is None else message) in text
