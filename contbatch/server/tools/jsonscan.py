"""Reading the JSON of a tool call while it is still being generated.

A call's arguments stream out as the model writes them, so the parser must know where a JSON
value ends before the text after it exists, and must not read the same characters again on
every new token: `ValueScanner` finds a value's end reading each character once, however many
times it is asked. `call_prefix` reads the `{"name": "...", "arguments": ` head of a call, or
says that the text so far could still become one (`PARTIAL`), or cannot (`None`).
"""

from __future__ import annotations

import json
from typing import Any

import pydantic_core

WHITESPACE = " \t\r\n"
PARTIAL = "partial"  # the text ends inside something that may still match


def loads(text: str) -> Any:
    """JSON text parsed with a nesting limit (200 levels; `json.loads` recurses until the
    interpreter's limit): `ValueError` if it is not JSON or nests deeper."""
    return pydantic_core.from_json(text)


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


class ValueScanner:
    """Where the JSON value starting at `start` ends (brackets, strings and escapes; scalars run
    to the next delimiter). `advance(text)` reads what is new since the last call and returns
    the end (exclusive), None while the value is unfinished; `bad` once it cannot be a value.
    Only the extent is checked here: the finished value is parsed with `loads`."""

    __slots__ = ("start", "pos", "depth", "in_string", "escaped", "end", "bad", "scalar")

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.depth = 0
        self.in_string = self.escaped = False
        self.end: int | None = None
        self.bad = False
        self.scalar = False

    def advance(self, text: str) -> int | None:
        if self.end is not None or self.bad:
            return self.end
        if self.pos == self.start:
            if self.pos >= len(text):
                return None
            first = text[self.pos]
            if first not in '{["-0123456789tfn':
                self.bad = True
                return None
            self.scalar = first not in '{["'
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.scalar:
                if ch in ",}]" or ch in WHITESPACE:
                    self.end = i
                    return i
            elif self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.end = i + 1
                        return self.end
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
                    return self.end
        self.pos = len(text)
        return None


def _literal(text: str, i: int, options: tuple[str, ...]) -> int | str | None:
    """Past whichever of `options` is at `i`; PARTIAL if the text ends inside one."""
    for option in options:
        if text.startswith(option, i):
            return i + len(option)
    rest = text[i:]
    if any(option.startswith(rest) for option in options):
        return PARTIAL
    return None


def _string(text: str, i: int) -> tuple[str, int] | str | None:
    """The JSON string at `i` (decoded) and the index after it."""
    if i >= len(text):
        return PARTIAL
    if text[i] != '"':
        return None
    escaped = False
    for j in range(i + 1, len(text)):
        if escaped:
            escaped = False
        elif text[j] == "\\":
            escaped = True
        elif text[j] == '"':
            try:
                return json.loads(text[i:j + 1]), j + 1
            except ValueError:
                return None
    return PARTIAL


def call_prefix(text: str, i: int, keys: tuple[str, ...]) -> tuple[str, int] | str | None:
    """`{"name": "<name>", "<key>": ` at `i` (any whitespace between), with `key` one of `keys`:
    the name and where the arguments begin; PARTIAL if the text may still become that; None."""
    pos: int | str | None = i
    name = None
    steps: list[tuple[str, ...] | None] = [("{",), ('"name"',), (":",), None, (",",),
                                           tuple(f'"{k}"' for k in keys), (":",)]
    for step in steps:
        pos = skip_ws(text, pos)
        if pos >= len(text):
            return PARTIAL
        if step is None:
            found = _string(text, pos)
            if not isinstance(found, tuple):
                return found
            name, pos = found
        else:
            pos = _literal(text, pos, step)
            if not isinstance(pos, int):
                return pos
    pos = skip_ws(text, pos)
    if pos >= len(text):
        return PARTIAL
    return name, pos


def overlap(text: str, start: int, marker: str) -> int:
    """The length of the longest end of `text[start:]` that begins `marker` (text to hold back:
    it may be the start of a marker)."""
    longest = min(len(marker) - 1, len(text) - start)
    for k in range(longest, 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
