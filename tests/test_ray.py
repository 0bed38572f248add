"""contbatch on Ray, tested live: one local Ray session for the module (2 CPUs, no dashboard).

Ray Serve runs the front and two replicas with fractional CPUs on Serve's HTTP proxy (a free
port); the real `openai` client checks greedy output against `model.generate` (as the
single-process server's tests do), streaming, the API key, per-replica /metrics, prefix-aware
routing against random routing (on the engines' prefix-cache counters), and a replica killed
mid-run. Ray Data runs 32 prompts on two actors against `generate_batch` in this process.
`contbatch serve --ray-replicas` runs as a process of its own with its own Ray runtime, for
what signals and deaths do to it and to the streams it serves.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray
from ray import serve

from contbatch import ContinuousBatchingConfig, SamplingParams, generate_batch, load_model
from contbatch.ray import EngineSpec, ServeOptions, generate_rows, replica_actors, run_serve
from contbatch.ray.routing import REPLICA_HEADER
from contbatch.server import ServerSettings

from conftest import TINY_SERVER_CONTEXT, random_prompts, reference_generate
from ray_cli import SSE_HEAD, FakeCall, free_port, start_ray_cli, wait_for

CONTEXT = TINY_SERVER_CONTEXT
BLOCK = 16
KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "def fibonacci(n):",
           "Paris is the capital of"]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    yield
    serve.shutdown()
    ray.shutdown()


def engine_spec(tiny_dir: Path) -> EngineSpec:
    # aten linears: no start-up timing probe (seconds per engine, and five engines start here)
    config = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=256, cpu_kernel_overrides={"linear": "aten"})
    return EngineSpec(model=str(tiny_dir), config=config, torch_threads=1)


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_dir):
    """Two replicas (0.5 CPU each) behind the front, API key required; yields the base URL."""
    port = free_port()
    settings = ServerSettings(served_model_names=("tiny",), api_keys=(KEY,))
    run_serve(engine_spec(tiny_dir), settings, ServeOptions(num_replicas=2, num_cpus=0.5, port=port))
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: len(replica_actors()) == 2 and all(healthy(url, r) for r in replica_actors()),
             60, "two healthy replicas")
    return url


def healthy(url: str, replica: str) -> bool:
    r = httpx.get(url + "/health", headers={REPLICA_HEADER: replica}, timeout=10)
    return r.status_code == 200 and r.headers.get(REPLICA_HEADER) == replica


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def prefix_counters(url: str, replica: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, queried tokens) from one replica's own /metrics."""
    r = httpx.get(url + "/metrics", headers={**AUTH, REPLICA_HEADER: replica}, timeout=10)
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == replica
    values = {}
    for line in r.text.splitlines():
        for name in ("contbatch:prefix_cache_hits_total", "contbatch:prefix_cache_queries_total"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["contbatch:prefix_cache_hits_total"], values["contbatch:prefix_cache_queries_total"]


def test_ray_is_optional():
    """`import contbatch` does not import Ray; `contbatch.ray` without it says how to install it."""
    code = ("import sys; import contbatch; assert 'ray' not in sys.modules, 'contbatch imported ray'\n"
            "sys.modules['ray'] = None\n"
            "try:\n    import contbatch.ray\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'contbatch[ray]'" in out.stdout


def test_check_health_raises_when_the_engine_thread_is_not_running(reference):
    """What Serve's health check calls: a replica whose engine thread died reports unhealthy."""
    from types import SimpleNamespace

    from contbatch import ContinuousBatchingManager
    from contbatch.ray import ContbatchServer

    model, tok = reference  # a manager that is never started does not touch the model
    stopped = SimpleNamespace(manager=ContinuousBatchingManager(model, None, None, tokenizer=tok), replica_id="r1")
    with pytest.raises(RuntimeError, match="engine thread is not running"):
        ContbatchServer.func_or_class.check_health(stopped)


def test_prefix_key_and_rendezvous_order():
    """Requests sharing a first block share a key; keys move only off a replica that leaves."""
    from contbatch.ray.routing import prefix_key, rendezvous_order

    system = {"role": "system", "content": "You are a helpful assistant. " * 20}
    a = prefix_key({"messages": [system, {"role": "user", "content": "Hi"}]})
    b = prefix_key(json.dumps({"messages": [system, {"role": "user", "content": "Bye"}]}).encode())
    assert a == b and a != prefix_key({"messages": [{"role": "user", "content": "Hi"}]})
    assert prefix_key({"prompt": list(range(100))}) == prefix_key({"prompt": list(range(64)) + [7] * 36})
    assert prefix_key(b"not json") is None and prefix_key({"model": "m"}) is None
    replicas = [f"r{i}" for i in range(4)]
    keys = [prefix_key({"prompt": f"prompt {i}"}) for i in range(200)]
    owners = {k: rendezvous_order(k, replicas)[0] for k in keys}
    assert len(set(owners.values())) == 4
    after = {k: rendezvous_order(k, replicas[:3])[0] for k in keys}
    assert all(after[k] == owners[k] for k in keys if owners[k] != "r3")


def test_front_drain_lets_requests_finish_then_ends_the_rest_with_an_error_event():
    """The front's drain: a stream that finishes within the timeout is untouched; one still in
    flight at the timeout (stalled: no part arrives) is cancelled and ends with an error event
    and [DONE], never just cut; the drain reports how many it ended and refuses new requests."""
    from contbatch.ray.draining import FrontDrain
    from contbatch.ray.forwarding import forward_body

    async def scenario():
        drain = FrontDrain()
        quick, stalled = FakeCall([b"data: 1\n\n", b"data: [DONE]\n\n"]), FakeCall([b"data: 1\n\n"], stall=True)
        outputs = {}

        async def forward(name: str, call: FakeCall) -> None:
            drain.enter(call)
            try:
                outputs[name] = b"".join([part async for part in forward_body(call, SSE_HEAD, drain.stopping)])
            finally:
                drain.leave(call)

        tasks = [asyncio.create_task(forward("quick", quick)), asyncio.create_task(forward("stalled", stalled))]
        await asyncio.sleep(0.05)
        ended = await drain.drain(0.3)
        await asyncio.gather(*tasks)
        return drain, ended, outputs

    drain, ended, outputs = asyncio.run(scenario())
    assert ended == 1 and drain.draining and drain.inflight == 0
    assert outputs["quick"] == b"data: 1\n\ndata: [DONE]\n\n"
    events = outputs["stalled"].decode().split("\n\n")
    assert events[0] == "data: 1" and events[2] == "data: [DONE]", events
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and "drain timeout" in error["message"]


def test_front_drain_returns_at_once_when_nothing_is_in_flight():
    from contbatch.ray.draining import FrontDrain

    drain = FrontDrain()
    t0 = time.perf_counter()
    assert asyncio.run(drain.drain(30)) == 0 and time.perf_counter() - t0 < 1 and drain.draining


@pytest.mark.slow
def test_first_signal_drains_second_skips_the_drain_teardown_always_runs():
    """`contbatch serve --ray-replicas`'s signal handling, on a stand-in: SIGTERM drains, a second
    signal cuts the drain short, a third during the teardown is ignored; the exit status is 0."""
    script = ("import time\n"
              "from contbatch.ray.shutdown import run_until_signalled\n"
              "def say(word):\n    print(word, flush=True)\n"
              "def drain():\n    say('draining'); time.sleep(60); say('drained')\n"
              "def teardown():\n    say('teardown'); time.sleep(1); say('torn down')\n"
              "raise SystemExit(run_until_signalled(lambda: say('started'), drain, teardown))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        for line, sig in (("started", signal.SIGTERM), ("draining", signal.SIGINT), ("teardown", signal.SIGTERM)):
            lines.append(proc.stdout.readline().strip())
            assert lines[-1] == line, lines
            proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert proc.stdout.read().split() == ["torn", "down"]  # the drain never finished; the teardown did
    finally:
        if proc.poll() is None:
            proc.kill()


# -- `contbatch serve --ray-replicas`: signals and deaths ----------------------------------
# Each runs the CLI on a Ray runtime of its own (ray_cli.py); in file order, before this
# module's session starts.
@pytest.mark.slow
def test_cli_sigterm_after_a_replica_death_drains_and_stops_ray(tiny_dir, tmp_path):
    """Serve replaces a replica killed under it; one SIGTERM then drains, stops the Ray runtime
    the CLI started with every one of its processes, and exits 0 (no abort, no orphans)."""
    cli = start_ray_cli(tiny_dir, tmp_path, "--ray-replicas", "2")
    try:
        replicas = cli.processes("ContbatchServer")
        assert len(replicas) == 2, replicas
        os.kill(replicas[0], signal.SIGKILL)
        wait_for(lambda: replicas[0] not in cli.processes("ContbatchServer")
                 and len(cli.processes("ContbatchServer")) == 2, 120, "Serve to start a replacement replica")
        wait_for(lambda: all(httpx.get(cli.url + "/health", timeout=5).status_code == 200 for _ in range(5)), 120,
                 "the replacement to serve")
        cli.proc.send_signal(signal.SIGTERM)
        cli.exits_cleanly()
        assert "draining Serve" in cli.log.read_text()
    finally:
        cli.end()


@pytest.mark.slow
def test_cli_streams_end_as_errors_when_the_front_dies_or_the_drain_times_out(tiny_dir, tmp_path):
    """A stream never ends looking like a finished completion. The front killed outright: no
    process is left to send an event, and the client sees a cut stream, an error. The server
    draining on SIGTERM past --drain-timeout: the front is alive, and ends the stream with an
    error event (no `finish_reason`) and `[DONE]`; the CLI exits 0 and leaves no process."""
    cli = start_ray_cli(tiny_dir, tmp_path, "--ray-replicas", "1", "--drain-timeout", "1")
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 1000, "temperature": 0, "stream": True}
    try:
        [front] = cli.processes("ContbatchFront")
        reasons = []
        with pytest.raises(openai.APIConnectionError):
            for chunk in client(cli.url).completions.create(**body, extra_body={"ignore_eos": True}):
                reasons.append(chunk.choices[0].finish_reason if chunk.choices else None)
                if len(reasons) == 3:
                    os.kill(front, signal.SIGKILL)
        assert len(reasons) >= 3 and not any(reasons), reasons  # cut: it never finished
        wait_for(lambda: cli.processes("ContbatchFront") not in ([], [front])
                 and httpx.get(cli.url + "/health", timeout=5).status_code == 200, 120, "Serve to replace the front")

        events = []
        with httpx.stream("POST", cli.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 1:
                        cli.proc.send_signal(signal.SIGTERM)  # the drain: the stream outlasts its 1 s
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])
        assert error["error"]["code"] == "server_shutting_down" and "drain timeout" in error["error"]["message"]
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
        cli.exits_cleanly()
        assert "1 request(s) still in flight after 1 s ended with an error" in cli.log.read_text()
    finally:
        cli.end()


# -- Serve --------------------------------------------------------------------------------
def test_serve_greedy_and_streaming_match_generate(cluster, reference):
    model, tok = reference
    c = client(cluster)
    ids = [tok.encode(p) for p in PROMPTS]
    expected = [tok.decode(reference_generate(model, p, 12), skip_special_tokens=True) for p in ids]
    got = [c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
           for p in PROMPTS]
    assert [r.choices[0].text for r in got] == expected
    assert all(r.usage.completion_tokens == 12 for r in got)
    stream = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[1]
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                     temperature=0, extra_body={"ignore_eos": True})
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False))
    assert chat.choices[0].message.content == tok.decode(reference_generate(model, prompt, 8), skip_special_tokens=True)


def test_serve_handle_methods_named_as_llm_server(cluster, reference):
    """`completions` / `chat` for handle callers answer as the HTTP routes do (key added)."""
    model, tok = reference
    handle = serve.get_deployment_handle("ContbatchServer", app_name="contbatch").options(stream=True)
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    [answer] = list(handle.completions.remote(body))
    assert answer["choices"][0]["text"] == tok.decode(reference_generate(model, tok.encode(PROMPTS[2]), 6),
                                                      skip_special_tokens=True)
    events = list(handle.completions.remote({**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == answer["choices"][0]["text"]
    [error] = list(handle.chat.remote({"model": "tiny", "messages": [], "max_tokens": 2}))
    assert error["error"]["type"] == "invalid_request_error"


def test_serve_api_key_errors_and_per_replica_metrics(cluster):
    with pytest.raises(openai.AuthenticationError):
        client(cluster, key="wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
    r = httpx.post(cluster + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = httpx.post(cluster + "/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    unknown = httpx.post(cluster + "/v1/completions", headers=AUTH, json={"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    for replica in replica_actors():
        hits, queries = prefix_counters(cluster, replica)
        assert 0 <= hits <= queries


def run_workload(url: str, requests: list[str], pins: list[str | None]) -> None:
    for text, pin in zip(requests, pins):
        headers = {**AUTH, **({REPLICA_HEADER: pin} if pin else {})}
        r = httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                       json={"model": "tiny", "prompt": text, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text


def shared_prefix_workload(num_systems: int = 4, per_system: int = 6, seed: int = 0) -> list[str]:
    """Requests sharing one of a few long system prompts (several 16-token blocks each)."""
    rng = random.Random(seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    systems = [f"System {i}: " + " ".join(rng.choice(words) for _ in range(60)) for i in range(num_systems)]
    reqs = [f"{systems[i]}\nUser {j}: " + " ".join(rng.choice(words) for _ in range(5))
            for j in range(per_system) for i in range(num_systems)]
    return reqs


def measure_hit_rate(url: str, replicas: list[str], requests: list[str], pins: list[str | None]) -> float:
    for r in replicas:
        assert httpx.post(url + "/reset_prefix_cache", headers={**AUTH, REPLICA_HEADER: r}).status_code == 200
    before = [prefix_counters(url, r) for r in replicas]
    run_workload(url, requests, pins)
    after = [prefix_counters(url, r) for r in replicas]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    assert queries > 0
    return hits / queries


def test_prefix_routing_beats_random_routing(cluster):
    replicas = sorted(replica_actors())
    requests = shared_prefix_workload()
    rng = random.Random(1)
    random_pins = [rng.choice(replicas) for _ in requests]
    routed = measure_hit_rate(cluster, replicas, requests, [None] * len(requests))
    random_rate = measure_hit_rate(cluster, replicas, requests, random_pins)
    assert routed > random_rate, (routed, random_rate)


@pytest.mark.slow
def test_replica_killed_midrun_is_replaced_and_its_requests_fail_clearly(cluster):
    """Requests in flight on a killed replica end with errors that say so (none hang); Serve
    starts a replacement, and the endpoint serves again."""
    victim = sorted(replica_actors())[0]
    actor = replica_actors()[victim]  # looked up before the load: the tiny model finishes 900 tokens in seconds
    c = openai.OpenAI(base_url=cluster + "/v1", api_key=KEY, max_retries=0, timeout=60,
                      default_headers={REPLICA_HEADER: victim})
    long = {"model": "tiny", "max_tokens": 900, "temperature": 0, "extra_body": {"ignore_eos": True}}
    streaming = threading.Event()
    outcomes: dict[str, Exception | str | None] = {}  # the error, or the finish reason of a complete request

    def stream(name: str, prompt: str) -> None:
        try:
            reason = None
            for chunk in c.completions.create(prompt=prompt, stream=True, **long):
                streaming.set()
                reason = chunk.choices[0].finish_reason if chunk.choices else reason
            outcomes[name] = reason
        except Exception as exc:  # what the client sees is what we check
            outcomes[name] = exc

    def plain(name: str, prompt: str) -> None:
        try:
            outcomes[name] = c.completions.create(prompt=prompt, **long).choices[0].finish_reason
        except Exception as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=stream, args=("stream0", PROMPTS[0])),
               threading.Thread(target=stream, args=("stream1", PROMPTS[1])),
               threading.Thread(target=plain, args=("plain0", PROMPTS[2])),
               threading.Thread(target=plain, args=("plain1", PROMPTS[3]))]
    for t in threads:
        t.start()
    assert streaming.wait(30), "no stream started"
    ray.kill(actor, no_restart=True)
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a request hung after its replica died"
    # ray.kill takes effect a moment later, and the tiny model decodes fast: a request may still
    # complete all its tokens first. None may end any other way than complete or a clear error.
    for name, outcome in outcomes.items():
        if outcome == "length":
            continue
        assert isinstance(outcome, openai.APIError), (name, outcome)
        assert "replica" in str(outcome), (name, outcome)
    assert len(outcomes) == 4
    assert any(isinstance(o, openai.APIError) for o in outcomes.values()), "no request was in flight at the kill"
    wait_for(lambda: victim not in replica_actors() and len(replica_actors()) == 2
             and all(healthy(cluster, r) for r in replica_actors()), 120, "a replacement replica")
    ok = client(cluster).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens >= 1


# -- Ray Data -----------------------------------------------------------------------------
@pytest.mark.slow
def test_ray_data_matches_generate_batch_in_order(ray_session, tiny_dir):
    prompts = random_prompts(32, 4, 40, seed=3, vocab=2000)
    too_long = [5] * (CONTEXT + 10)  # refused by the engine: its row carries the error
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=True)
    spec = engine_spec(tiny_dir)
    rows = generate_rows(prompts[:5] + [too_long] + prompts[5:], spec=spec, sampling_params=params, concurrency=2,
                         batch_size=8, num_cpus=0.4)
    bad = rows.pop(5)
    assert bad["status"] == "failed" and bad["finish_reason"] == "error" and str(CONTEXT) in bad["error"]
    model, tok = load_model(tiny_dir)
    expected = generate_batch(model, prompts, None, spec.config, progress_bar=False, sampling_params=params,
                              tokenizer=tok)
    assert [list(r["token_ids"]) for r in rows] == prompts
    assert [list(r["generated_token_ids"]) for r in rows] == [o.generated_tokens for o in expected.values()]
    assert [r["generated_text"] for r in rows] == [o.text for o in expected.values()]
    assert all(r["finish_reason"] == "length" and r["error"] is None and r["status"] == "finished" for r in rows)
    for row, out in zip(rows, expected.values()):
        assert list(row["logprobs"]) == pytest.approx(out.logprobs, abs=1e-4)
