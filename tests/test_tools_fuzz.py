"""Hostile tool-bearing chat bodies and Responses bodies: never a 5xx, never a hang, and the
server still serves a normal request afterwards.

Hypothesis writes tools whose names, parameters and choices are of every type (schemas half
sensible, half not), conversations with calls and results, Responses input items of every
shape, stored-response ids that do not exist, and text formats; generation is capped at a few
tokens so a valid body finishes in milliseconds.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import MODEL, start_server
from test_server_fuzz import json_values, nasty_text, scalars

KEY = "fuzz-key"
names = st.one_of(st.sampled_from(["get_weather", "add", "f"]), nasty_text)
types = st.sampled_from(["string", "integer", "number", "boolean", "object", "array", "null", "bogus"])
schema_leaves = st.one_of(
    st.fixed_dictionaries({"type": types}),
    st.fixed_dictionaries({"type": st.just("string"), "maxLength": st.integers(-1, 5)}),
    st.fixed_dictionaries({"type": st.just("string"), "pattern": st.sampled_from(["^a+$", "(", "a{1,99999}"])}),
    st.fixed_dictionaries({"enum": st.lists(scalars, max_size=3)}),
    json_values,
)
schemas = st.one_of(
    st.fixed_dictionaries({"type": st.just("object"),
                           "properties": st.dictionaries(st.text(max_size=6), schema_leaves, max_size=4)},
                          optional={"required": st.lists(st.text(max_size=6), max_size=3),
                                    "additionalProperties": st.booleans()}),
    json_values, st.just({"type": "object", "not": {}}), st.just("[" * 300 + "]" * 300),
)
functions = st.fixed_dictionaries({"name": names}, optional={"description": nasty_text, "parameters": schemas,
                                                             "strict": st.one_of(st.booleans(), scalars)})
chat_tools = st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("function"), "function": functions}),
                                json_values), max_size=3)
response_tools = st.lists(st.one_of(functions.map(lambda f: {"type": "function", **f}),
                                    st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search"])}),
                                    json_values), max_size=3)
choices = st.one_of(st.sampled_from(["none", "auto", "required"]), scalars,
                    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                        {"name": names})}),
                    st.fixed_dictionaries({"type": st.just("function"), "name": names}))
arguments = st.one_of(nasty_text, json_values.map(json.dumps), st.just("[" * 5000))
called = st.fixed_dictionaries({"name": names, "arguments": arguments})
calls = st.lists(st.fixed_dictionaries({"id": nasty_text, "type": st.just("function"), "function": called}), max_size=2)
messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": nasty_text}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), nasty_text),
                           "tool_calls": st.one_of(calls, scalars)}),
    st.fixed_dictionaries({"role": st.sampled_from(["tool", "user"]), "content": st.one_of(nasty_text, json_values),
                           "tool_call_id": st.one_of(nasty_text, scalars)}),
    json_values), min_size=1, max_size=4)
items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
                           "content": st.one_of(nasty_text, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal"]),
                                "text": nasty_text}), max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": nasty_text, "name": names,
                           "arguments": st.one_of(nasty_text, json_values.map(json.dumps))}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": nasty_text,
                           "output": st.one_of(nasty_text, json_values)}),
    json_values), max_size=4)
formats = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "bogus"])},
                                          optional={"name": nasty_text, "schema": schemas, "strict": scalars}),
                    json_values)
chat_fields = {"model": st.just(MODEL), "messages": messages, "tools": chat_tools, "tool_choice": choices,
               "parallel_tool_calls": st.one_of(st.booleans(), scalars), "stream": st.booleans(),
               "response_format": json_values, "n": st.integers(1, 2)}
response_fields = {"model": st.just(MODEL), "input": st.one_of(nasty_text, items, json_values),
                   "instructions": st.one_of(nasty_text, scalars), "tools": response_tools, "tool_choice": choices,
                   "parallel_tool_calls": st.booleans(), "stream": st.booleans(), "store": st.one_of(st.booleans(),
                                                                                                    scalars),
                   "previous_response_id": nasty_text, "text": st.one_of(st.fixed_dictionaries({"format": formats}),
                                                                         json_values),
                   "include": st.one_of(st.lists(nasty_text, max_size=2), scalars), "top_logprobs": scalars,
                   "reasoning": json_values, "truncation": scalars, "extra": json_values}


def bodies(fields: dict, required: str):
    return st.dictionaries(st.sampled_from(sorted(fields)), st.none(), max_size=7).flatmap(
        lambda keys: st.fixed_dictionaries({required: fields[required], **{k: fields[k] for k in keys}}))


@pytest.fixture(scope="module")
def fuzzed(tiny_dir):
    srv = start_server(tiny_dir, num_blocks=128, max_queue_size=16, api_keys=(KEY,), responses_store_size=8)
    srv.http = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    yield srv
    srv.http.close()
    srv.stop()


def _post(srv, route: str, body: dict) -> httpx.Response:
    body = {**body, "max_tokens" if route.endswith("completions") else "max_output_tokens": 4}
    return srv.http.post(route, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def _check(resp: httpx.Response, what) -> None:
    assert resp.status_code < 500, (what, resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"], resp.text


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=bodies(chat_fields, "messages"))
def test_no_tool_bearing_chat_body_gets_a_5xx_or_hangs(fuzzed, body):
    _check(_post(fuzzed, "/v1/chat/completions", body), body)


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=bodies(response_fields, "input"), response_id=nasty_text)
def test_no_responses_body_gets_a_5xx_or_hangs(fuzzed, body, response_id):
    _check(_post(fuzzed, "/v1/responses", body), body)
    for method in ("GET", "DELETE"):
        path = quote((response_id or "x").encode("utf-8", "surrogatepass"), safe="")
        _check(fuzzed.http.request(method, "/v1/responses/" + path), response_id)


def test_the_routes_need_the_key_and_still_serve_after_the_fuzzing(fuzzed):
    for method, route in [("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1")]:
        assert httpx.request(method, fuzzed.url + route, json={"input": "x"}).status_code == 401
    assert fuzzed.manager.is_running()
    client = fuzzed.client(api_key=KEY)
    resp = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=4, temperature=0)
    assert resp.usage.output_tokens >= 1 and client.responses.retrieve(resp.id).id == resp.id
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=100,
                                          tools=[{"type": "function", "function": {"name": "f", "parameters": {
                                              "type": "object", "properties": {"x": {"type": "boolean"}},
                                              "required": ["x"]}}}],
                                          tool_choice="required", temperature=0)
    assert chat.choices[0].message.tool_calls[0].function.name == "f"
