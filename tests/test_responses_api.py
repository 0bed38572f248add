"""`POST /v1/responses`, live, through the `openai` client (create, stream, parse) and raw SSE.

The prompt is the chat prompt of the same conversation (checked against `/tokenize`), a stored
response continues with `previous_response_id` (its prefix found in the cache), tools give
`function_call` items, `text.format` constrains the text; streams follow the Responses event
sequence; the store is bounded and says so when a response is gone.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from test_server import BLOCK, MODEL, start_server, wait_for

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": PARAMS}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                              "parameters": PARAMS}}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def live(tiny_dir):
    srv = start_server(tiny_dir, responses_store_size=3)
    yield srv
    srv.stop()


def prompt_tokens(srv, messages: list[dict], tools: list[dict] | None = None) -> int:
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    return httpx.post(srv.url + "/tokenize", json=body).json()["count"]


def events(srv, body: dict) -> list[dict]:
    """A raw Responses stream: each event's data, checked against its `event:` name."""
    out = []
    with httpx.stream("POST", srv.v1 + "/responses", json={"model": MODEL, "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                out.append(data)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_text_input_instructions_and_usage(live):
    client = live.client()
    resp = client.responses.create(model=MODEL, input="Name a colour.", instructions="Be brief.", max_output_tokens=8,
                                   **GREEDY)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    assert resp.usage.input_tokens == prompt_tokens(live, messages)
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    message = resp.output[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert resp.output_text == message.content[0].text
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens" and resp.usage.output_tokens == 8
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
    assert chat.choices[0].message.content == resp.output_text  # the same prompt, the same greedy tokens


def test_a_tool_loop_over_stored_responses(live):
    client = live.client()
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=60, **GREEDY)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[TOOL], max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny"}], **GREEDY)
    conversation = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call.call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}]
    assert second.usage.input_tokens == prompt_tokens(live, conversation, [CHAT_TOOL])
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // BLOCK * BLOCK - BLOCK > 0
    assert second.previous_response_id == first.id
    # The same turn with the output items sent back instead of the stored id: the same prompt.
    resent = client.responses.create(model=MODEL, tools=[TOOL], max_output_tokens=4, store=False, **GREEDY, input=[
        {"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    assert resent.usage.input_tokens == second.usage.input_tokens and resent.output_text == second.output_text
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(resent.id)  # store: false


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=1000)


def test_parse_returns_the_model_of_text_format(live):
    parsed = live.client().responses.parse(model=MODEL, input="A city, as JSON.", text_format=City,
                                           max_output_tokens=80, **GREEDY)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    assert parsed.text.format.type == "json_schema"


def test_tools_with_a_text_format_give_a_call_or_the_json(live):
    client = live.client()
    for seed in range(3):
        resp = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL], max_output_tokens=80,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": PARAMS}},
                                       temperature=1.0, extra_body={"seed": seed})
        assert resp.status == "completed"
        item = resp.output[0]
        data = json.loads(item.arguments if item.type == "function_call" else resp.output_text)
        assert set(data) == {"city"} and len(data["city"]) <= 12


def test_a_text_stream_follows_the_event_sequence(live):
    got = events(live, {"input": "Say something.", "max_output_tokens": 12, **GREEDY})
    kinds = [e["type"] for e in got]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    final = got[-1]["response"]
    text = "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta")
    assert text == got[-4]["text"] == final["output"][0]["content"][0]["text"]
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []
    assert live.client().responses.retrieve(final["id"]).model_dump(exclude_none=True)["output"] == final["output"]


def test_a_call_streams_its_arguments(live):
    got = events(live, {"input": "Weather?", "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False,
                        "max_output_tokens": 60, **GREEDY})
    kinds = [e["type"] for e in got]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    deltas = "".join(e["delta"] for e in got if e["type"] == "response.function_call_arguments.delta")
    item = got[-1]["response"]["output"][0]
    assert item["type"] == "function_call" and deltas == got[-3]["arguments"] == item["arguments"]
    with live.client().responses.stream(model=MODEL, input="Weather?", tools=[TOOL], tool_choice="required",
                                        parallel_tool_calls=False, max_output_tokens=60, **GREEDY) as stream:
        seen = {e.type for e in stream}
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in seen and final.output[0].arguments == item["arguments"]


def test_logprobs_on_request(live):
    resp = live.client().responses.create(model=MODEL, input="Hi", max_output_tokens=5, top_logprobs=2,
                                          include=["message.output_text.logprobs"], **GREEDY)
    logprobs = resp.output[0].content[0].logprobs
    assert len(logprobs) == resp.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)


def test_the_store_is_bounded_and_says_so(live):
    client = live.client()
    made = [client.responses.create(model=MODEL, input=f"Story {i}", max_output_tokens=2, **GREEDY) for i in range(4)]
    assert live.metrics()["contbatch:responses_stored"] == 3
    with pytest.raises(openai.NotFoundError, match="the last 3 of them") as gone:
        client.responses.retrieve(made[0].id)
    assert gone.value.body["code"] == "response_not_found"
    resp = httpx.post(live.v1 + "/responses", json={"input": "x", "previous_response_id": made[0].id})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "previous_response_id"
    assert client.responses.retrieve(made[3].id).id == made[3].id
    client.responses.delete(made[3].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[3].id)


def test_requests_are_counted(live):
    before = live.metrics()
    live.client().responses.create(model=MODEL, input="x", max_output_tokens=1, store=False)
    events(live, {"input": "x", "max_output_tokens": 1, "store": False})
    after = live.metrics()
    for stream in ("true", "false"):
        key = f'contbatch:responses_requests_total{{stream="{stream}"}}'
        assert after[key] == before[key] + 1


def test_a_client_that_goes_away_cancels_its_response(live):
    before = live.metrics()
    body = {"model": MODEL, "input": "A long story", "max_output_tokens": 900, "stream": True}
    with httpx.stream("POST", live.v1 + "/responses", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert sum(1 for _, line in zip(range(18), lines) if line.startswith("data: ")) == 6
    aborts = 'contbatch:request_success_total{finished_reason="abort"}'
    wait_for(lambda: (m := live.metrics())[aborts] == before[aborts] + 1 and m["contbatch:num_requests_running"] == 0,
             what="the response to be cancelled")


ERRORS = [
    ({"input": []}, "input", "at least one item"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "function_call_output"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function"),
    ({"input": "x", "truncation": "auto"}, "truncation", "disabled"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "none"),
    ({"input": "x", "background": True}, "background", "False"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "unknown field"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"not": {}}}}}, "text.format",
     "keyword 'not'"),
    ({"input": "x", "tools": [TOOL], "top_logprobs": 1}, "include", "logprobs cannot be combined with tools"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "needs tools"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens", "maximum context length"),
    ({"input": "x", "model": "gpt-9"}, "model", "does not exist"),
]


@pytest.mark.parametrize("body, param, message", ERRORS)
def test_bad_requests_are_4xx_naming_the_field(live, body, param, message):
    resp = httpx.post(live.v1 + "/responses", json=body)
    assert 400 <= resp.status_code < 500, resp.text
    error = resp.json()["error"]
    assert message in error["message"] and error["param"] == param, error


def test_the_store_evicts_the_least_recently_used_by_count_and_bytes():
    from contbatch.server.errors import APIError
    from contbatch.server.responses_api import ResponseStore

    store = ResponseStore(max_entries=3, max_bytes=100)
    assert store.put({"id": "a"}, [], 40) and store.put({"id": "b"}, [], 40) and store.put({"id": "c"}, [], 10)
    store.get("a")  # used: "b" is now the oldest
    assert store.put({"id": "d"}, [], 40)  # 130 bytes: "b" goes
    assert [len(store), store.evicted] == [3, 1]
    with pytest.raises(APIError, match="not found"):
        store.get("b")
    assert not store.put({"id": "e"}, [], 101)  # larger than the whole store: not kept, nothing evicted
    assert store.get("a").history == [] and len(store) == 3
    store.delete("a")
    with pytest.raises(APIError) as gone:
        store.delete("a")
    assert gone.value.status == 404 and ResponseStore(0, 100).put({"id": "x"}, [], 1) is False
