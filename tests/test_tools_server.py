"""Chat completions with tools, live, through the `openai` client, on the tiny model (whose chat
template, the default model's, has no tool section: the server writes the tools into the
system prompt and reads Hermes `<tool_call>` blocks).

With `tool_choice` "required" or a named function the output is constrained to calls, so even
random weights call correctly: valid JSON for the function's parameters, streamed as the client
assembles it. Errors are 400s in OpenAI's shape naming the field.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from test_server import MODEL, start_server, wait_for
from test_tool_grammar import schemas

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def live(tiny_dir):
    srv = start_server(tiny_dir)
    yield srv
    srv.stop()


def check_call(call) -> dict:
    """A returned call: an id, a known function, arguments that validate."""
    assert call.id.startswith("call_") and call.type == "function"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def assemble(chunks) -> tuple[str, dict[int, dict], str | None]:
    """Streamed chat chunks -> content, calls by index, finish reason (as clients do)."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or ():
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] = call["name"] or (tc.function.name if tc.function else None)
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            reason = choice.finish_reason or reason
    return content, calls, reason


def test_required_and_named_choices_always_return_valid_calls(live):
    client = live.client()
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=200, **GREEDY)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls and all(check_call(c) is not None for c in choice.message.tool_calls)
    named = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "add"}}, **GREEDY)
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "add" and check_call(calls[0])
    single = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=7)
    assert len(single.choices[0].message.tool_calls) == 1
    several = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=2,
                                             max_tokens=200, temperature=1.0, seed=3)
    assert [c.finish_reason for c in several.choices] == ["tool_calls"] * 2


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(params=schemas, seed=st.integers(0, 1000), stream=st.booleans())
def test_calls_for_random_schemas_validate_end_to_end(live, params, seed, stream):
    """Through the whole server (compile, masks on the engine thread, parsing), sampled."""
    kw = dict(model=MODEL, messages=ASK, tools=[{"type": "function", "function": {"name": "f", "parameters": params}}],
              tool_choice="required", parallel_tool_calls=False, max_tokens=400, temperature=1.0, seed=seed)
    if stream:
        _, calls, reason = assemble(live.client().chat.completions.create(stream=True, **kw))
        arguments = [c["arguments"] for c in calls.values()]
    else:
        choice = live.client().chat.completions.create(**kw).choices[0]
        reason, arguments = choice.finish_reason, [c.function.arguments for c in choice.message.tool_calls or ()]
    if reason == "length":
        return  # a random model may write a long string past the budget: cut off, not wrong
    assert reason == "tool_calls" and len(arguments) == 1
    jsonschema.validate(json.loads(arguments[0]), params, format_checker=jsonschema.FormatChecker())


def test_a_streamed_call_assembles_into_the_same_call(live):
    client = live.client()
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, **GREEDY)
    whole = client.chat.completions.create(**kw).choices[0].message
    content, calls, reason = assemble(client.chat.completions.create(stream=True, **kw))
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


class Forecast(BaseModel):
    city: str = Field(max_length=16)
    days: int = Field(ge=1, le=7)


def test_the_clients_stream_helper_parses_strict_function_arguments(live):
    tool = openai.pydantic_function_tool(Forecast, name="forecast")
    with live.client().chat.completions.stream(model=MODEL, messages=ASK, tools=[tool], tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=120, **GREEDY) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert {"tool_calls.function.arguments.delta", "tool_calls.function.arguments.done"} <= kinds
    call = final.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Forecast) and final.choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_calls_and_results_continues(live):
    client = live.client()
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, **GREEDY)
    message = first.choices[0].message
    messages = [*ASK, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Sunny, 24 C"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8,
                                            extra_body={"ignore_eos": True}, **GREEDY)
    assert second.choices[0].finish_reason == "length" and second.usage.completion_tokens == 8
    # The conversation as the client sent it, tools included, is the prompt /tokenize renders.
    dumped = [m if isinstance(m, dict) else m.model_dump(exclude_unset=True) for m in messages]
    tokens = httpx.post(live.url + "/tokenize", json={"messages": dumped, "tools": TOOLS}).json()
    assert tokens["count"] == second.usage.prompt_tokens
    text = live.tokenizer.decode(tokens["tokens"])
    assert "<tools>" in text and "<tool_response>\nSunny, 24 C\n</tool_response>" in text
    assert message.tool_calls[0].function.arguments in text


def test_auto_and_none_leave_text_free(live):
    client = live.client()
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12,
                                          extra_body={"ignore_eos": True}, **GREEDY)
    assert auto.choices[0].finish_reason == "length" and auto.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, extra_body={"ignore_eos": True},
                                           **GREEDY)
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=12,
                                          extra_body={"ignore_eos": True}, **GREEDY)
    # "none": the tools stay out of the prompt and the output is not read for calls.
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_a_call_cut_off_by_the_token_limit(live):
    client = live.client()
    before = live.metrics()
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
              **GREEDY)
    full = client.chat.completions.create(max_tokens=200, logprobs=True, **kw).choices[0]
    pieces = [t.token for t in full.logprobs.content]
    inside = next(k for k in range(len(pieces)) if '"arguments": {"' in "".join(pieces[:k]))  # cut in the arguments
    cut = client.chat.completions.create(max_tokens=inside, **kw).choices[0]
    assert cut.finish_reason == "length" and not cut.message.tool_calls
    assert cut.message.content.startswith('<tool_call>\n{"name": "add", "arguments": {"')
    content, calls, reason = assemble(client.chat.completions.create(stream=True, max_tokens=inside, **kw))
    assert reason == "length" and content == "" and calls[0]["name"] == "add"  # streamed: sent as it came
    assert calls[0]["arguments"].startswith('{"')
    assert calls[0]["arguments"] in full.message.tool_calls[0].function.arguments
    after = wait_for(lambda: (m := live.metrics())["contbatch:tool_call_parse_failures_total"]
                     >= before["contbatch:tool_call_parse_failures_total"] + 2 and m, what="failures counted")
    # The whole call, and the streamed one cut off (it was sent, so it counts, as a failure too).
    assert after["contbatch:tool_calls_total"] == before["contbatch:tool_calls_total"] + 2


def test_tool_calls_are_counted(live):
    before = live.metrics()["contbatch:tool_calls_total"]
    resp = live.client().chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                 max_tokens=200, **GREEDY)
    assert live.metrics()["contbatch:tool_calls_total"] == before + len(resp.choices[0].message.tool_calls)


USER = {"role": "user", "content": "x"}
ERRORS = [
    ({"tools": []}, "tools", "at least 1"),
    ({"tools": TOOLS * 65}, "tools", "at most 128"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "two tools are named"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "pattern"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "not": {"const": "x"}}}}}}]}, "tools", "keyword 'not'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "must be a JSON schema of an object"),
    ({"tools": TOOLS, "structured_outputs": {"regex": "a+"}}, "structured_outputs", "cannot be combined with tools"),
    ({"messages": [{"role": "tool", "content": "3"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages", "assistant"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages", "needs content"),
    ({"functions": [{"name": "f"}]}, "functions", "unknown field"),
]


@pytest.mark.parametrize("extra, param, message", ERRORS)
def test_bad_tool_requests_are_400s_naming_the_field(live, extra, param, message):
    resp = httpx.post(live.v1 + "/chat/completions", json={"model": MODEL, "messages": [USER], **extra})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert message in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
