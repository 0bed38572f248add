"""How a model writes tool calls: the three formats this server reads, writes and constrains.

- `hermes` (Hermes, Qwen 2.5/3, SmolLM3 and the default model): each call in its own
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` block, text around them.
- `llama3_json` (Llama 3.1-3.3): a bare `{"name": ..., "parameters": {...}}` object, calls
  separated by `; `.
- `mistral` (Mistral 7B v0.3, Mixtral, Nemo): `[TOOL_CALLS]` and a JSON list of
  `{"name": ..., "arguments": {...}}` objects, after any text.

A format says three things about its calls: how to write them (for conversation history on
templates without a tool section, `rendering.py`), the structural tag a response is
constrained to (`structural_tag`: a call once begun always matches its function's
parameters), and how to find them in generated text, as it arrives (`scan`, used by
`stream.py`). The scanner reads the exact form the grammar produces, whitespace aside.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .jsonscan import PARTIAL, ValueScanner, call_prefix, loads, skip_ws
from .spec import FunctionTool, ToolRequest


@dataclass
class CallScan:
    """One call found in a region: its name, its arguments text so far, and whether it ended."""

    start: int  # where the call's text begins
    name: str
    arguments: str
    complete: bool = False
    end: int = 0  # where its object ends, once complete


@dataclass
class RegionScan:
    """What a region of calls holds so far. `state`: "open" (may still grow), "closed" (ended
    at `end`), or "failed" at `end` (the text from there is not a call)."""

    calls: list[CallScan]
    state: str
    end: int = 0


@dataclass(frozen=True)
class ToolCallFormat:
    """One call format: its markers, and how a call and a run of calls are written."""

    name: str
    trigger: str  # the text that opens a region of calls
    opener: str  # what a region begins with before its first call ("" when the call itself is the trigger)
    closer: str | None  # what ends a region; None: it ends with its list / its last call
    listed: bool  # the calls of a region are a JSON list
    separator: str | None  # between calls outside a list (read), written as `joiner`
    joiner: str  # what the grammar puts between two calls
    key: str  # the arguments' key the grammar writes ("parameters" is read as well)
    call_head: str  # what the grammar writes before a call's object
    call_end: str  # what closes one call in the grammar
    skip_special_tokens: bool = True  # False: the trigger is a special token, kept in the text

    # -- writing ------------------------------------------------------------------------
    def call_begin(self, name: str) -> str:
        return f'{self.call_head}{{"name": {json.dumps(name)}, "{self.key}": '

    def write_calls(self, calls: list[tuple[str, str]]) -> str:
        """Calls (name, arguments JSON) as the model would write them."""
        text = self.joiner.join(self.call_begin(name) + arguments + self.call_end for name, arguments in calls)
        return f"{self.opener}[{text}]" if self.listed else text

    def instructions(self, tools: tuple[FunctionTool, ...]) -> str:
        """The system-prompt section that shows the tools and this format to a model whose chat
        template has no tool section of its own."""
        listing = "\n".join(json.dumps(t.template_dict(), ensure_ascii=False) for t in tools)
        example = self.write_calls([("<function-name>", "<args-json-object>")])
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n"
                "</tools>\n\nTo call functions, answer with each call written exactly like this, a JSON object with "
                f"the function name and its arguments:\n{example}")

    # -- constraining -------------------------------------------------------------------
    def structural_tag(self, req: ToolRequest, final: dict[str, Any] | None = None) -> dict:
        """The structural tag a response with these tools is constrained to. "required" and a
        named function: calls only; "auto": free text in which a call, once its trigger is
        written, must be complete and valid (or, with a `final` JSON schema, either calls or a
        JSON answer). One call at most unless `req.parallel`."""
        tags = [{"type": "tag", "begin": self.call_begin(t.name),
                 "content": {"type": "json_schema", "json_schema": t.arguments_schema()}, "end": self.call_end}
                for t in req.callable]
        single = not req.parallel or req.choice == "named"
        calls: dict = {"type": "tags_with_separator", "tags": tags, "separator": self.joiner, "at_least_one": True,
                       "stop_after_first": single}
        if self.listed:
            calls = {"type": "tag", "begin": self.opener + "[", "content": calls, "end": "]"}
        if req.choice in ("required", "named"):
            fmt = calls
        elif final is not None:
            fmt = {"type": "or", "elements": [calls, {"type": "json_schema", "json_schema": final}]}
        elif self.listed:
            fmt = {"type": "triggered_tags", "triggers": [self.trigger], "tags": [calls], "stop_after_first": True}
        else:
            fmt = {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags, "stop_after_first": single}
        return {"type": "structural_tag", "format": fmt}

    # -- reading --------------------------------------------------------------------------
    def scan(self, text: str, start: int, final: bool, names: frozenset[str],
             scanners: dict[int, ValueScanner]) -> RegionScan:
        """The calls of the region that begins at `start` (where `trigger` was found), as far as
        the text goes. "failed" at `end`: the calls before `end` are whole, and from `end` the
        text is not a call (a head that does not match, a function not among `names`, arguments
        that are not a JSON object, or, once `final`, a call left unfinished: it is then the
        last of `calls`). A call whose object is whole counts even if the text ends before the
        region's closer. `scanners` keeps argument scanners between calls on the growing text."""
        calls: list[CallScan] = []
        i = start + len(self.opener)
        if self.listed:
            i = skip_ws(text, i)
            if i >= len(text):
                return RegionScan(calls, "failed" if final else "open", start)
            if text[i] != "[":
                return RegionScan(calls, "failed", start)
            i += 1
        while True:
            i = skip_ws(text, i)
            call = self._call(text, i, names, scanners)
            if call is None:
                return RegionScan(calls, "failed", i if calls else start)
            if call == PARTIAL:
                return RegionScan(calls, "failed" if final else "open", i if calls else start)
            calls.append(call)
            if not call.complete:
                return RegionScan(calls, "failed" if final else "open", call.start)
            j = skip_ws(text, call.end)
            if j >= len(text):
                return RegionScan(calls, "closed" if final else "open", call.end)
            between = "," if self.listed else self.separator
            if between is None or text[j] != between:
                break
            i = j + 1
        if self.listed:
            return RegionScan(calls, "closed", j + 1) if text[j] == "]" else RegionScan(calls, "failed", j)
        if self.closer is None:
            return RegionScan(calls, "closed", call.end)
        if text.startswith(self.closer, j):
            return RegionScan(calls, "closed", j + len(self.closer))
        if self.closer.startswith(text[j:]):  # the closer is on its way (or was cut off at the end)
            return RegionScan(calls, "closed" if final else "open", len(text))
        return RegionScan(calls, "failed", j)

    def _call(self, text: str, i: int, names: frozenset[str],
              scanners: dict[int, ValueScanner]) -> CallScan | str | None:
        """The call object at `i`: PARTIAL while its head is unfinished, None if it cannot be
        a call of one of `names`."""
        found = call_prefix(text, i, (self.key, "parameters", "arguments"))
        if not isinstance(found, tuple):
            return found
        name, args_start = found
        if name not in names:
            return None
        scanner = scanners.setdefault(args_start, ValueScanner(args_start))
        end = scanner.advance(text)
        if scanner.bad:
            return None
        if end is None:
            return CallScan(i, name, text[args_start:])
        arguments = text[args_start:end]
        j = skip_ws(text, end)
        if j >= len(text):
            return CallScan(i, name, arguments)
        if text[j] != "}" or not _is_object(arguments):
            return None
        return CallScan(i, name, arguments, complete=True, end=j + 1)


def _is_object(text: str) -> bool:
    try:
        return isinstance(loads(text), dict)
    except ValueError:
        return False


HERMES = ToolCallFormat("hermes", "<tool_call>", "<tool_call>", "</tool_call>", False, None, "\n", "arguments",
                        "<tool_call>\n", "}\n</tool_call>")
LLAMA3_JSON = ToolCallFormat("llama3_json", '{"name"', "", None, False, ";", "; ", "parameters", "", "}")
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", None, True, None, ", ", "arguments", "", "}",
                         skip_special_tokens=False)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
