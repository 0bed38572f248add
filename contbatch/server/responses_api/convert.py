"""A Responses request in the terms the rest of the server speaks: conversation rows (as
`prompts.message_dicts` makes them), a `ToolRequest`, a structured output.

Input items become rows in order: a message is a message (text parts joined by newlines), a
`function_call` joins the assistant turn just before it (or starts one), a
`function_call_output` is a `tool` message. A stored response's history comes first, then the
new input; `instructions` go first of all as a system message, and are not stored with it (a
later request that continues it gives its own, as with OpenAI's API).
"""

from __future__ import annotations

from ...sampling.structured import StructuredOutput
from ..errors import bad_request
from ..tools import FunctionTool, ToolRequest, tool_request
from .schemas import FunctionChoice, FunctionCallItem, FunctionCallOutputItem, MessageItem, ResponsesRequest


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p.refusal if p.type == "refusal" else p.text for p in content)


def input_rows(req: ResponsesRequest, history: list[dict]) -> list[dict]:
    """The stored conversation (`history`) followed by the request's input, as rows."""
    rows = [dict(r) for r in history]
    names = {c["id"]: c["function"]["name"] for r in rows for c in r.get("tool_calls") or ()}
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for item in items:
        if isinstance(item, MessageItem):
            rows.append({"role": "system" if item.role == "developer" else item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            names[item.call_id] = item.name
            if rows and rows[-1]["role"] == "assistant":
                last = rows[-1]
                rows[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or ()), call]}
            else:
                rows.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "\n".join(p.text for p in item.output)
            row = {"role": "tool", "tool_call_id": item.call_id, "content": output}
            if item.call_id in names:
                row["name"] = names[item.call_id]
            rows.append(row)
    if not rows:
        raise bad_request("input must hold at least one item", "input")
    return rows


def with_instructions(rows: list[dict], instructions: str | None) -> list[dict]:
    return [{"role": "system", "content": instructions}, *rows] if instructions else rows


def responses_tools(req: ResponsesRequest) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked."""
    functions = [FunctionTool(t.name, t.description, t.parameters, t.strict) for t in req.tools or ()]
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        return tool_request(functions, "named", choice.name, req.parallel_tool_calls)
    return tool_request(functions, choice, None, req.parallel_tool_calls)


def text_format(req: ResponsesRequest) -> StructuredOutput | None:
    """`text.format`: a JSON schema, any JSON object, or free text (None)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    try:
        if fmt.type == "json_object":
            return StructuredOutput(json_object=True)
        return StructuredOutput(json=fmt.schema_)
    except ValueError as exc:
        raise bad_request(str(exc), "text.format") from None


def refuse_unsupported(req: ResponsesRequest, tools: ToolRequest | None) -> None:
    """What the models' output cannot carry with this request."""
    logprobs = req.top_logprobs is not None or "message.output_text.logprobs" in (req.include or ())
    if logprobs and tools is not None and tools.constrained:
        raise bad_request("logprobs cannot be combined with tools here: leave out top_logprobs and the "
                          "message.output_text.logprobs include, or the tools", "include")
