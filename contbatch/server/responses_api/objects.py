"""Response objects and their output items, as plain dicts (`formatting.py`'s reasons), and the
stream events that build them.

`OutputBuilder` turns what the tool-call parser reads (text, a call's start, its argument
fragments, its end) into output items: a `message` with one `output_text` part for text, a
`function_call` item for each call; text after a call opens a new message. Every change comes
with the Responses stream event that says it (`response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`, ...), each event holding its own
copy of what it shows. A non-streaming response is built by the same builder.
"""

from __future__ import annotations

import copy
import time
import uuid

from ..tools.stream import CallArgs, CallEnd, CallStart, Text, ToolCall
from .prepare import PreparedResponse


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self) -> None:
        self.items: list[dict] = []
        self._message: int | None = None  # output index of the open message
        self._calls: dict[int, int] = {}  # parser's call index -> output index

    def apply(self, event, logprobs: list[dict] | None = None) -> list[dict]:
        """The stream events of one parser event (`logprobs`: for a text event's tokens)."""
        if isinstance(event, Text):
            return self.text(event.text, logprobs)
        if isinstance(event, CallStart):
            return self.call_start(event.index, event.call)
        if isinstance(event, CallArgs):
            return self.call_args(event.index, event.delta)
        if isinstance(event, CallEnd):
            return self.call_end(event.index, event.call)
        return []

    def text(self, delta: str, logprobs: list[dict] | None = None) -> list[dict]:
        events = []
        if self._message is None:
            self._message = len(self.items)
            item = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            self.items.append(item)
            events.append({"type": "response.output_item.added", "output_index": self._message,
                           "item": copy.deepcopy(item)})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": self._message, "content_index": 0, "part": copy.deepcopy(part)})
        item = self.items[self._message]
        part = item["content"][0]
        part["text"] += delta
        part["logprobs"].extend(logprobs or ())
        events.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": self._message,
                       "content_index": 0, "delta": delta, "logprobs": copy.deepcopy(logprobs or [])})
        return events

    def call_start(self, index: int, call: ToolCall) -> list[dict]:
        events = self.close_message("completed")
        self._calls[index] = len(self.items)
        item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                "name": call.name, "arguments": ""}
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": self._calls[index],
                       "item": copy.deepcopy(item)})
        return events

    def call_args(self, index: int, delta: str) -> list[dict]:
        item = self.items[self._calls[index]]
        item["arguments"] += delta
        return [{"type": "response.function_call_arguments.delta", "item_id": item["id"],
                 "output_index": self._calls[index], "delta": delta}]

    def call_end(self, index: int, call: ToolCall) -> list[dict]:
        item = self.items[self._calls[index]]
        item["status"] = "completed"
        return [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                 "output_index": self._calls[index], "name": item["name"], "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": self._calls[index], "item": copy.deepcopy(item)}]

    def close_message(self, status: str, logprobs: list[dict] | None = None) -> list[dict]:
        """End the open message (if any): its text, its part, its item."""
        if self._message is None:
            return []
        index, self._message = self._message, None
        item = self.items[index]
        part = item["content"][0]
        part["logprobs"].extend(logprobs or ())
        item["status"] = status
        return [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "text": part["text"], "logprobs": copy.deepcopy(part["logprobs"])},
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "part": copy.deepcopy(part)},
                {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]

    def history_row(self) -> dict:
        """The output as one assistant turn of a conversation (what a continuation sees)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        if calls:
            return {"role": "assistant", "content": text or None, "tool_calls": calls}
        return {"role": "assistant", "content": text}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def response_object(response_id: str, work: PreparedResponse, model: str, created: int, status: str,
                    output: list[dict], usage: dict | None = None, error: dict | None = None) -> dict:
    """The response object, echoing the request's settings as OpenAI's does."""
    req, params = work.req, work.params
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        choice = choice or "auto"
    else:
        choice = choice.model_dump()
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "background": False,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": error, "incomplete_details": incomplete, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "max_tool_calls": None, "model": model, "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "service_tier": "default", "store": req.store, "temperature": params.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
        "tool_choice": choice,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "top_logprobs": req.top_logprobs or 0, "top_p": params.top_p if params.top_p is not None else 1.0,
        "truncation": "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {},
    }
