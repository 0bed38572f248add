"""`contbatch generate`: prompts in, JSONL out, a throughput line, clear errors."""

from __future__ import annotations

import json

import pytest

from contbatch.cli import main


def test_generate_from_text_file(tmp_path, capsys, default_model):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\n\nName a primary colour.\n")
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--input", str(prompts), "--output", str(out), "--max-new-tokens", "8", "--quiet"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["What is the capital of France?", "Name a primary colour."]
    assert all(r["status"] == "finished" and 1 <= len(r["generated_tokens"]) <= 8 for r in rows)
    assert "Paris" in rows[0]["text"]
    assert "throughput: 2 requests" in capsys.readouterr().out
    # The GPU layout with carry-over (reference kernels here) gives the same greedy tokens.
    flat = tmp_path / "flat.jsonl"
    args = ["generate", "--input", str(prompts), "--output", str(flat), "--max-new-tokens", "8", "--quiet",
            "--device", "cpu", "--attention-backend", "reference", "--async-batching"]
    assert main(args) == 0
    assert [json.loads(line)["generated_tokens"] for line in flat.read_text().splitlines()] == [
        r["generated_tokens"] for r in rows
    ]


def test_generate_jsonl_messages_and_sampling(tmp_path, capsys, default_model):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "Say hi"}]}) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--input", str(chats), "--output", str(out), "--max-new-tokens", "4", "--quiet",
            "--temperature", "0.7", "--seed", "3"]
    assert main(args) == 0
    first = json.loads(out.read_text())
    assert main(args) == 0
    assert json.loads(out.read_text())["generated_tokens"] == first["generated_tokens"]  # seeded


def test_generate_bad_argument_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--quiet"]) == 2
    assert "not a local model folder" in capsys.readouterr().err


def _run(tmp_path, name: str, *extra: str) -> dict:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\n")
    out = tmp_path / f"{name}.jsonl"
    args = ["generate", "--input", str(prompts), "--output", str(out), "--max-new-tokens", "10", "--quiet", *extra]
    assert main(args) == 0
    return json.loads(out.read_text())


def test_generate_sampling_top_p_and_stop_flags(tmp_path, capsys, default_model, monkeypatch):
    """Seeded sampling is not greedy; `--top-p` reaches the sampler (a tiny nucleus is the
    greedy token, whatever the temperature); `--stop` cuts the text at a stop string. (The
    pytest session's default model is handed to the command: loading it is tested above.)"""
    import contbatch

    monkeypatch.setattr(contbatch, "load_model", lambda *args, **kwargs: default_model)
    greedy = _run(tmp_path, "greedy")
    assert greedy["text"].startswith("The capital of France is Paris")
    sampled = _run(tmp_path, "sampled", "--temperature", "1.5", "--seed", "3")
    assert sampled["generated_tokens"] != greedy["generated_tokens"]
    nucleus = _run(tmp_path, "nucleus", "--temperature", "1.5", "--seed", "3", "--top-p", "0.01")
    assert nucleus["generated_tokens"] == greedy["generated_tokens"]
    stopped = _run(tmp_path, "stopped", "--stop", "Paris", "--stop", "never-there")
    assert stopped["text"] == "The capital of France is " and stopped["finish_reason"] == "stop"
    assert len(stopped["generated_tokens"]) < len(greedy["generated_tokens"])


def test_the_command_preloads_tcmalloc_where_the_machine_has_it(tmp_path, monkeypatch):
    """`contbatch` re-executes itself once with tcmalloc preloaded (contbatch_launcher), unless
    CONTBATCH_MALLOC=system or it is preloaded already; the allocator is logged at start-up."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import contbatch_launcher as launcher

    library = launcher.find_tcmalloc()
    assert launcher.preload_env({"CONTBATCH_MALLOC": "system"}) is None
    assert launcher.preload_env({"LD_PRELOAD": "/x/libtcmalloc.so.4"}) is None
    with pytest.raises(SystemExit, match="CONTBATCH_MALLOC"):
        launcher.preload_env({"CONTBATCH_MALLOC": "jemalloc"})
    env = launcher.preload_env({"LD_PRELOAD": "/x/libother.so"})
    if library is None:
        assert env is None
        pytest.skip("no tcmalloc on this machine: the command runs on glibc's malloc")
    assert env["LD_PRELOAD"] == f"{library} /x/libother.so" and launcher.preload_env(env) is None
    command = Path(sys.executable).parent / "contbatch"
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    args = [str(command), "--log-level", "info", "generate", "--model", str(tmp_path / "none"), "--input",
            str(tmp_path / "in.jsonl")]
    for choice, expected in (("auto", "tcmalloc"), ("system", "glibc malloc")):
        run = subprocess.run(args, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "CONTBATCH_MALLOC": choice, "LD_PRELOAD": ""})
        assert run.returncode == 2 and "not a local model folder" in run.stderr, run.stderr
        assert f"memory allocator {expected}" in run.stderr, run.stderr
