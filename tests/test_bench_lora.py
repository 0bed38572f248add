"""The LoRA benchmark's plumbing (benchmarks/lora.py): its adapters are PEFT adapters whose
merge by the benchmark's check equals PEFT's own, and the flags it hands each server are ones
that server's command line takes."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from conftest import make_tiny_model
from lora_adapters import merged as peft_merged

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import lora as bench  # noqa: E402


def test_adapters_and_their_merge_match_peft(tmp_path):
    model = make_tiny_model("llama", seed=2)
    paths = bench.write_adapters(model, tmp_path, count=2, rank=4)
    assert list(paths) == ["a0", "a1"]
    for path in paths.values():
        ours, peft = bench.merged(model, path).state_dict(), peft_merged(model, path).state_dict()
        assert ours.keys() == peft.keys()
        changed = [k for k in ours if not torch.equal(ours[k], model.state_dict()[k])]
        assert len(changed) == 2 * 7  # every attention and MLP projection of both layers
        for key in ours:
            torch.testing.assert_close(ours[key], peft[key], rtol=0, atol=1e-6)
    again = bench.write_adapters(model, tmp_path, count=2, rank=4)  # reused, not rewritten
    assert again == paths


def test_server_flags(tmp_path):
    from contbatch.cli.main import build_parser

    adapters = {"a0": "/x/a0", "a1": "/x/a1"}
    args = build_parser().parse_args(["serve", *bench.lora_argv("contbatch", adapters, 16)])
    assert (args.lora, args.max_loras, args.max_lora_rank) == ([("a0", "/x/a0"), ("a1", "/x/a1")], 2, 16)
    assert bench.lora_argv("vllm", adapters, 16) == ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                                                     "--lora-modules", "a0=/x/a0", "a1=/x/a1")
