"""`contbatch serve` as a process under signals, and HEAD wherever GET answers.

A second SIGTERM during a drain is a clean forced exit: every request still in flight gets an
OpenAI-shaped 503 (a stream: an error event, then `[DONE]`), the log holds no traceback, and
the process exits with status 1, never by an abort.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from test_server import MODEL, _free_port, _spawn

FORCED_EXIT_STATUS = 1


def _head(url: str, path: str, **kw) -> httpx.Response:
    return httpx.head(url + path, timeout=10, **kw)


def test_head_answers_wherever_get_does(tiny_dir):
    port = _free_port()
    proc = _spawn(["--model", str(tiny_dir), "--block-size", "16", "--num-blocks", "64", "--served-model-name", MODEL,
                   "--api-key", "k"], port)
    url = f"http://127.0.0.1:{port}"
    try:
        for path in ("/", "/health", "/dashboard"):
            get, head = httpx.get(url + path, timeout=10), _head(url, path)
            assert head.status_code == get.status_code == 200, (path, head.status_code)
            assert head.content == b"" and head.headers.get("content-type") == get.headers.get("content-type")
        assert _head(url, "/v1/models").status_code == 401  # the key still applies
        auth = {"Authorization": "Bearer k"}
        head = _head(url, "/v1/models", headers=auth)
        assert head.status_code == 200 and head.content == b""
        assert int(head.headers["content-length"]) == len(httpx.get(url + "/v1/models", headers=auth).content)
        assert _head(url, "/v1/no-such-route", headers=auth).status_code == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def _waiting(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("contbatch:num_requests_waiting{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _request(url: str, stream: bool, i: int) -> tuple[int, list | dict]:
    body = {"model": MODEL, "prompt": f"Request number {i}", "max_tokens": 200, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=60) as client:
        if not stream:
            resp = client.post(url + "/v1/completions", json=body)
            return resp.status_code, resp.json()
        events = []
        with client.stream("POST", url + "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
        return resp.status_code, events


def test_second_signal_is_a_clean_forced_exit(tiny_dir):
    port = _free_port()
    proc = _spawn(["--model", str(tiny_dir), "--block-size", "16", "--num-blocks", "256", "--served-model-name",
                   MODEL, "--drain-timeout", "120"], port)
    url = f"http://127.0.0.1:{port}"
    try:
        assert httpx.post(url + "/pause", timeout=30).json()["paused"] is True  # requests stay in flight
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(_request, url, i % 2 == 0, i) for i in range(6)]
            deadline = time.time() + 30
            while _waiting(url) < 6:
                assert time.time() < deadline, "the six requests did not reach the engine"
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert proc.poll() is None, "the first signal drains: nothing has finished"
            proc.send_signal(signal.SIGTERM)
            results = [f.result(timeout=60) for f in futures]
        status = proc.wait(timeout=60)
        log = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    for i, (code, body) in enumerate(results):
        if i % 2:  # non-streaming: an OpenAI-shaped 503
            assert code == 503 and body["error"]["code"] == "server_shutting_down", body
            assert body["error"]["message"] and body["error"]["type"] == "service_unavailable_error"
        else:  # streaming: an error event, then [DONE]
            assert code == 200 and body[-1] == "[DONE]", body[-3:]
            assert body[-2]["error"]["code"] == "server_shutting_down", body[-2]
    assert status == FORCED_EXIT_STATUS, (status, log[-3000:])
    assert "Traceback" not in log and "Internal Server Error" not in log, log[-5000:]
    assert "second signal" in log
    after = log[log.index("draining"):].splitlines()
    assert len(after) <= 6 + 10, "\n".join(after)  # a line per request at most, not a page each
