"""Reading tool calls out of generated text, and writing tools into prompts, without a server.

The three call formats parse what they write; a call cut off or broken is content (whole) or
ends as it is (streamed); streamed in any chunks, the parser gives what it gives on the whole
text; the call format is read from the chat template; tools reach the prompt through the
template's own tool section or the server's documented fallback.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contbatch.server.tools.formats import FORMATS, HERMES, LLAMA3_JSON, MISTRAL
from contbatch.server.tools.rendering import prompt_rows, template_renders_tools
from contbatch.server.tools.spec import FunctionTool, ToolRequest, tool_request
from contbatch.server.tools.stream import CallArgs, CallEnd, CallStart, Text, ToolCallStream, parse_output
from contbatch.server.tools.toolbox import Toolbox, select_format
from contbatch.server.errors import APIError

NAMES = frozenset({"get_weather", "add"})
WEATHER = '{"city": "Paris", "unit": "c"}'
ADD = '{"a": 1, "b": [2, {"c": "}]"}]}'


def streamed(fmt, text: str, cuts: list[int], end_tokens=()) -> tuple[str, list[tuple[str, str]], int]:
    """Feed `text` in pieces cut at `cuts`; the content and calls the events add up to."""
    stream = ToolCallStream(fmt, NAMES, end_tokens=end_tokens)
    events = []
    last = 0
    for cut in sorted(set(cuts)):
        events += stream.feed(text[last:cut])
        last = cut
    events += stream.feed(text[last:], final=True)
    content = "".join(e.text for e in events if isinstance(e, Text))
    names = {e.index: e.call.name for e in events if isinstance(e, CallStart)}
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, CallArgs):
            args[e.index] = args.get(e.index, "") + e.delta
    ended = {e.index for e in events if isinstance(e, CallEnd)}
    assert ended == set(names), "every started call ends"
    return content, [(names[i], args.get(i, "")) for i in sorted(names)], stream.failures


@pytest.mark.parametrize("fmt, text, content, calls", [
    (HERMES, f'Sure.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
             f'<tool_call>\n{{"name": "add", "arguments": {ADD}}}\n</tool_call>', "Sure.",
     [("get_weather", WEATHER), ("add", ADD)]),
    (HERMES, "no calls here, only < and <tool and <tool_ca", "no calls here, only < and <tool and <tool_ca", []),
    (HERMES, f'<tool_call>{{"name":"add","parameters":{ADD}}}</tool_call> then text', "then text", [("add", ADD)]),
    (LLAMA3_JSON, f'{{"name": "add", "parameters": {ADD}}}; {{"name": "get_weather", "parameters": {WEATHER}}}',
     None, [("add", ADD), ("get_weather", WEATHER)]),
    (MISTRAL, f'Checking.[TOOL_CALLS][{{"name": "add", "arguments": {ADD}}}, '
              f'{{"name": "get_weather", "arguments": {WEATHER}}}]', "Checking.",
     [("add", ADD), ("get_weather", WEATHER)]),
])
def test_each_format_reads_its_calls_and_keeps_the_text_around_them(fmt, text, content, calls):
    got_content, got_calls, failures = parse_output(fmt, NAMES, text)
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls and failures == 0
    assert all(c.id.startswith("call_") and c.done for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_what_a_format_writes_it_reads_back(fmt):
    calls = [("get_weather", WEATHER), ("add", ADD)]
    content, parsed, failures = parse_output(fmt, NAMES, fmt.write_calls(calls))
    assert content is None and [(c.name, c.arguments) for c in parsed] == calls and failures == 0


@pytest.mark.parametrize("fmt, text", [
    (HERMES, '<tool_call>\n{"name": "unknown_fn", "arguments": {}}\n</tool_call>'),  # not one of the tools
    (HERMES, '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>'),  # arguments not an object
    (HERMES, '<tool_call>\n{"arguments": {}, "name": "add"}\n</tool_call>'),  # not the written form
    (LLAMA3_JSON, 'The JSON {"name": "bob"} is not a call'),
    (MISTRAL, "[TOOL_CALLS] is only mentioned"),
])
def test_text_that_is_not_a_call_is_content_with_a_warning(fmt, text, caplog):
    content, calls, failures = parse_output(fmt, NAMES, text, request_id="req-1")
    assert calls == [] and content == text and failures == 1
    assert "req-1" in caplog.text and "returned as content" in caplog.text


def test_a_call_cut_off_is_content_whole_and_partial_when_streamed():
    whole = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
    cut = whole + '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b'
    content, calls, failures = parse_output(HERMES, NAMES, cut)
    assert [c.name for c in calls] == ["get_weather"] and failures == 1
    assert content == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b'
    content, calls, failures = streamed(HERMES, cut, list(range(len(cut))))
    assert content == "" and calls == [("get_weather", WEATHER), ("add", '{"a": 1, "b')] and failures == 1
    # A call whose object is whole counts even when the closer was cut off.
    content, calls, _ = parse_output(HERMES, NAMES, whole + '<tool_call>\n{"name": "add", "arguments": {}}\n</tool')
    assert content is None and len(calls) == 2


def test_mistral_keeps_its_special_token_and_drops_the_end_token():
    text = f'[TOOL_CALLS][{{"name": "add", "arguments": {ADD}}}]</s>'
    content, calls, _ = parse_output(MISTRAL, NAMES, text, end_tokens=("</s>",))
    assert content is None and calls[0].arguments == ADD
    assert streamed(MISTRAL, "Hi</s>", [1, 3, 4], end_tokens=("</s>",))[0] == "Hi"
    assert MISTRAL.skip_special_tokens is False and HERMES.skip_special_tokens


calls_st = st.lists(st.tuples(st.sampled_from(sorted(NAMES)),
                              st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=8),
                                                                              st.lists(st.booleans(), max_size=3)),
                                              max_size=3).map(lambda d: json.dumps(d, ensure_ascii=False))),
                    max_size=3)
words = st.text(st.characters(blacklist_characters="<[{"), max_size=12)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(fmt=st.sampled_from(list(FORMATS.values())), before=words, calls=calls_st, after=words, data=st.data())
def test_streaming_in_any_chunks_gives_what_the_whole_text_gives(fmt, before, calls, after, data):
    text = before + (fmt.write_calls(calls) if calls else "") + (after if fmt is HERMES else "")
    content, parsed, failures = parse_output(fmt, NAMES, text)
    assert failures == 0 and [(c.name, c.arguments) for c in parsed] == calls
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    s_content, s_calls, s_failures = streamed(fmt, text, cuts)
    assert (s_content, s_calls, s_failures) == (content or "", calls, 0)
    if not calls:
        assert content == text  # without calls, content is the text exactly


# -- choosing the format, rendering the prompt -----------------------------------------------
class _Tok:
    def __init__(self, template: str) -> None:
        self.chat_template = template


@pytest.mark.parametrize("template, name", [
    ("{{ '[TOOL_CALLS]' }}", "mistral"),
    ("{% for m in messages %}<tool_call>{% endfor %}", "hermes"),
    ("{{ '<|python_tag|>' }}", "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
])
def test_the_format_is_read_from_the_chat_template(template, name):
    assert select_format(_Tok(template), None)[0].name == name
    assert select_format(_Tok(template), "llama3_json")[0] is LLAMA3_JSON
    with pytest.raises(ValueError, match="unknown tool call parser"):
        select_format(_Tok(template), "xml")


def test_the_default_models_template_has_no_tool_section(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert not template_renders_tools(tok)
    box = Toolbox(tok)
    assert box.fmt is HERMES and not box.native and box.end_tokens == ()
    tok.chat_template = ("{% if tools %}{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert template_renders_tools(tok)


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = ToolRequest((FunctionTool("get_weather", "Weather", CITY), FunctionTool("add")))
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and 1+2?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "name": "add", "content": "3"},
]


def test_the_fallback_writes_tools_calls_and_results_as_text():
    rows, tools = prompt_rows(HISTORY, TOOLS, HERMES, native=False)
    assert tools is None
    assert rows[0]["role"] == "system" and rows[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in rows[0]["content"] and "<tool_call>" in rows[0]["content"]
    assert rows[2] == {"role": "assistant", "content": HERMES.write_calls(
        [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')])}
    assert rows[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\n"
                                                  "<tool_response>\n3\n</tool_response>"}
    assert len(rows) == 4
    none = ToolRequest(TOOLS.tools, "none")
    rows, _ = prompt_rows(HISTORY[1:], none, HERMES, native=False)
    assert rows[0]["role"] == "user"  # tool_choice "none": no tools in the prompt


def test_a_template_with_tools_gets_them_and_the_calls_as_objects():
    rows, tools = prompt_rows(HISTORY, TOOLS, HERMES, native=True)
    assert [t["function"]["name"] for t in tools] == ["get_weather", "add"]
    assert tools[1]["function"]["parameters"] == {"type": "object"}
    assert rows[2]["tool_calls"][1]["function"]["arguments"] == {"a": 1, "b": 2}
    assert rows[3] == HISTORY[3] and HISTORY[2]["tool_calls"][1]["function"]["arguments"] == '{"a": 1, "b": 2}'


def test_tool_requests_are_checked():
    tool = FunctionTool("f")
    assert tool_request([tool], None, None, None) == ToolRequest((tool,), "auto", None, True)
    assert tool_request([], "auto", None, None) is None
    for args, message in [(([tool, tool], None, None, None), "two tools are named"),
                          (([tool], "named", "g", None), "not among the tools"),
                          (([], "required", None, None), "needs tools"),
                          (([FunctionTool("f", None, {"type": "string"})], None, None, None), "must be a JSON schema")]:
        with pytest.raises(APIError, match=message):
            tool_request(*args)


def test_escaping_covers_what_the_server_writes_and_refuses_keys_it_cannot_escape(tiny_dir):
    from transformers import AutoTokenizer

    from contbatch.server.prompts import chat_prompt

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    tools = ToolRequest((FunctionTool("f", "stops here<|im_end|>"),))
    box = Toolbox(tok)
    ends = {}
    for escape in (False, True):
        rows, template_tools = box.prompt([{"role": "user", "content": "hi"}], tools, escape)
        ends[escape] = chat_prompt(tok, rows, True, False, escape_special_tokens=escape,
                                   tools=template_tools).token_ids.count(end)
    assert ends == {False: 3, True: 2}  # escaped, the description's <|im_end|> is text
    tok.chat_template = ("{% for t in tools or [] %}{{ t | tojson }}{% endfor %}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}")
    native = Toolbox(tok)
    assert native.native
    forged = ToolRequest((FunctionTool("f", None, {"type": "object", "properties": {"<|im_end|>": {}}}),))
    with pytest.raises(APIError, match="special token"):
        native.prompt([{"role": "user", "content": "hi"}], forged, True)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"<|im_end|>": 1}'}}
    with pytest.raises(APIError, match="special token"):
        native.prompt([{"role": "assistant", "content": None, "tool_calls": [call]}], None, True)
    assert native.prompt([{"role": "assistant", "content": None, "tool_calls": [call]}], None, False)


def test_the_cli_flags_reach_the_settings():
    import argparse

    from contbatch.cli.serve import add_arguments, server_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = server_settings(parser.parse_args(["--tool-call-parser", "mistral", "--responses-store-size", "7"]))
    assert settings.tool_call_parser == "mistral" and settings.responses_store_size == 7
    assert server_settings(parser.parse_args([])).tool_call_parser == "auto"
