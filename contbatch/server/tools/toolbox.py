"""The tool calling of one server: which call format, how tools reach the prompt, the grammar
of a request with tools, and the parser of its output.

The format is `--tool-call-parser` (`ServerSettings.tool_call_parser`), or read from the chat
template: one that writes `[TOOL_CALLS]` is Mistral's, `<tool_call>` Hermes', `<|python_tag|>`
(or Llama 3's "dictionary of argument name" prompt) Llama 3's JSON; anything else, a template
without a tool section included, gets Hermes (docs/tools.md says why for the default model).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...sampling.limits import parse_schema_text
from ...sampling.structured import StructuredOutput
from ..errors import bad_request
from .formats import FORMATS, HERMES, LLAMA3_JSON, MISTRAL, ToolCallFormat
from .rendering import check_escapable, prompt_rows, template_renders_tools
from .spec import ANY_OBJECT, ToolRequest
from .stream import ToolCallStream

logger = logging.getLogger("contbatch.server")


def select_format(tokenizer, name: str | None) -> tuple[ToolCallFormat, str]:
    """The call format, and why it was chosen."""
    if name not in (None, "auto"):
        if name not in FORMATS:
            raise ValueError(f"unknown tool call parser {name!r}; choose one of auto, {', '.join(sorted(FORMATS))}")
        return FORMATS[name], "--tool-call-parser"
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: the default one speaks for the model
        template = template.get("default") or next(iter(template.values()), "")
    if "[TOOL_CALLS]" in template:
        return MISTRAL, "the chat template writes [TOOL_CALLS]"
    if "<tool_call>" in template:
        return HERMES, "the chat template writes <tool_call>"
    if "<|python_tag|>" in template or "dictionary of argument name" in template:
        return LLAMA3_JSON, "the chat template writes Llama 3's JSON calls"
    return HERMES, "the chat template names no call format"


@dataclass(frozen=True)
class ToolContext:
    """What the response writer needs to read one request's calls."""

    fmt: ToolCallFormat
    names: frozenset[str]
    end_tokens: tuple[str, ...]

    def stream(self, request_id: str, streaming: bool = True) -> ToolCallStream:
        return ToolCallStream(self.fmt, self.names, streaming, request_id, self.end_tokens)


class Toolbox:
    """Tool calling for one tokenizer (one app)."""

    def __init__(self, tokenizer, parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.fmt, self.reason = select_format(tokenizer, parser)
        self.native = template_renders_tools(tokenizer)
        eos = getattr(tokenizer, "eos_token", None)
        self.end_tokens = () if self.fmt.skip_special_tokens or not eos else (eos,)
        logger.info("tool calls: the %s format (%s); tools are rendered %s", self.fmt.name, self.reason,
                    "by the chat template" if self.native else "into the system prompt by the server")

    def prompt(self, rows: list[dict], tools: ToolRequest | None,
               escape_special_tokens: bool) -> tuple[list[dict], list[dict] | None]:
        """The conversation and `tools=` for the chat template."""
        rows, template_tools = prompt_rows(rows, tools, self.fmt, self.native)
        if escape_special_tokens and self.native:
            check_escapable(self.tokenizer, rows, template_tools)
        return rows, template_tools

    def constraint(self, tools: ToolRequest | None, final: StructuredOutput | None) -> StructuredOutput | None:
        """What the request's output is constrained to: its tools' calls (with `final`, the JSON
        answer the client asked for, as the alternative to calls under "auto"), else `final`.
        A tool schema that cannot be enforced, or is past a limit, is a 400 naming it."""
        if tools is None or not tools.constrained:
            return final
        schema = None
        if final is not None and tools.choice == "auto":
            if final.kind not in ("json", "json_object"):
                raise bad_request(f"structured output of kind {final.kind!r} cannot be combined with tools; "
                                  "give a JSON schema or json_object", "structured_outputs")
            schema = ANY_OBJECT if final.kind == "json_object" else \
                (parse_schema_text(final.json) if isinstance(final.json, str) else final.json)
        try:
            return StructuredOutput(structural_tag=self.fmt.structural_tag(tools, schema))
        except ValueError as exc:
            raise bad_request(str(exc), "tools") from None

    def context(self, tools: ToolRequest | None) -> ToolContext | None:
        """How to read the output for calls; None when no call is possible."""
        if tools is None or not tools.constrained:
            return None
        return ToolContext(self.fmt, frozenset(t.name for t in tools.callable), self.end_tokens)
