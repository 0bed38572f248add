"""Tools and tool calls in the prompt: through the chat template, or written by the server.

A chat template with a tool section (Qwen, Llama 3.1, Mistral, Hermes, SmolLM3, ...) gets the
tools as transformers passes them (`tools=`), assistant messages with their `tool_calls`
(arguments as objects, as templates expect) and `tool` messages as they are. A template without
one (the default model's: its tool-free ChatML drops `tools` silently) gets the documented
fallback instead (docs/tools.md):
- the tools and the call format, as a section of the system prompt (`ToolCallFormat.instructions`;
  after the client's own system message, or as the first message);
- an assistant's calls written into its content as the model would write them;
- each `tool` message as a user turn `<tool_response>\\n...\\n</tool_response>` (consecutive ones
  in one turn), which every template renders.
With `tool_choice: "none"` the tools are left out of the prompt (the output is not read for
calls either); the conversation's earlier calls and results are rendered all the same.
"""

from __future__ import annotations

from typing import Any

from ..errors import bad_request
from .formats import ToolCallFormat
from .jsonscan import loads
from .spec import ToolRequest

_PROBE = "contbatch_probe_function"


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template writes the tools it is given (a probe function's name shows up
    in the rendered prompt)."""
    tool = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template that refuses tools, or this conversation: it has no usable tool section
        return False
    return isinstance(text, str) and _PROBE in text


def _arguments(text: str) -> Any:
    """A call's arguments as templates expect them (an object); text that is not JSON as is."""
    try:
        return loads(text)
    except ValueError:
        return text


def prompt_rows(rows: list[dict], tools: ToolRequest | None, fmt: ToolCallFormat,
                native: bool) -> tuple[list[dict], list[dict] | None]:
    """The conversation and the `tools=` argument for the chat template. `rows` are messages
    as `prompts.message_dicts` makes them (calls under `tool_calls`, results with role `tool`)."""
    shown = tools.tools if tools is not None and tools.choice != "none" else ()
    if native:
        out = []
        for row in rows:
            if row.get("tool_calls"):
                row = {**row, "tool_calls": [{**c, "function": {**c["function"],
                                                                "arguments": _arguments(c["function"]["arguments"])}}
                                             for c in row["tool_calls"]]}
            out.append(row)
        return out, [t.template_dict() for t in shown] or None
    out = []
    for row in rows:
        if row["role"] == "tool":
            result = f"<tool_response>\n{row['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        elif row.get("tool_calls"):
            calls = fmt.write_calls([(c["function"]["name"], c["function"]["arguments"]) for c in row["tool_calls"]])
            content = row.get("content") or ""
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        else:
            out.append({**row, "content": row.get("content") or ""})
    out = [{k: v for k, v in row.items() if k != "tool_results"} for row in out]
    if shown:
        section = fmt.instructions(shown)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, None


def check_escapable(tokenizer, rows: list[dict], tools: list[dict] | None) -> None:
    """With special tokens escaped, client text becomes plain text, but transformers leaves the
    keys of objects (argument and property names) as they are: one holding a control token
    is refused (400) rather than rendered as that token."""
    specials = [t for t in getattr(tokenizer, "added_tokens_encoder", {}) if t]
    if not specials:
        return
    stack: list[Any] = [tools or [], [r.get("tool_calls") or [] for r in rows]]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if isinstance(key, str) and any(s in key for s in specials):
                    raise bad_request("a key of the tools or tool-call arguments holds a special token, which this "
                                      "server does not escape in keys", "tools")
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and node[:1] in "{[":
            parsed = _arguments(node)
            if isinstance(parsed, (dict, list)):
                stack.append(parsed)
