"""Tool calling: function definitions in, tool calls out, for chat completions and Responses.

    spec.py       a request's tools, choice and parallelism, checked (`ToolRequest`)
    formats.py    the call formats (hermes, llama3_json, mistral): writing, grammar, scanning
    jsonscan.py   reading a call's JSON while it is generated
    stream.py     generated text -> content and calls, streamed or whole
    rendering.py  tools and calls in the prompt: the chat template's, or the server's fallback
    toolbox.py    one server's choice of format, and what each request gets from it

docs/tools.md describes the behaviour.
"""

from __future__ import annotations

from .spec import FunctionTool, ToolRequest, tool_request
from .toolbox import ToolContext, Toolbox

__all__ = ["FunctionTool", "ToolContext", "ToolRequest", "Toolbox", "tool_request"]
