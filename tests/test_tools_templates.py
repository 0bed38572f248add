"""Tool calling on other chat templates and call formats, live: a template with its own tool
section renders the tools and calls itself (arguments as objects); `tool_call_parser` picks
Llama 3's JSON calls; a Mistral-style tokenizer keeps its `[TOOL_CALLS]` special token in the
text the parser reads, and not its end token.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from test_server import MODEL, start_server
from transformers import AutoTokenizer

from contbatch.server import ServerSettings

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
HISTORY = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"}]

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call tools inside <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}<|im_end|>"
    "{%- else %}{{ m.content }}<|im_end|>{% endif %}{% endfor %}")


def tiny_copy(tiny_dir, out, template: str, special: str | None = None):
    """The tiny model with another chat template, and `special` as a special token in place of
    one the model never uses (the same vocabulary, so the same weights)."""
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = template
    tok.save_pretrained(out)
    if special is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            path = out / name
            path.write_text(path.read_text().replace("<empty_output>", special))
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def servers(tiny_dir, tmp_path_factory):
    made = {
        "native": start_server(tiny_copy(tiny_dir, tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE)),
        "llama3": start_server(tiny_dir, tool_call_parser="llama3_json"),
        "mistral": start_server(tiny_copy(tiny_dir, tmp_path_factory.mktemp("mistral"), MISTRAL_TEMPLATE,
                                          "[TOOL_CALLS]")),
    }
    yield made
    for srv in made.values():
        srv.stop()


def call(srv, **kw):
    return srv.client().chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=120, temperature=0, **kw)


def prompt_text(srv, messages) -> str:
    body = {"messages": messages, "tools": [TOOL]}
    return srv.tokenizer.decode(httpx.post(srv.url + "/tokenize", json=body).json()["tokens"])


def test_a_template_with_a_tool_section_renders_tools_and_calls_itself(servers):
    srv = servers["native"]
    text = prompt_text(srv, HISTORY)
    assert json.dumps(TOOL) in text and "Call tools inside" in text and "# Tools" not in text
    # The earlier call's arguments reached the template as an object (tojson of an object).
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    message = call(srv).choices[0].message
    assert message.tool_calls[0].function.name == "add"
    assert set(json.loads(message.tool_calls[0].function.arguments)) == {"a", "b"}


def test_the_parser_flag_picks_llama3_json_calls(servers):
    srv = servers["llama3"]
    text = prompt_text(srv, HISTORY)
    assert '{"name": "add", "parameters": {"a": 2, "b": 3}}' in text  # the fallback writes calls in the format
    resp = call(srv, logprobs=True)
    written = "".join(t.token for t in resp.choices[0].logprobs.content)
    assert written.startswith('{"name": "add", "parameters": {')
    assert resp.choices[0].finish_reason == "tool_calls" and resp.choices[0].message.content is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerSettings(served_model_names=("x",), tool_call_parser="xml")


def test_a_special_token_marker_is_kept_for_the_parser(servers):
    srv = servers["mistral"]
    marker = srv.tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    assert srv.tokenizer.decode([marker], skip_special_tokens=True) == ""  # a special token: decoding drops it
    text = prompt_text(srv, HISTORY)
    assert '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]' in text and "[AVAILABLE_TOOLS]" in text
    resp = call(srv)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"a", "b"}
    chunks = list(srv.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[TOOL], tool_choice="required", max_tokens=120, temperature=0, stream=True,
        parallel_tool_calls=False))
    args = "".join(tc.function.arguments or "" for c in chunks if c.choices
                   for tc in c.choices[0].delta.tool_calls or ())
    assert args == choice.message.tool_calls[0].function.arguments
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # no "[TOOL_CALLS]", no end token
