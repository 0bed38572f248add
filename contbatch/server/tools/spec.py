"""What a request asks of tools, whichever API it came through: the functions, the choice, and
whether several calls may come at once.

Chat completions (`tools`, `tool_choice`, `parallel_tool_calls`) and the Responses API (its
flatter tool shape) both arrive here as a `ToolRequest`, checked once: unique names, a named
choice that exists, a choice that needs tools given tools. Everything after (prompt rendering,
the grammar, parsing the output) reads only this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..errors import bad_request

Choice = Literal["none", "auto", "required", "named"]
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class FunctionTool:
    """One function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def template_dict(self) -> dict:
        """The OpenAI chat shape chat templates take as `tools=`."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters if self.parameters is not None else ANY_OBJECT
        return {"type": "function", "function": function}

    def arguments_schema(self) -> dict[str, Any]:
        """The schema a call's arguments are constrained to: the parameters, or any JSON object
        when there are none, they are empty, or the function says `strict: false`."""
        if not self.parameters or self.strict is False:
            return ANY_OBJECT
        return self.parameters


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one request. `choice` "named" forces `named`; `parallel` allows more than
    one call in a response."""

    tools: tuple[FunctionTool, ...]
    choice: Choice = "auto"
    named: str | None = None
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def callable(self) -> tuple[FunctionTool, ...]:
        """The tools a call may name: all of them, the named one, or none ("none")."""
        if self.choice == "none":
            return ()
        if self.choice == "named":
            return tuple(t for t in self.tools if t.name == self.named)
        return self.tools

    @property
    def constrained(self) -> bool:
        """Calls are possible, so the output is parsed for them and constrained by a grammar."""
        return bool(self.callable)


def tool_request(tools: list[FunctionTool] | None, choice: str | None, named: str | None,
                 parallel: bool | None, param: str = "tools") -> ToolRequest | None:
    """The request's tools, checked; None when it has none. `choice` is "none", "auto",
    "required" or "named" (with `named`), None for the default ("auto" with tools, as OpenAI)."""
    if not tools:
        if choice in ("required", "named"):
            raise bad_request(f"tool_choice {choice if choice == 'required' else repr(named)} needs tools",
                              "tool_choice")
        return None
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise bad_request(f"two tools are named {tool.name!r}: function names must be unique", param)
        seen.add(tool.name)
        if tool.parameters is not None and tool.parameters.get("type", "object") != "object":
            raise bad_request(f"the parameters of {tool.name!r} must be a JSON schema of an object", param)
    if choice == "named" and named not in seen:
        raise bad_request(f"tool_choice names the function {named!r}, which is not among the tools", "tool_choice")
    return ToolRequest(tuple(tools), choice or "auto", named if choice == "named" else None,
                       True if parallel is None else parallel)
