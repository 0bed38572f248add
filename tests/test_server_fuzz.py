"""Hostile bodies on every route that reads one: never a 500, never a hang, and the server
still serves a normal request afterwards.

Hypothesis writes the bodies: JSON of any shape (deeply nested too), the fields each route
knows with values of every type, strings with NUL bytes, lone surrogates and path tricks, and
raw bytes that are not JSON at all. Bounded: generation is capped at a few tokens, so the run
stays within a minute.
"""

from __future__ import annotations

import json

import httpx
import pydantic_core
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import MODEL, start_server

KEY = "fuzz-key"
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/update_weights_from_disk",
          "/v1/load_lora_adapter", "/v1/unload_lora_adapter"]

nasty_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "\x00", "a\x00b.safetensors", "\ud800", "../outside.safetensors", "/etc/passwd",
                     "x" * 5000 + ".safetensors", "weights.bin", "folder", "<|im_end|>", "{}", "null"]),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), nasty_text)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(nasty_text, inner, max_size=4)),
                           max_leaves=20)
small_ints = st.one_of(st.integers(-3, 6), scalars)
messages = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant",
                                                                              "tool", "bogus"]), scalars),
                                           "content": st.one_of(nasty_text, json_values)}), max_size=3)
structured = st.one_of(
    st.fixed_dictionaries({"json": st.one_of(json_values, st.just('{"type": "object"}'),
                                             st.just("[" * 3000 + "]" * 3000))}),
    st.fixed_dictionaries({"regex": st.one_of(nasty_text, st.just("(a|b){1,99999}"))}),
    st.fixed_dictionaries({"choice": st.one_of(st.lists(nasty_text, max_size=5), json_values)}),
    st.fixed_dictionaries({"grammar": st.one_of(nasty_text, st.just('root ::= "yes" | "no"'))}),
)
fields = {
    "model": st.one_of(st.just(MODEL), scalars),
    "prompt": st.one_of(nasty_text, st.lists(st.integers(-5, 60_000), max_size=6), json_values),
    "messages": st.one_of(messages, json_values),
    "max_tokens": small_ints, "max_completion_tokens": small_ints, "n": st.one_of(st.integers(-1, 2), scalars),
    "temperature": scalars, "top_p": scalars, "logprobs": scalars, "top_logprobs": small_ints,
    "stop": st.one_of(nasty_text, st.lists(nasty_text, max_size=3)), "stream": st.booleans(),
    "logit_bias": json_values, "seed": scalars, "structured_outputs": st.one_of(structured, json_values),
    "response_format": json_values, "tokens": st.one_of(st.lists(st.integers(-5, 60_000), max_size=6), json_values),
    "path": st.one_of(nasty_text, json_values), "inflight": st.one_of(st.sampled_from(["keep", "abort"]), scalars),
    "lora_name": st.one_of(nasty_text, scalars), "lora_path": st.one_of(nasty_text, json_values),
    "extra": json_values,
}
bodies = st.one_of(
    st.dictionaries(st.sampled_from(sorted(fields)), st.none(), max_size=8).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys})).map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.integers(1, 60_000).map(lambda depth: ("[" * depth + "]" * depth).encode()),
)


@pytest.fixture(scope="module")
def fuzzed(tiny_dir, tmp_path_factory):
    weights = tmp_path_factory.mktemp("fuzz-weights")
    (weights / "weights.bin").write_bytes(b"\x00" * 16)
    (weights / "folder").mkdir()
    srv = start_server(tiny_dir, num_blocks=128, max_queue_size=16, api_keys=(KEY,), weights_dir=str(weights))
    srv.http = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    yield srv
    srv.http.close()
    srv.stop()


def _capped(body: bytes, route: str) -> bytes:
    """Generation bodies that parse as objects get a small token budget (n and max_tokens
    bounded), so that a valid one finishes in milliseconds."""
    if route not in ROUTES[:2]:
        return body
    try:
        obj = pydantic_core.from_json(body)  # json.loads recurses: deep bodies pass through as they are
    except ValueError:
        return body
    if isinstance(obj, dict):
        obj.setdefault("max_tokens", 4)
        if isinstance(obj.get("max_tokens"), int) and obj["max_tokens"] > 6:
            obj["max_tokens"] = 6
        if isinstance(obj.get("max_completion_tokens"), int) and obj["max_completion_tokens"] > 6:
            obj["max_completion_tokens"] = 6
        return json.dumps(obj).encode()
    return body


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(route=st.sampled_from(ROUTES), body=bodies)
def test_no_body_gets_a_500_or_hangs(fuzzed, route, body):
    resp = fuzzed.http.post(route, content=_capped(body, route), headers={"Content-Type": "application/json"})
    assert resp.status_code < 500, (route, body[:300], resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"], resp.text


def test_a_normal_request_is_served_after_the_fuzzing(fuzzed):
    assert fuzzed.manager.is_running() and not fuzzed.manager.is_paused()
    client = fuzzed.client(api_key=KEY)
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0)
    assert out.choices[0].text is not None and out.usage.completion_tokens >= 1
    assert fuzzed.manager.weight_version == 0  # no fuzzed body loaded weights
    assert fuzzed.manager.list_adapters() == {}  # nor an adapter
