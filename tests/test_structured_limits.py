"""Structured-output specs are bounded however they arrive, and compiles that run too long are
stopped: refused before the backend sees them (nesting, size, counts), tried in a worker
process under a time budget, abandoned when nobody waits, never in the way of a small spec or
of a shutdown.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import MODEL, _free_port, _spawn, start_server
from transformers import AutoTokenizer

from contbatch import StructuredOutput
from contbatch.sampling import grammar, limits
from contbatch.sampling.compile_worker import GrammarAbandoned, GrammarTooSlow
from contbatch.sampling.grammar import GrammarCompiler


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def flat_schema(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def slow_schema(objects: int) -> dict:
    """Inside every limit, yet slow to compile: objects of 200 optional properties each (10 of
    them compile in seconds, 40 in minutes)."""
    inner = {"type": "object", "properties": {f"q{i}": {"type": "string"} for i in range(200)}}
    return {"type": "object", "properties": {f"o{j}": inner for j in range(objects)},
            "required": [f"o{j}" for j in range(objects)]}


def deep_text(levels: int) -> str:
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


# -- limits, before the backend parses anything -------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: StructuredOutput(json=deep_text(450)),  # as a string: escaped the body's nesting limit
    lambda: StructuredOutput(json=deep_text(5000)),  # a RecursionError in json.loads
    lambda: StructuredOutput(json="[" * 100_000),
    lambda: StructuredOutput(json=deep_schema(5000)),  # a Python dict: our own walk must not recurse
    lambda: StructuredOutput(json=flat_schema(20_000)),  # flat, small, minutes to compile
    lambda: StructuredOutput(json=flat_schema(2_000)),
    lambda: StructuredOutput(json={"enum": list(range(5000))}),
    lambda: StructuredOutput(json={"anyOf": [{"type": "integer"}] * 2000}),
    lambda: StructuredOutput(json={"type": "string", "pattern": "a{50000}"}),
    lambda: StructuredOutput(regex="[a-z]{1,20000}"),
    lambda: StructuredOutput(regex="a" * 20_000),
    lambda: StructuredOutput(choice=[f"c{i}" for i in range(5000)]),
    lambda: StructuredOutput(grammar="root ::= " + " | ".join(f'"w{i}"' for i in range(20_000))),
], ids=["string-450", "string-5000", "brackets", "dict-5000", "flat-20000", "flat-2000", "enum", "anyOf",
        "pattern-repeat", "regex-repeat", "regex-long", "choices", "grammar-long"])
def test_specs_past_a_limit_are_refused_fast_with_the_limit_named(make):
    start = time.perf_counter()
    with pytest.raises(ValueError, match="at most"):
        make()
    assert time.perf_counter() - start < 2.0


def test_small_specs_are_told_apart():
    assert StructuredOutput(json={"type": "object", "properties": {"a": {"type": "string"}}}).small
    assert StructuredOutput(json_object=True).small and StructuredOutput(choice=["yes", "no"]).small
    assert StructuredOutput(regex=r"[a-z]+@[a-z]+\.com").small
    assert not StructuredOutput(regex=r"\d{3}-\d{4}").small  # counted repetition
    assert not StructuredOutput(json=flat_schema(100)).small
    assert not StructuredOutput(grammar='root ::= "a"').small
    assert StructuredOutput(json=deep_text(30)).json == deep_text(30)  # within the limits: accepted as given


# -- the compiler: budget, abandon, small specs beside slow ones, close -------------------------
@pytest.fixture
def compiler(tiny_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    c = GrammarCompiler(tok, len(tok))
    yield c
    c.close()


def test_a_compile_past_the_budget_is_killed_and_refused(compiler, monkeypatch):
    monkeypatch.setattr(grammar, "COMPILE_BUDGET_S", 0.5)
    future = compiler.compile(StructuredOutput(json=slow_schema(10)))
    with pytest.raises(GrammarTooSlow, match=r"within 0.5 s"):
        future.result(timeout=120)
    assert compiler.stats()["killed"] == 1
    again = compiler.compile(StructuredOutput(json=flat_schema(40)))  # a fresh worker took its place
    assert again.result(timeout=120).memory_size_bytes > 0


def test_a_compile_nobody_waits_for_is_stopped(compiler):
    spec = StructuredOutput(json=slow_schema(40))
    future = compiler.compile(spec)
    twin = compiler.compile(spec)  # a second caller of the same spec shares it
    assert twin is future
    # The compile begins once the worker process has started (it imports the package: seconds,
    # more on a slow machine) and taken the job.
    deadline = time.monotonic() + 60
    while not compiler._trials[spec.key].running():
        assert time.monotonic() < deadline, "the compile never began in a worker process"
        time.sleep(0.05)
    compiler.abandon(spec)
    time.sleep(0.5)
    assert not future.done(), "one caller still waits: the compile goes on"
    compiler.abandon(spec)
    with pytest.raises(GrammarAbandoned):
        future.result(timeout=10)
    assert compiler.stats()["abandoned"] == 1 and compiler.stats()["killed"] == 1


def test_small_specs_compile_beside_slow_ones_and_close_never_waits(compiler):
    slow = [compiler.compile(StructuredOutput(json=slow_schema(40 + i))) for i in range(2)]
    time.sleep(1.0)
    start = time.perf_counter()
    small = compiler.compile(StructuredOutput(regex="(yes|no|maybe)"))
    small.result(timeout=30)
    assert time.perf_counter() - start < 1.0
    start = time.perf_counter()
    compiler.close()
    assert time.perf_counter() - start < 2.0
    for future in slow:
        with pytest.raises(Exception):
            future.result(timeout=10)


# -- over HTTP ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tiny_dir):
    srv = start_server(tiny_dir, worker_threads=2)
    yield srv
    srv.stop()


def _chat(url: str, structured: dict, timeout: float = 120) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "structured_outputs": structured}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


@pytest.mark.parametrize("structured", [{"json": deep_text(450)}, {"json": deep_text(5000)},
                                        {"json": flat_schema(20_000)}], ids=["string-450", "string-5000", "flat"])
def test_schemas_past_the_limits_are_400_at_once(live, structured):
    start = time.perf_counter()
    resp = _chat(live.url, structured)
    assert resp.status_code == 400, resp.text
    assert "at most" in resp.json()["error"]["message"] and resp.json()["error"]["param"] == "structured_outputs"
    assert time.perf_counter() - start < 3.0


def test_a_slow_compile_is_a_400_naming_the_budget(live, monkeypatch):
    monkeypatch.setattr(grammar, "COMPILE_BUDGET_S", 0.5)
    resp = _chat(live.url, {"json": slow_schema(11)})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "structured_output_too_complex" and "0.5 s" in error["message"]


def test_slow_compiles_hold_up_neither_small_specs_nor_plain_requests(live):
    """Two clients send schemas that compile for minutes and hang up; meanwhile small specs and
    plain requests are served as if alone, and the abandoned compiles are stopped."""
    compiler = live.manager._builder.grammar_compiler()
    before = compiler.stats()
    def hang_up(i: int) -> None:
        with pytest.raises(httpx.ReadTimeout):
            _chat(live.url, {"json": slow_schema(40 + i)}, timeout=3.0)

    with ThreadPoolExecutor(2) as pool:
        hung = [pool.submit(hang_up, i) for i in range(2)]
        time.sleep(1.0)
        start = time.perf_counter()
        assert _chat(live.url, {"regex": "(yes|no)"}).status_code == 200
        assert _chat(live.url, {"choice": ["red", "green", "blue"]}).status_code == 200
        client = live.client()
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert time.perf_counter() - start < 5.0
        for future in hung:
            future.result()
    deadline = time.time() + 30
    while compiler.stats()["abandoned"] < before["abandoned"] + 2:
        assert time.time() < deadline, compiler.stats()
        time.sleep(0.1)


@pytest.mark.slow
def test_shutdown_does_not_wait_on_a_compile(tiny_dir):
    port = _free_port()
    proc = _spawn(["--model", str(tiny_dir), "--block-size", "16", "--num-blocks", "64", "--served-model-name", MODEL],
                  port)
    url = f"http://127.0.0.1:{port}"
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_chat, url, {"json": json.dumps(slow_schema(40))}, 120)
            time.sleep(5.0)  # the compile has started (a worker process starts first)
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            status = proc.wait(timeout=60)
            # A request in flight is drained: its compile ends within the budget, as a 400.
            assert time.monotonic() - signalled < grammar.COMPILE_BUDGET_S + 10
            try:
                pending.result(timeout=30)
            except httpx.HTTPError:
                pass  # the connection ended with the process: what matters is that it ended
    finally:
        if proc.poll() is None:
            proc.kill()
    assert status == 0
