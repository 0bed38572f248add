"""Tensor parallelism on the CPU: two gloo ranks on this machine, each a real process.

Every run goes through `contbatch.distributed.spawn` (or the CLI's own launcher) with a
timeout, so a hang fails the test instead of the suite. The model is a tiny float32 Llama with
4 heads and 2 KV heads (one KV head per rank at TP=2) and the default model's tokenizer, so
the server test can template chats. Ground truth is `model.generate` on an unsharded copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from contbatch import ContinuousBatchingConfig, generate_batch, load_model
from contbatch.cli import main as cli_main
from contbatch.distributed import spawn
from contbatch.sampling.params import SamplingParams

from conftest import reference_generate

RANK_SCRIPT = str(Path(__file__).with_name("tp_rank.py"))
RUN_TIMEOUT = 150  # seconds for a whole two-rank run: loading twice on two cores, then the scenario


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return load_model(tiny_dir)


def run_ranks(tiny_dir: Path, tmp_path: Path, scenario: str, *extra: str) -> tuple[int, dict, dict | None]:
    out, worker_out = tmp_path / "rank0.json", tmp_path / "rank1.json"
    cmd = [sys.executable, RANK_SCRIPT, "--model", str(tiny_dir), "--scenario", scenario, "--out", str(out),
           "--worker-out", str(worker_out), *extra]
    status = spawn(2, cmd, timeout=RUN_TIMEOUT)
    assert status != 124, f"the {scenario} run hung past {RUN_TIMEOUT} s"
    if not out.exists():  # rank 0 died (on purpose): the worker's report is the result
        return status, {}, json.loads(worker_out.read_text()) if worker_out.exists() else None
    result = json.loads(out.read_text())
    assert "exception" not in result, result["exception"]
    return status, result, json.loads(worker_out.read_text()) if worker_out.exists() else None


def test_tp2_greedy_equals_single_process_and_drains(tiny_dir, tmp_path, reference):
    status, res, worker = run_ranks(tiny_dir, tmp_path, "generate")
    assert status == 0
    # Loaded sharded: DTensor weights, 2 of the 4 query heads (16 dims each) and 1 of the 2 KV
    # heads here; the cache holds that one KV head.
    assert res["sharding"] == {"dtensor": True, "q_proj_global": [64, 64], "q_proj_local": [32, 64],
                               "k_proj_local": [16, 64]}
    assert res["resolved"] == {"num_blocks": 256, "tp_size": 2, "tp_rank": 0, "tp_backend": "gloo",
                               "kv_heads_per_rank": 1}
    # Greedy tokens: model.generate's, and the single-process engine's with the same config.
    model, _ = reference
    expected = [reference_generate(model, p, 12) for p in res["prompts"]]
    assert res["tokens"] == expected and res["statuses"] == ["finished"] * len(expected)
    # The first prompt heads the long request's prompt: it is reused from that request's blocks,
    # its last partly filled one copied on every rank (a host op sent with the step).
    assert res["cached_tokens"][0] == len(res["prompts"][0]) - 1 and (len(res["prompts"][0]) - 1) % 4
    single = generate_batch(model, res["prompts"], None,
                            ContinuousBatchingConfig(block_size=4, max_batch_tokens=48, num_blocks=256),
                            progress_bar=False, sampling_params=SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [r.generated_tokens for r in single.values()] == expected
    # The cancel reached the batch (it stopped short) and the graceful stop reached the worker:
    # it ran every step rank 0 sent, then left its loop cleanly, and destroy() twice was fine.
    assert res["cancelled"] == "cancelled" and res["cancelled_tokens"] < 300
    assert worker == {"steps": res["steps_sent"]} and res["steps_sent"] > 0
    assert res["destroyed_twice"]


def test_tp_size_not_dividing_kv_heads_refused_at_start(tiny_dir, capsys, monkeypatch):
    status = cli_main(["generate", "--model", str(tiny_dir), "--tensor-parallel-size", "3", "--quiet"])
    err = capsys.readouterr().err
    assert status == 2
    assert "tensor parallel size 3" in err and "num_key_value_heads=2" in err and "sizes that work: 1, 2" in err
    # The library refuses it the same way, before it initializes any process group.
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"size 3 does not divide .*num_key_value_heads=2.*sizes that work: 1, 2"):
        load_model(tiny_dir, tp_plan="auto")
    assert not torch.distributed.is_initialized()


def test_request_api_on_a_worker_rank_raises(llama_model):
    """A worker rank's manager only runs rank 0's steps: every request call says so."""
    from contbatch import ContinuousBatchingManager
    from contbatch.distributed import TensorParallel

    manager = ContinuousBatchingManager(llama_model, None, ContinuousBatchingConfig(block_size=4, num_blocks=16))
    manager.tensor_parallel = TensorParallel(rank=1, size=2, backend="gloo", timeout_s=1.0, group=None)
    calls = [manager.start, lambda: manager.add_request([5, 6, 7]), lambda: manager.add_requests([[5, 6]]),
             lambda: manager.get_result("x", timeout=0), lambda: manager.cancel_request("x"), manager.pause,
             lambda: list(manager.request_id_iter("x"))]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 of 2 \(worker.*only rank 0 takes requests"):
            call()
    manager.tensor_parallel = None
    manager.destroy()


def test_tp2_ngram_speculation_is_exact(tiny_dir, tmp_path, llama_model):
    """Prompt-lookup speculation under TP: rank 0 proposes and verifies, the workers run the
    k + 1-row steps it sends; tokens equal `generate`'s. The model is the 512-token tiny Llama
    of the other engine tests (its greedy outputs repeat themselves, so lookup finds proposals),
    saved with tiny_dir's tokenizer files (the scenario never decodes)."""
    import shutil

    loopy = tmp_path / "loopy"
    llama_model.save_pretrained(loopy)
    for f in tiny_dir.iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, loopy / f.name)
    status, res, worker = run_ranks(loopy, tmp_path, "speculative")
    assert status == 0 and res["drafted"] > 0
    assert res["tokens"] == [reference_generate(llama_model, p, 16) for p in res["prompts"]]
    assert worker == {"steps": res["steps_sent"]}


def test_draft_model_speculation_refused_under_tp():
    """A draft model's own steps would run on rank 0 alone: refused on every rank, with the way out."""
    from contbatch.distributed import TensorParallel

    sent = []
    for rank in (0, 1):
        tp = TensorParallel(rank=rank, size=2, backend="gloo", timeout_s=1.0, group=object())

        def broadcast(box, rank=rank):  # what rank 0 sends is what every rank gets
            if rank == 0:
                sent.append(box[0])
            else:
                box[0] = sent[0]

        tp._broadcast = broadcast
        config = ContinuousBatchingConfig(speculative_config={"method": "draft_model", "model": "draft-folder"})
        with pytest.raises(ValueError, match=r"draft-model speculative decoding is not supported under tensor "
                                             r"parallelism.*'ngram'"):
            tp.share_config(config if rank == 0 else None)


@pytest.mark.slow
def test_tp2_exact_under_kv_pressure_with_offload(tiny_dir, tmp_path, reference):
    status, res, worker = run_ranks(tiny_dir, tmp_path, "pressure")
    assert status == 0 and res["offloads"] > 0 and res["restores"] == res["offloads"]
    model, _ = reference
    assert res["tokens"] == [reference_generate(model, p, 16) for p in res["prompts"]]
    assert worker == {"steps": res["steps_sent"]}


def test_tp2_hard_stop_fails_on_rank0_and_stops_the_worker(tiny_dir, tmp_path):
    status, res, worker = run_ranks(tiny_dir, tmp_path, "hard_stop")
    assert status == 0
    assert res["statuses"] == ["failed"] * 3
    assert all("hard stop" in e for e in res["errors"])
    assert worker == {"steps": res["steps_sent"]}  # stopped by rank 0, not killed


@pytest.mark.slow
def test_tp2_killed_worker_fails_every_request_clearly(tiny_dir, tmp_path):
    status, res, worker = run_ranks(tiny_dir, tmp_path, "kill", "--worker-pid-file", str(tmp_path / "pid"))
    assert worker is None  # it was killed
    assert res["statuses"] == ["failed"] * 3
    # Killed mid-forward (a collective fails) or between steps (rank 0's send fails): either way
    # the error names the cause.
    assert all("tensor-parallel" in e and "worker rank" in e for e in res["errors"]), res["errors"]
    assert res["seconds"] < 30
    assert "not running" in res["late_add"]  # the engine ended: new requests are refused, not lost


@pytest.mark.slow
def test_tp2_dead_driver_ends_the_worker(tiny_dir, tmp_path):
    t0 = time.perf_counter()
    status, res, worker = run_ranks(tiny_dir, tmp_path, "kill_driver")
    assert status == -signal.SIGKILL and res == {}
    # The worker saw rank 0 go (its socket closed) and ended itself with the reason: a worker
    # still waiting 30 s after rank 0's death is killed by the launcher and leaves no report.
    assert worker is not None and "rank 1 of 2" in worker["rank_failure"], worker
    assert time.perf_counter() - t0 < RUN_TIMEOUT


@pytest.mark.slow
def test_tp2_frozen_driver_ends_the_group(tiny_dir, tmp_path, monkeypatch):
    """Rank 0 hangs while idle (SIGSTOP): its sockets stay open, but its heartbeat stops, so the
    worker gives up after CONTBATCH_TP_TIMEOUT and exits 1; the launcher then gives rank 0 its
    bound (the timeout + WORKER_EXIT_GRACE_S) and kills it."""
    from contbatch.distributed.launch import WORKER_EXIT_GRACE_S

    monkeypatch.setenv("CONTBATCH_TP_TIMEOUT", "5")
    t0 = time.perf_counter()
    status, res, worker = run_ranks(tiny_dir, tmp_path, "freeze_driver")
    assert status == -signal.SIGKILL and res == {}
    assert worker is not None and "rank 0 (the driver) stopped answering within 5 s" in worker["rank_failure"], worker
    assert time.perf_counter() - t0 < 60 + 5 + WORKER_EXIT_GRACE_S  # start-up, the timeout, the bound


@pytest.mark.slow
def test_tp2_frozen_worker_fails_requests_after_the_timeout(tiny_dir, tmp_path, monkeypatch):
    """A worker that hangs (SIGSTOP) rather than dies: its sockets stay open, so only the
    collectives' timeout (CONTBATCH_TP_TIMEOUT) ends rank 0's wait."""
    monkeypatch.setenv("CONTBATCH_TP_TIMEOUT", "5")
    status, res, worker = run_ranks(tiny_dir, tmp_path, "hang", "--worker-pid-file", str(tmp_path / "pid"))
    assert res["statuses"] == ["failed"] * 3
    assert all("tensor-parallel" in e for e in res["errors"]), res["errors"]
    assert 4 < res["seconds"] < 30
    assert "not running" in res["late_add"]


def _free_port() -> int:
    from contbatch.distributed.launch import free_port

    return free_port()


@pytest.mark.slow
def test_tp2_server_answers_openai_client_like_tp1(tiny_dir, reference):
    port = _free_port()
    cmd = [sys.executable, "-m", "contbatch.cli", "serve", "--model", str(tiny_dir), "--tensor-parallel-size", "2",
           "--block-size", "16", "--num-blocks", "256", "--served-model-name", "tiny", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + RUN_TIMEOUT
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{proc.stdout.read()}"
            assert time.time() < deadline, "the TP=2 server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        model, tok = reference
        messages = [{"role": "user", "content": "Name a colour."}]
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        expected = tok.decode(reference_generate(model, prompt, 16), skip_special_tokens=True)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert resp.choices[0].message.content == expected and resp.usage.completion_tokens == 16
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200  # still serving after the stream
        proc.send_signal(signal.SIGTERM)  # to the launcher: rank 0 drains, then stops the worker
        assert proc.wait(timeout=60) == 0
        out = proc.stdout.read()
        assert "tensor_parallel: rank 0 of 2 (gloo), 1 KV heads per rank" in out
        assert "rank 1 of 2 (worker" in out and "stopped by rank 0" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_launcher_fails_the_group_when_a_worker_dies(caplog):
    """A worker that dies while rank 0 runs makes the launcher's status non-zero, with one line
    that names the rank and how it ended, even when rank 0 itself exits 0."""
    rank1_dies = ("import os, sys, time\n"
                  "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), 9)\n"
                  "time.sleep(1.5)\n")
    with caplog.at_level("ERROR", logger="contbatch"):
        status = spawn(2, [sys.executable, "-c", rank1_dies], timeout=60)
    assert status == 1
    [line] = [r.getMessage() for r in caplog.records if "rank 1" in r.getMessage()]
    assert "was killed by SIGKILL while rank 0 was running" in line and "launcher exits with status 1" in line


def start_tp_server(tiny_dir: Path, tmp_path: Path, **env: str) -> tuple[subprocess.Popen, str, Path]:
    """`contbatch serve --tensor-parallel-size 2`, healthy; (launcher process, URL, its log)."""
    port = _free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "contbatch.cli", "serve", "--model", str(tiny_dir), "--tensor-parallel-size", "2",
           "--block-size", "16", "--num-blocks", "256", "--served-model-name", "tiny", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + RUN_TIMEOUT
    while _health(url) != 200:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()}"
        assert time.time() < deadline, "the TP=2 server did not come up"
        time.sleep(0.2)
    return proc, url, log


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def _rank_pids(log: Path) -> list[int]:
    import re

    match = re.search(r"started 2 tensor-parallel ranks \(pids (\d+), (\d+)\)", log.read_text())
    assert match, log.read_text()
    return [int(match.group(1)), int(match.group(2))]


def _health_until_exit(proc: subprocess.Popen, url: str, limit: float) -> tuple[list[int | None], float]:
    """/health, polled until the launcher exits (at most `limit` seconds): the statuses seen
    (None: no answer) and the seconds it took."""
    seen, t0 = [], time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < limit:
        status = _health(url)
        if not seen or seen[-1] != status:
            seen.append(status)
        time.sleep(0.02)
    return seen, time.monotonic() - t0


@pytest.mark.slow
def test_tp2_server_ends_when_a_worker_is_killed(tiny_dir, tmp_path):
    """No request in flight: rank 0's heartbeat finds the dead worker, /health says 503 at
    once, and the launcher exits non-zero (a supervisor restarts it) instead of answering 503
    forever."""
    proc, url, log = start_tp_server(tiny_dir, tmp_path, CONTBATCH_TP_TIMEOUT="5")
    worker = _rank_pids(log)[1]
    try:
        os.kill(worker, signal.SIGKILL)
        seen, seconds = _health_until_exit(proc, url, 60)
        assert proc.poll() is not None, f"the server still runs {seconds:.0f} s after its worker died: {seen}"
        assert proc.returncode == 1
        assert seen[0] == 200 and 503 in seen, seen  # 200 until the heartbeat saw it, then 503, then gone
        assert seconds < 20
        out = log.read_text()
        assert f"tensor-parallel rank 1 (pid {worker}) was killed by SIGKILL while rank 0 was running" in out
        assert "the tensor-parallel group failed, so this server drains and exits with status 1" in out
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _rank_pids(log):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_tp2_server_ends_when_a_worker_hangs(tiny_dir, tmp_path):
    """A frozen worker (SIGSTOP: alive, its sockets open) while the server idles: the heartbeat's
    round trip times out after CONTBATCH_TP_TIMEOUT, /health says 503, the server drains and
    exits non-zero, and the launcher kills the frozen rank rather than waiting for it."""
    proc, url, log = start_tp_server(tiny_dir, tmp_path, CONTBATCH_TP_TIMEOUT="5")
    worker = _rank_pids(log)[1]
    try:
        os.kill(worker, signal.SIGSTOP)
        t0 = time.monotonic()
        seen, seconds = _health_until_exit(proc, url, 60)
        assert proc.poll() is not None, f"the server still runs {seconds:.0f} s after its worker froze: {seen}"
        assert proc.returncode == 1
        assert seen[0] == 200 and 503 in seen, seen
        assert 4 < time.monotonic() - t0 < 30  # the timeout, then the drain and a short grace
        out = log.read_text()
        assert "stopped answering within 5 s" in out and "exits with status 1" in out
        assert "rank 1 did not exit after rank 0; killing it" in out
        with pytest.raises(ProcessLookupError):  # reaped: no frozen rank left behind
            os.kill(worker, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _rank_pids(log):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_cli_generate_tp2_writes_what_tp1_writes(tiny_dir, tmp_path):
    """`contbatch generate --tensor-parallel-size 2` starts its ranks itself; same JSONL as TP=1."""
    args = ["generate", "--model", str(tiny_dir), "--max-new-tokens", "8", "--block-size", "4",
            "--max-batch-tokens", "32", "--ignore-eos", "--quiet"]
    assert cli_main([*args, "--output", str(tmp_path / "tp1.jsonl")]) == 0
    assert cli_main([*args, "--tensor-parallel-size", "2", "--output", str(tmp_path / "tp2.jsonl")]) == 0
    tp1 = (tmp_path / "tp1.jsonl").read_text()
    assert tp1 and (tmp_path / "tp2.jsonl").read_text() == tp1
