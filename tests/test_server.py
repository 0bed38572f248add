"""The OpenAI-compatible server, tested live: uvicorn on loopback and the real `openai` client.

Most tests run against a tiny random-weight Llama saved with the default model's tokenizer
(fast, and a real tokenizer with a chat template); greedy output is checked against
`model.generate` on a second copy of the same weights. One test runs `contbatch serve` with no
arguments but a port on the embedded default model; one sends SIGTERM to a server process.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager, load_model
from contbatch.server import ServerSettings, build_app
from contbatch.server.draining import DrainingServer
from contbatch.server.schemas import ChatCompletionRequest, CompletionRequest

from conftest import TINY_SERVER_CONTEXT, reference_generate

MODEL = "tiny"
CONTEXT = TINY_SERVER_CONTEXT
BLOCK = 16
GREEDY = {"temperature": 0}
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "Paris is the capital of",
]


# -- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tiny_dir):
    """A second copy of the tiny model, for `model.generate` ground truth."""
    return load_model(tiny_dir)


@dataclass
class LiveServer:
    url: str
    app: object
    manager: ContinuousBatchingManager
    server: DrainingServer
    thread: threading.Thread
    tokenizer: object

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.v1, api_key=api_key, max_retries=0, timeout=60, **kw)

    def metrics(self) -> dict[str, float]:
        """Samples by name, labels kept except model_name: 'name{label="v"}' or 'name'."""
        text = httpx.get(self.url + "/metrics", headers=getattr(self, "auth", {})).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                name, _, labels = series.partition("{")
                kept = [kv for kv in re.findall(r'\w+="[^"]*"', labels) if not kv.startswith("model_name=")]
                out[name + ("{" + ",".join(kept) + "}" if kept else "")] = float(value)
        return out

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_server(model_dir: Path, num_blocks: int = 512, max_queue_size: int = 0, speculative_config=None,
                 **settings_kw) -> LiveServer:
    model, tok = load_model(model_dir)
    config = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=num_blocks, max_queue_size=max_queue_size,
                                      speculative_config=speculative_config)
    manager = ContinuousBatchingManager(model, None, config, tokenizer=tok)
    app = build_app(manager, tok, ServerSettings(served_model_names=(MODEL, "alias"), **settings_kw))
    # proto given explicitly: asyncio sets TCP_NODELAY only on sockets that say IPPROTO_TCP,
    # and without it every JSON body waits ~40 ms behind its headers (Nagle + delayed ACK).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = DrainingServer(uvicorn.Config(app, log_level="warning", lifespan="on"), app.state.server_state,
                            settings_kw.get("drain_timeout_s", 30.0), manager)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn-test")
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", app, manager, server, thread, tok)


@pytest.fixture(scope="module")
def live(tiny_dir):
    srv = start_server(tiny_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def guarded(tiny_dir):
    """API key, a queue of 2 and a 4 KiB body limit."""
    srv = start_server(tiny_dir, max_queue_size=2, api_keys=("sekrit",), max_body_bytes=4096)
    srv.auth = {"Authorization": "Bearer sekrit"}
    yield srv
    srv.stop()


def reference_texts(reference, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Ground truth from `model.generate` itself (not our engine): greedy, no EOS stop (the
    tests send `ignore_eos`), decoded as the server builds its text (the request's
    `skip_special_tokens`, True by default)."""
    model, tok = reference
    return [tok.decode(reference_generate(model, p, max_tokens), skip_special_tokens=True) for p in prompts]


def chat_ids(tok, content: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# -- basic routes -------------------------------------------------------------------------
def test_models_health_version(live):
    assert httpx.get(live.url + "/health").status_code == 200
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == CONTEXT
    assert live.client().models.retrieve("alias").id == MODEL
    assert httpx.get(live.url + "/version").json()["version"]


def test_tokenize_detokenize_roundtrip(live):
    tok = live.tokenizer
    r = httpx.post(live.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == CONTEXT and len(body["token_strs"]) == body["count"]
    text = httpx.post(live.url + "/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat = httpx.post(live.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == chat_ids(tok, "Hi")


# -- generation -----------------------------------------------------------------------------
def test_completions_greedy_match_generate_with_usage(live, reference):
    tok = live.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    expected = reference_texts(reference, ids, 12)
    resp = live.client().completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, extra_body={"ignore_eos": True},
                                            **GREEDY)
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in resp.choices] == expected
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.prompt_tokens == sum(len(i) for i in ids)
    assert resp.usage.completion_tokens == 12 * len(PROMPTS)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.object == "text_completion" and resp.model == MODEL


def test_completion_stream_equals_non_stream_and_reports_usage(live):
    client = live.client()
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=20, extra_body={"ignore_eos": True}, **GREEDY)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts_and_echo(live, reference):
    tok = live.tokenizer
    ids = [tok.encode(PROMPTS[0]), tok.encode(PROMPTS[2])]
    expected = reference_texts(reference, ids, 6)
    resp = live.client().completions.create(model=MODEL, prompt=ids, max_tokens=6, echo=True,
                                            extra_body={"ignore_eos": True}, **GREEDY)
    assert [c.text for c in resp.choices] == [tok.decode(i) + e for i, e in zip(ids, expected)]
    single = live.client().completions.create(model=MODEL, prompt=ids[0], max_tokens=6,
                                              extra_body={"ignore_eos": True}, **GREEDY)
    assert single.choices[0].text == expected[0]


def test_chat_greedy_stream_and_non_stream(live, reference):
    tok = live.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    expected = reference_texts(reference, [prompt], 16)[0]
    client = live.client()
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16,
                                          extra_body={"ignore_eos": True}, **GREEDY)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected
    assert resp.usage.prompt_tokens == len(prompt) and resp.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == len(prompt) and chunks[-1].usage.completion_tokens == 16
    # Repeating the conversation finds its complete blocks in the prefix cache.
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1  # all but the last token, a partly filled block included


def test_completion_logprobs_consistent(live):
    client = live.client()
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, logprobs=3,
                                     extra_body={"ignore_eos": True}, **GREEDY)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 3 <= len(top) <= 4
        assert top[token] == pytest.approx(chosen)
        assert chosen == pytest.approx(max(top.values()))  # greedy takes the most likely
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, logprobs=3, stream=True,
                                              extra_body={"ignore_eos": True}, **GREEDY))
    values = [v for c in streamed if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert values == pytest.approx(lp.token_logprobs)


def test_chat_logprobs_and_top_logprobs(live):
    resp = live.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, logprobs=True, top_logprobs=4,
        extra_body={"ignore_eos": True}, **GREEDY,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 8
    joined = "".join(c.token for c in content)
    if "\ufffd" not in joined:  # a character split across tokens has no text of its own
        assert joined == resp.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 4
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob)
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert bytes(c.bytes) == c.token.encode()


def test_n3_seeded_samples(live):
    client = live.client()
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=3, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in first.choices}) > 1  # and the samples differ from each other
    assert first.usage.completion_tokens == 24
    streamed = list(client.completions.create(stream=True, **kw))
    texts = {i: "" for i in range(3)}
    finished = set()
    for c in streamed:
        texts[c.choices[0].index] += c.choices[0].text
        if c.choices[0].finish_reason:
            finished.add(c.choices[0].index)
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.text for c in first.choices]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3,
                                          max_tokens=4, temperature=1.0, seed=5)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_stop_strings(live):
    client = live.client()
    base = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, extra_body={"ignore_eos": True},
                                     **GREEDY).choices[0].text
    words = base.split()
    stop = next(w for w in words[3:] if base.find(w) > 0)
    cut = base[: base.find(stop)]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, stop=[stop, "\u2603never"],
                                     extra_body={"ignore_eos": True}, **GREEDY)
    assert resp.choices[0].text == cut and resp.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True}, **GREEDY)
    assert kept.choices[0].text == cut + stop
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, stop=stop, stream=True,
                                              extra_body={"ignore_eos": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_sampling_parameters_are_honoured(live, reference):
    client = live.client()
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, logprobs=1,
                                       extra_body={"ignore_eos": True}, **GREEDY)
    first = greedy.choices[0].logprobs.tokens[0]
    model, tok = reference
    first_id = reference_generate(model, tok.encode(PROMPTS[2]), 1)[0]
    assert tok.decode([first_id]) == first
    # logit_bias -100 on the greedy token: it can no longer be chosen.
    banned = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=1, logprobs=1,
                                       logit_bias={str(first_id): -100}, **GREEDY)
    assert banned.choices[0].logprobs.tokens[0] != first
    # stop_token_ids: stop at the greedy first token (it is kept, as an EOS would be).
    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6,
                                        extra_body={"stop_token_ids": [first_id]}, **GREEDY)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    # top_k=1 samples greedily whatever the temperature.
    topk = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=1.5, seed=3,
                                     extra_body={"top_k": 1, "ignore_eos": True})
    assert topk.choices[0].text == greedy.choices[0].text
    # min_tokens with a stop id that is the greedy first token: it is masked until then.
    forced = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6,
                                       extra_body={"stop_token_ids": [first_id], "min_tokens": 3}, **GREEDY)
    assert forced.usage.completion_tokens >= 3


def test_32_concurrent_streaming_clients(live, reference):
    tok = live.tokenizer
    prompts = [f"Request number {i}: tell me about topic {i * 7}" for i in range(32)]
    expected = reference_texts(reference, [tok.encode(p) for p in prompts], 16)

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stream=True,
                                                     extra_body={"ignore_eos": True}, **GREEDY)
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(run()) == expected
    assert live.manager.stats()["running"] == 0


def test_client_disconnect_cancels_and_frees_blocks(live):
    before = live.metrics()
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", live.v1 + "/completions", json=body) as resp:
            lines = resp.iter_lines()  # held: a dropped iterator closes the connection
            got = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
            assert len(got) == 3
            during = live.metrics()
            assert during["contbatch:num_requests_running"] == 1
            assert during["contbatch:kv_cache_usage_perc"] > 0
    # Closed mid-stream: the request is cancelled and its blocks are free again.
    after = wait_for(
        lambda: (m := live.metrics())["contbatch:num_requests_running"] == 0
        and m["contbatch:kv_cache_usage_perc"] == 0 and m, what="blocks to be freed")
    aborts = 'contbatch:request_success_total{finished_reason="abort"}'
    assert after[aborts] == before[aborts] + 1
    generated = after["contbatch:generation_tokens_total"] - before["contbatch:generation_tokens_total"]
    assert 3 <= generated < 900
    # A non-streaming client that gives up is cancelled too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.v1 + "/completions", json={**body, "stream": False}, timeout=0.5)
    wait_for(lambda: live.metrics()[aborts] == before[aborts] + 2, what="the second abort")
    assert live.manager.stats()["running"] == 0


# -- errors ---------------------------------------------------------------------------------
ERROR_CASES = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "frobnicate": True}, 400, "unknown field 'frobnicate'"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix is not supported"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo with logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [5] * 1100}, 400, "maximum context length is 1024 tokens. However, your prompt is 1100"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "you requested 5001 tokens (1 in the prompt, 5000"),
    ("/v1/completions", {"prompt": [10**7]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens (20)"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "`gpt-9` does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "needs logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4000}, 400,
     "maximum context length"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
]


@pytest.mark.parametrize("path, body, status, message", ERROR_CASES)
def test_errors_have_openai_shape_and_status(live, path, body, status, message):
    resp = httpx.post(live.url + path, json=body)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert message in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_invalid_json_and_unknown_route(live):
    resp = httpx.post(live.v1 + "/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
    resp = httpx.get(live.v1 + "/nowhere")
    assert resp.status_code == 404 and "error" in resp.json()
    with pytest.raises(openai.NotFoundError):
        live.client().completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        live.client().completions.create(model=MODEL, prompt="x", max_tokens=5000)


def test_api_key_body_limit_and_queue_full(guarded):
    assert httpx.get(guarded.url + "/health").status_code == 200  # no key needed
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(guarded.url + path).status_code == 401
        assert httpx.get(guarded.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(guarded.url + path, headers=guarded.auth).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").models.list()
    resp = httpx.post(guarded.v1 + "/completions", headers=guarded.auth, json={"prompt": "x" * 5000})
    assert resp.status_code == 413 and "exceeds the limit of 4096 bytes" in resp.json()["error"]["message"]

    # Two long requests fill the queue of 2; a third is refused with 429 while they complete.
    client = guarded.client(api_key="sekrit")
    kw = dict(model=MODEL, max_tokens=150, stream=True, extra_body={"ignore_eos": True}, **GREEDY)
    streams = [client.completions.create(prompt=p, **kw) for p in PROMPTS[:2]]
    firsts = [next(iter(s)) for s in streams]
    with pytest.raises(openai.RateLimitError, match="queue full"):
        client.completions.create(model=MODEL, prompt="third", max_tokens=2)
    texts = [f.choices[0].text + "".join(c.choices[0].text for c in s) for f, s in zip(firsts, streams)]
    finals = [guarded.client(api_key="sekrit").completions.create(model=MODEL, prompt=p, max_tokens=150,
                                                                    extra_body={"ignore_eos": True}, **GREEDY)
              for p in PROMPTS[:2]]
    assert texts == [f.choices[0].text for f in finals]
    assert httpx.get(guarded.url + "/metrics", headers=guarded.auth).status_code == 200


# -- fuzzing --------------------------------------------------------------------------------
BAD_FIELDS = {
    "prompt": [None, 5, [], [[]], [-1], [10**12], [1.5], {"a": 1}, [["a"]], ["a", 1], True, ""],
    "max_tokens": [0, -1, "5", 1.5, True, [], 10**9],
    "temperature": [-0.1, 2.5, "hot", []],
    "top_p": [0, 1.5, -1, "x"],
    "top_k": [-2, "x", 1.5],
    "min_p": [-0.1, 1.1, "x"],
    "n": [0, -1, 1000, "2", 1.5],
    "logprobs": [-1, 21, "x", 1.5],
    "presence_penalty": [-3, 3, "x"],
    "frequency_penalty": [-2.5, 9, []],
    "repetition_penalty": [0, -1, 1000],
    "logit_bias": [{"x": 1}, {"999999999": 1}, {"5": 101}, {"5": "a"}, [], "x"],
    "seed": ["x", 1.5, 2**70],
    "stop": [5, [5], [""], "", {"a": 1}],
    "stop_token_ids": [[-1], ["a"], 5],
    "stream": ["yes", 1],
    "stream_options": [{"include_usage": "x"}, {"bogus": 1}, {"include_usage": True}],
    "echo": ["x", 0],
    "suffix": ["abc"],
    "best_of": [2, 0],
    "min_tokens": [-1, 10**6],
    "ignore_eos": ["x"],
    "model": ["nope", 5],
    "user": [5],
}
BAD_CHAT = {
    "messages": [[], [{"role": "tool", "content": "x"}], [{"role": "user"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "hi", None],
    "response_format": [{"type": "xml"}, {"type": "json_schema", "json_schema": {}}],
    "top_logprobs": [3, 21, -1],
    "max_completion_tokens": [0, 10**9],
    "logprobs": ["x", 3],
    "continue_final_message": [True],
}
KNOWN = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def malformed(draw):
    """(path, raw body) that must be refused: a bad value, an unknown field, a missing
    required field, a body that is not a JSON object, or bytes that are not JSON at all."""
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    kind = draw(st.sampled_from(["bad_value", "bad_value", "unknown", "missing", "not_object", "garbage",
                                 "tokenize"]))
    if kind == "bad_value":
        table = {**BAD_FIELDS, **BAD_CHAT} if chat else BAD_FIELDS
        if chat:
            table = {k: v for k, v in table.items() if k not in ("prompt", "echo", "suffix", "best_of")}
            table["logprobs"] = BAD_CHAT["logprobs"]
        name = draw(st.sampled_from(sorted(table)))
        body[name] = draw(st.sampled_from(table[name]))
        if name == "top_logprobs" and body[name] == 3:
            body.pop("logprobs", None)  # top_logprobs without logprobs
    elif kind == "unknown":
        name = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in KNOWN and k not in body))
        body[name] = draw(json_values)
    elif kind == "missing":
        body.pop("messages" if chat else "prompt")
        body.update(draw(st.dictionaries(st.sampled_from(["temperature", "n", "seed"]),
                                         st.integers(1, 3), max_size=2)))
    elif kind == "not_object":
        return path, json.dumps(draw(st.lists(json_values, max_size=3) | st.integers() | st.text())).encode()
    elif kind == "garbage":
        return path, draw(st.binary(min_size=1, max_size=64).filter(lambda b: _not_json_object(b)))
    else:
        path = draw(st.sampled_from(["/tokenize", "/detokenize"]))
        body = draw(st.sampled_from([{"prompt": 5}, {"tokens": [-1]}, {"tokens": "x"}, {"tokens": [10**9]}, {},
                                     {"messages": []}, {"prompt": "x", "extra": 1}]))
        if path == "/detokenize" and "tokens" not in body:
            body = {"tokens": None}
    return path, json.dumps(body).encode()


def _not_json_object(raw: bytes) -> bool:
    try:
        return not isinstance(json.loads(raw), dict)
    except ValueError:
        return True


def test_fuzzed_bodies_get_4xx_json_and_server_survives(live):
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=live.url, timeout=30) as client:

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(malformed())
        def check(case):
            path, raw = case
            resp = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert 400 <= resp.status_code < 500, (path, raw, resp.status_code, resp.text)
            err = resp.json()["error"]
            assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1

        check()
    assert set(statuses) <= {400, 404}
    assert httpx.get(live.url + "/health").status_code == 200
    ok = live.client().completions.create(model=MODEL, prompt="still alive", max_tokens=3, **GREEDY)
    assert ok.usage.completion_tokens == 3 and live.manager.is_running()


def test_drain_timeout_fails_stragglers_and_refuses_new_requests(tiny_dir):
    srv = start_server(tiny_dir, drain_timeout_s=1.0)
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", srv.v1 + "/completions", json=body) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            srv.app.state.server_state.begin_drain()
            refused = httpx.post(srv.v1 + "/completions", json={"model": MODEL, "prompt": "x"})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            assert httpx.get(srv.url + "/health").status_code == 503
            rest = [line for line in lines if line.startswith("data:")]
        # Past the drain timeout the engine is stopped: the stream ends with an error, then [DONE].
        assert first and rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data:"))["error"]
        assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
        srv.thread.join(30)
        assert not srv.thread.is_alive() and not srv.manager.is_running()
    finally:
        srv.stop()


def test_bench_serve_against_live_server(live, tiny_dir, tmp_path):
    from contbatch.bench.cli import main

    common = ["--base-url", live.v1, "--tokenizer", str(tiny_dir), "--num-prompts", "8", "--output-len", "8",
              "--ignore-eos", "--no-progress"]
    out, png = tmp_path / "random.json", tmp_path / "random.png"
    assert main([*common, "--dataset", "random", "--input-len", "24", "--range-ratio", "0.5",
                 "--max-concurrency", "1", "4", "--output-json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["model"] == MODEL and [lv["max_concurrency"] for lv in report["levels"]] == [1, 4]
    from contbatch.bench.datasets import random_dataset

    wanted = sum(r.output_len for r in random_dataset(live.tokenizer, 8, 24, 8, 0.5, 0))  # lengths vary +-50%
    for level in report["levels"]:
        assert level["completed"] == 8 and level["total_output_tokens"] == wanted and level["usage_reported"]
        assert level["ttft"]["p50_ms"] > 0 and level["tpot"]["p99_ms"] >= level["tpot"]["p50_ms"] > 0
        assert level["itl"]["mean_ms"] > 0 and level["request_throughput"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "prefix.json"
    assert main([*common, "--dataset", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "48",
                 "--suffix-len", "8", "--endpoint", "chat", "--request-rate", "50", "inf", "--output-json", str(out),
                 "--plot", str(tmp_path / "prefix.png")]) == 0
    levels = json.loads(out.read_text())["levels"]
    assert [lv["request_rate"] for lv in levels] == [50, None] and all(lv["completed"] == 8 for lv in levels)


# -- processes: SIGTERM, and the default model with no arguments ---------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args: list[str], port: int, timeout: float = 180) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "contbatch.cli", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server did not come up:\n{proc.stdout.read()}")


def test_sigterm_drains_in_flight_and_exits_zero(tiny_dir):
    port = _free_port()
    proc = _spawn(["--model", str(tiny_dir), "--block-size", "16", "--num-blocks", "256",
                   "--served-model-name", MODEL], port)
    url = f"http://127.0.0.1:{port}"
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 600, "ignore_eos": True, "stream": True}
        chunks: list[str] = []
        with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    chunks.append(line)
                    break
            proc.send_signal(signal.SIGTERM)
            refused = wait_for(lambda: (r := httpx.get(url + "/v1/models", timeout=5)).status_code == 503 and r,
                               what="503 while draining")
            assert refused.json()["error"]["code"] == "server_shutting_down"
            chunks += [line for line in lines if line.startswith("data:")]
        assert chunks[-1] == "data: [DONE]"
        assert json.loads(chunks[-2].removeprefix("data:"))["choices"][0]["finish_reason"] == "length", chunks[-3:]
        assert proc.wait(timeout=60) == 0
        out = proc.stdout.read()
        assert "resolved configuration" in out and "drained" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_default_model_no_arguments_greedy_matches_generate(default_model):
    """`contbatch serve` with no arguments: greedy text equals `model.generate`'s tokens (with
    the model's own EOS, as the server stops on it), decoded without special tokens."""
    model, tok = default_model
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    prompts = [chat_ids(tok, q) for q in questions]
    eos = model.generation_config.eos_token_id
    tokens = [reference_generate(model, p, 24, eos) for p in prompts]

    @dataclass
    class Expected:
        generated_tokens: list[int]
        text: str

    expected = [Expected(t, tok.decode(t, skip_special_tokens=True)) for t in tokens]
    port = _free_port()
    proc = _spawn([], port, timeout=300)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
        chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=24, temperature=0,
                                              messages=[{"role": "user", "content": questions[0]}])
        assert chat.choices[0].message.content == expected[0].text
        assert chat.usage.completion_tokens == len(expected[0].generated_tokens)
        completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts[1], max_tokens=24,
                                               temperature=0)
        assert completion.choices[0].text == expected[1].text
        assert completion.usage.prompt_tokens == len(prompts[1])
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def _documented_text() -> str:
    root = Path(__file__).resolve().parent.parent
    return "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])


def test_every_metric_name_is_documented(live):
    """Every metric family `/metrics` serves is named in README.md or docs/*.md."""
    text = httpx.get(live.url + "/metrics").text
    names = sorted({line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")})
    assert len(names) >= 20 and all(n.startswith("contbatch:") for n in names), names
    docs = _documented_text()
    missing = [n for n in names if n not in docs]
    assert not missing, f"undocumented metrics: {missing}"
