"""Bounds on a structured-output spec, checked before the backend sees it.

The backend (xgrammar) parses and compiles in C++ and cannot be interrupted: a 450-level schema
takes half a minute to parse, an object of 2,000 optional properties a minute to compile, and
Python's own JSON parser and our keyword walk recurse until they fail. So every spec is
measured here first, however it arrives (a JSON schema as an object or as a string, a regex,
a choice list, an EBNF grammar), by walks that never recurse, and refused with `ValueError`
naming the limit it passed. Within these limits compilation still has a time budget
(`grammar.py`); these limits keep what reaches it, and what is parsed on a request's own
thread, small.

`is_small` sorts out specs whose compile is cheap by construction (a few small objects, short
regexes without counted repetition): they compile at once, beside any slow compile, never
queued behind one.
"""

from __future__ import annotations

import re
from typing import Any

MAX_SCHEMA_NESTING = 64  # levels of JSON nesting (objects and arrays) in a schema document
MAX_SCHEMA_NODES = 20_000  # objects and arrays in a schema document
MAX_PROPERTIES = 2048  # properties of one object schema
MAX_OPTIONAL_PROPERTIES = 256  # of them not `required` (the backend's cost grows with their square)
MAX_ENUM = 4096  # values of one `enum`, and choices of a choice list
MAX_ALTERNATIVES = 1024  # schemas of one anyOf / oneOf / allOf / prefixItems
MAX_PATTERN_CHARS = 16_384  # one regex, a schema's `pattern`, or a property-name pattern
MAX_REPEAT = 10_000  # the bound of a counted repetition `{n}` / `{n,m}` in a regex
MAX_GRAMMAR_CHARS = 65_536  # an EBNF grammar
MAX_CHOICE_CHARS = 262_144  # all choices together
MAX_TEXT_CHARS = 1_048_576  # a schema given as a string

# What compiles in milliseconds whatever its content.
SMALL_SCHEMA_NODES = 256
SMALL_OPTIONAL_PROPERTIES = 32
SMALL_PATTERN_CHARS = 256
SMALL_CHOICE_CHARS = 16_384

_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _refuse(what: str, value: int, limit: int, unit: str) -> ValueError:
    return ValueError(f"structured output: {what} has {value} {unit}; at most {limit} are allowed")


def parse_schema_text(text: str) -> Any:
    """A JSON schema given as a string, parsed with a nesting limit (Python's parser recurses
    until a RecursionError); `ValueError` if it is too large, too deep or not JSON."""
    import pydantic_core

    if len(text) > MAX_TEXT_CHARS:
        raise _refuse("the JSON schema string", len(text), MAX_TEXT_CHARS, "characters")
    depth = max_nesting(text)
    if depth > MAX_SCHEMA_NESTING:
        raise ValueError(f"structured output: the JSON schema nests {depth} levels deep; at most "
                         f"{MAX_SCHEMA_NESTING} are allowed")
    try:
        return pydantic_core.from_json(text)
    except ValueError as exc:
        raise ValueError(f"structured output: the JSON schema is not valid JSON: {exc}") from None


def max_nesting(text: str) -> int:
    """The deepest bracket nesting of a JSON text, strings skipped (a linear scan; no parse)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def check_schema(schema: Any) -> bool:
    """Walk a schema document (without recursion) against every limit; True if it is small."""
    nodes = 0
    small = True
    stack: list[tuple[Any, int, str]] = [(schema, 1, "#")]
    while stack:
        node, depth, path = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        nodes += 1
        if depth > MAX_SCHEMA_NESTING:
            raise ValueError(f"structured output: the JSON schema nests deeper than {MAX_SCHEMA_NESTING} levels "
                             f"(at {path[:120]}...); at most {MAX_SCHEMA_NESTING} are allowed")
        if nodes > MAX_SCHEMA_NODES:
            raise _refuse("the JSON schema", nodes, MAX_SCHEMA_NODES, "objects and arrays or more")
        if isinstance(node, list):
            stack.extend((item, depth + 1, f"{path}/{i}") for i, item in enumerate(node))
            continue
        small &= _check_keywords(node, path)
        stack.extend((value, depth + 1, f"{path}/{key}") for key, value in node.items())
    return small and nodes <= SMALL_SCHEMA_NODES


def _check_keywords(node: dict, path: str) -> bool:
    """The limits of one schema object; True while it stays small."""
    small = True
    props = node.get("properties")
    if isinstance(props, dict):
        if len(props) > MAX_PROPERTIES:
            raise _refuse(f"the object at {path[:200]}", len(props), MAX_PROPERTIES, "properties")
        required = node.get("required")
        names = set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) else set()
        optional = sum(1 for name in props if name not in names)
        if optional > MAX_OPTIONAL_PROPERTIES:
            raise _refuse(f"the object at {path[:200]}", optional, MAX_OPTIONAL_PROPERTIES,
                          "optional properties (list them in 'required', or split the object)")
        small &= optional <= SMALL_OPTIONAL_PROPERTIES
    enum = node.get("enum")
    if isinstance(enum, list) and len(enum) > MAX_ENUM:
        raise _refuse(f"the enum at {path[:200]}", len(enum), MAX_ENUM, "values")
    for key in _SCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list) and len(value) > MAX_ALTERNATIVES:
            raise _refuse(f"'{key}' at {path[:200]}", len(value), MAX_ALTERNATIVES, "schemas")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        small &= check_regex(pattern, f"the pattern at {path[:200]}")
    return small


def check_regex(regex: str, what: str = "the regex") -> bool:
    """Length and counted-repetition bounds of a regex; True if it is small (short, and no
    counted repetition, whose cost grows with its bound)."""
    if len(regex) > MAX_PATTERN_CHARS:
        raise _refuse(what, len(regex), MAX_PATTERN_CHARS, "characters")
    repeats = _REPEAT.findall(regex)
    for low, high in repeats:
        bound = max(int(low), int(high) if high else 0)
        if bound > MAX_REPEAT:
            raise ValueError(f"structured output: {what} repeats something {bound} times; at most {MAX_REPEAT} "
                             "are allowed")
    return not repeats and len(regex) <= SMALL_PATTERN_CHARS


def check_choices(choices: list[str] | tuple[str, ...]) -> bool:
    if len(choices) > MAX_ENUM:
        raise _refuse("the choice list", len(choices), MAX_ENUM, "choices")
    chars = sum(len(c) for c in choices)
    if chars > MAX_CHOICE_CHARS:
        raise _refuse("the choice list", chars, MAX_CHOICE_CHARS, "characters")
    return chars <= SMALL_CHOICE_CHARS


def check_grammar(grammar: str) -> bool:
    """An EBNF grammar's length. Never small: a short grammar can still be costly to compile."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise _refuse("the grammar", len(grammar), MAX_GRAMMAR_CHARS, "characters")
    return False
