"""What a structured output may look like: a JSON schema, any JSON object, a regex, a choice
among strings, an EBNF grammar, or a structural tag, checked in full when the spec is built.

A spec is checked where the caller can still be told (construction raises `ValueError`), never
on the engine thread: the schema, regex or grammar is parsed by the backend (xgrammar), and a
JSON schema is walked for keywords the backend would not enforce. xgrammar silently ignores
some keywords (`not`, `if`, `uniqueItems`, unknown formats, ...); a constraint weaker than the
one asked for would pass output that does not validate, so those are refused, each by name.

The grammar itself is compiled later, off the engine thread, by `grammar.py`.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from . import limits


# String formats. xgrammar ignores some formats and only approximates others (dates with a
# 31st of February, IPv4 parts with leading zeros, hostname labels of any length). We enforce
# uuid and email with its own rules (exact), and these with exact patterns of our own, which
# may be stricter than the format (RFC 3339 with an upper-case "T" and at most 6 fraction
# digits; hostnames lower-case, at most three labels). Any other format is refused.
_DAY = ("((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))")
_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)-02-29"
_DATE = f"{_YEAR}-{_DAY}|{_LEAP}"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_LABEL = "[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
FORMAT_PATTERNS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"({_DATE})T{_TIME}",
    "ipv4": rf"{_OCTET}(\.{_OCTET}){{3}}",
    "hostname": rf"{_LABEL}(\.{_LABEL}){{0,2}}",
}
SUPPORTED_FORMATS = frozenset({"uuid", "email", *FORMAT_PATTERNS})
# Keywords that constrain nothing (annotations), and those whose value is data, not a schema.
_ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "deprecated", "readOnly",
                          "writeOnly", "discriminator"})
_DATA = frozenset({"enum", "const", "default", "examples"})
_PLAIN = frozenset({"type", "required", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                    "minLength", "maxLength", "pattern", "minItems", "maxItems", "minProperties",
                    "maxProperties"})
_SUBSCHEMA = frozenset({"items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
                        "additionalItems", "propertyNames"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_SPECIAL = frozenset({"multipleOf", "format", "uniqueItems", "$ref"})
# Why the backend cannot enforce what JSON Schema defines (for the error message).
_UNENFORCED = {
    "not": "negation", "if": "conditionals", "then": "conditionals", "else": "conditionals",
    "dependentRequired": "dependencies", "dependentSchemas": "dependencies", "dependencies": "dependencies",
    "contains": "containment", "minContains": "containment", "maxContains": "containment",
    "contentEncoding": "content encodings", "contentMediaType": "content encodings",
    "contentSchema": "content encodings", "$dynamicRef": "dynamic references",
    "$dynamicAnchor": "dynamic references", "$recursiveRef": "dynamic references", "$anchor": "anchors",
}


# xgrammar 0.2.9 writes the characters of a length-bounded JSON string (minLength, maxLength,
# propertyNames) as [^"\\\r\n], so raw control characters, which JSON forbids, get through.
# We compile its own EBNF with that class narrowed to what its unbounded strings allow.
_LOOSE_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def json_schema_grammar(source: str, strict: bool = True):
    """The backend's grammar for a JSON schema (one line, ", " and ": " separators)."""
    xgr = xgrammar()
    grammar = xgr.Grammar.from_json_schema(source, any_whitespace=False, strict_mode=strict)
    text = str(grammar)
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS)) if _LOOSE_CHARS in text else grammar


def backend_error(exc: Exception) -> str:
    """xgrammar's message without its C++ source location: '[12:00:00] /x/y.cc:94: msg'."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())


@functools.cache
def xgrammar():
    """Imported on first use (~2 s): a process that never constrains output never pays it."""
    import xgrammar as xgr

    return xgr


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: `json` (a JSON schema, dict or string), `json_object=True` (any JSON
    object), `regex`, `choice` (one of these strings, verbatim), `grammar` (xgrammar's EBNF,
    GBNF-like, with a `root` rule) or `structural_tag` (xgrammar's structural tag, dict or
    string: `{"type": "structural_tag", "format": {...}}`, text with tagged regions such as tool
    calls; see `_check_structural_tag` for the formats taken).

    JSON comes out on one line with `", "` and `": "` separators, and only the properties a
    schema lists unless it says `additionalProperties` (what OpenAI's strict mode does): a
    stricter output than the schema needs always validates, and free whitespace lets small
    models loop on blanks until they run out of tokens.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: dict[str, Any] | str | None = None
    source: str = field(init=False, repr=False, compare=False, default="")  # what the backend compiles
    small: bool = field(init=False, repr=False, compare=False, default=False)  # cheap to compile (limits.py)

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) is not None]
        if self.json_object is True:
            given.append("json_object")
        elif self.json_object is not False:
            raise ValueError(f"structured output: json_object must be a bool, got {self.json_object!r}")
        if len(given) != 1:
            raise ValueError("structured output takes exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag; got {', '.join(given) or 'none'}")
        source, small = getattr(self, f"_check_{given[0]}")()
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "small", small)

    @property
    def kind(self) -> str:
        for name in _KINDS:
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def key(self) -> tuple[str, str]:
        """Identical specs share one compiled grammar (the cache key)."""
        return self.kind, self.source

    # -- one check per kind; each returns the source the backend compiles, and whether it is
    # small (limits.py): every limit is checked before the backend parses anything ------------
    def _check_json(self) -> tuple[str, bool]:
        schema = self.json
        if isinstance(schema, str):
            schema = limits.parse_schema_text(schema)
        if not isinstance(schema, dict):
            raise ValueError(f"structured output: a JSON schema must be an object, got {type(schema).__name__}")
        small = limits.check_schema(schema)
        try:
            source = json.dumps(enforceable(schema), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"structured output: the JSON schema cannot be serialized: {exc}") from None
        return _parsed(source, "JSON schema", lambda xgr: json_schema_grammar(source)), small

    def _check_json_object(self) -> tuple[str, bool]:
        return '{"type": "object"}', True

    def _check_regex(self) -> tuple[str, bool]:
        if not isinstance(self.regex, str) or not self.regex:
            raise ValueError(f"structured output: regex must be a non-empty string, got {self.regex!r}")
        small = limits.check_regex(self.regex)
        return _parsed(self.regex, "regex", lambda xgr: xgr.Grammar.from_regex(self.regex)), small

    def _check_choice(self) -> tuple[str, bool]:
        choice = self.choice
        if isinstance(choice, (str, bytes)) or not isinstance(choice, (list, tuple)) or not choice:
            raise ValueError(f"structured output: choice must be a non-empty list of strings, got {choice!r}")
        if not all(isinstance(c, str) and c for c in choice):
            raise ValueError("structured output: every choice must be a non-empty string")
        small = limits.check_choices(choice)
        object.__setattr__(self, "choice", tuple(choice))
        # EBNF string literals escape like JSON strings.
        source = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choice))
        return _parsed(source, "choice", lambda xgr: xgr.Grammar.from_ebnf(source)), small

    def _check_grammar(self) -> tuple[str, bool]:
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise ValueError(f"structured output: grammar must be a non-empty EBNF string, got {self.grammar!r}")
        small = limits.check_grammar(self.grammar)
        return _parsed(self.grammar, "grammar", lambda xgr: xgr.Grammar.from_ebnf(self.grammar)), small

    def _check_structural_tag(self) -> tuple[str, bool]:
        """The tag's grammar as EBNF (compiled like `grammar=`). Every JSON schema in it is
        checked and compiled as `json=` is (limits, enforceable keywords, compact JSON), every
        regex and grammar as theirs are, and the whole document is bounded like a schema.
        Formats taken: const_string, json_schema (style "json"), any_text, regex, grammar
        (EBNF), sequence, or, tag (string begin), triggered_tags, tags_with_separator,
        optional, plus, star and repeat; a field xgrammar does not define is refused."""
        tag = self.structural_tag
        if isinstance(tag, str):
            try:
                tag = limits.parse_schema_text(tag)
            except ValueError as exc:
                raise ValueError(str(exc).replace("the JSON schema", "the structural tag")) from None
        if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or set(tag) != {"type", "format"}:
            raise ValueError('structured output: a structural tag must be {"type": "structural_tag", "format": {...}}')
        smalls = [limits.check_schema(tag)]  # nesting and size of the whole document, its schemas included
        doc = {"type": "structural_tag", "format": _tag_format(tag["format"], "format", smalls)}
        xgr = xgrammar()
        try:
            source = str(xgr.Grammar.from_structural_tag(json.dumps(doc, ensure_ascii=False)))
            xgr.Grammar.from_ebnf(source)  # what the compiler will parse
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"structured output: invalid structural tag: {backend_error(exc)}") from None
        return source, all(smalls)


_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")


@functools.cache
def _tag_formats() -> dict[str, type]:
    from xgrammar import structural_tag as st

    return {m.model_fields["type"].default: m for m in (
        st.ConstStringFormat, st.JSONSchemaFormat, st.AnyTextFormat, st.RegexFormat, st.GrammarFormat,
        st.SequenceFormat, st.OrFormat, st.TagFormat, st.TriggeredTagsFormat, st.TagsWithSeparatorFormat,
        st.OptionalFormat, st.PlusFormat, st.StarFormat, st.RepeatFormat)}


def _tag_format(node: Any, at: str, smalls: list[bool]) -> dict:
    """One structural-tag format as the backend takes it: schemas turned into our JSON grammar,
    contents converted below it (nesting is bounded by `limits.check_schema` first)."""
    kind = node.get("type") if isinstance(node, dict) else None
    model = _tag_formats().get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(f"structured output: unsupported structural tag format {kind!r} at {at}; supported: "
                         f"{', '.join(sorted(_tag_formats()))}")
    unknown = sorted(set(node) - set(model.model_fields))
    if unknown:
        raise ValueError(f"structured output: unknown field {unknown[0]!r} of the {kind} format at {at}")
    out = dict(node)
    if kind == "json_schema":
        schema = node.get("json_schema")
        if not isinstance(schema, dict) or node.get("style", "json") != "json" or set(node) - {"type", "json_schema",
                                                                                                "style"}:
            raise ValueError(f"structured output: the json_schema format at {at} takes a schema object (style "
                             "'json', no other options)")
        source = json.dumps(enforceable(schema, f"{at}/json_schema"), ensure_ascii=False, allow_nan=False)
        smalls.append(limits.check_schema(schema))
        try:
            return {"type": "grammar", "grammar": str(json_schema_grammar(source))}
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"structured output: invalid JSON schema at {at}: {backend_error(exc)}") from None
    if kind == "regex" and isinstance(node.get("pattern"), str):
        smalls.append(limits.check_regex(node["pattern"], f"the regex at {at}"))
    elif kind == "grammar":
        if node.get("syntax", "ebnf") != "ebnf" or not isinstance(node.get("grammar"), str):
            raise ValueError(f"structured output: the grammar format at {at} takes an EBNF string")
        smalls.append(limits.check_grammar(node["grammar"]))
    elif kind == "tag" and not isinstance(node.get("begin"), str):
        raise ValueError(f"structured output: the tag at {at} must begin with a string")
    elif kind == "repeat" and not (isinstance(node.get("max"), int) and 0 <= node["max"] <= limits.MAX_REPEAT):
        raise ValueError(f"structured output: the repeat at {at} needs a max of 0 to {limits.MAX_REPEAT}")
    if "content" in node:
        out["content"] = _tag_format(node["content"], f"{at}/content", smalls)
    for key in ("elements", "tags"):
        if key in node:
            if not isinstance(node[key], list) or not node[key]:
                raise ValueError(f"structured output: {key!r} at {at} must be a non-empty list of formats")
            out[key] = [_tag_format(sub, f"{at}/{key}/{i}", smalls) for i, sub in enumerate(node[key])]
    return out


def _parsed(source: str, what: str, parse) -> str:
    try:
        parse(xgrammar())
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"structured output: invalid {what}: {backend_error(exc)}") from None
    return source


# -- JSON schema keywords ------------------------------------------------------------------
def enforceable(schema: Any, path: str = "#") -> Any:
    """The schema as the backend compiles it, or `ValueError` naming the first keyword (and
    where it is) that the backend would not enforce. Data (`enum`, `const`, `default`,
    `examples`) is not walked: a property called "not" there is a value, not a keyword. A
    `format` the backend only approximates becomes the exact `pattern` of `FORMAT_PATTERNS`."""
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise ValueError(f"structured output: the schema at {path} must be an object or a boolean, "
                         f"got {type(schema).__name__}")
    out = {}
    for key, value in schema.items():
        at = f"{path}/{key}"
        if key in _ANNOTATIONS or key in _DATA or key in _PLAIN:
            out[key] = value
        elif key in _SUBSCHEMA:
            if isinstance(value, list):
                raise ValueError(f"structured output: JSON schema keyword {key!r} at {at} takes one schema, "
                                 "not a list (for tuples use 'prefixItems')")
            out[key] = enforceable(value, at)
        elif key in _SCHEMA_LISTS:
            out[key] = _schema_list(schema, key, value, at)
        elif key in _SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise ValueError(f"structured output: JSON schema keyword {key!r} at {at} must map names to schemas")
            out[key] = {name: enforceable(sub, f"{at}/{name}") for name, sub in value.items()}
        elif key in _SPECIAL:
            _check_special(schema, key, value, at)
            if key == "format" and value in FORMAT_PATTERNS:
                out["pattern"] = f"^({FORMAT_PATTERNS[value]})$"
            else:
                out[key] = value
        elif key in _UNENFORCED:
            raise ValueError(f"structured output: unsupported JSON schema keyword {key!r} at {path}: the backend "
                             f"cannot enforce {_UNENFORCED[key]}")
        else:
            raise ValueError(f"structured output: unsupported JSON schema keyword {key!r} at {path}: the backend "
                             "would ignore it")
    return out


def _schema_list(schema: dict, key: str, value: Any, at: str) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError(f"structured output: JSON schema keyword {key!r} at {at} must be a non-empty list of schemas")
    if key == "allOf" and len(value) > 1:
        raise ValueError(f"structured output: unsupported JSON schema keyword 'allOf' at {at} with "
                         f"{len(value)} schemas: the backend cannot enforce an intersection (merge them into one)")
    if key == "oneOf" and "discriminator" not in schema:
        raise ValueError(f"structured output: unsupported JSON schema keyword 'oneOf' at {at}: the backend "
                         "enforces it as anyOf (exactly-one is not checked); use anyOf, or a discriminated union")
    return [enforceable(sub, f"{at}/{i}") for i, sub in enumerate(value)]


def _check_special(schema: dict, key: str, value: Any, at: str) -> None:
    if key == "format" and value not in SUPPORTED_FORMATS:
        raise ValueError(f"structured output: unsupported JSON schema format {value!r} at {at}; the backend "
                         f"enforces {', '.join(sorted(SUPPORTED_FORMATS))}")
    if key == "format" and value in FORMAT_PATTERNS and "pattern" in schema:
        raise ValueError(f"structured output: unsupported JSON schema format {value!r} at {at} beside a 'pattern': "
                         "the backend enforces one pattern per string")
    if key == "uniqueItems" and value is not False:
        raise ValueError(f"structured output: unsupported JSON schema keyword 'uniqueItems' at {at}: the backend "
                         "cannot enforce unique items")
    if key == "multipleOf" and not (schema.get("type") == "integer" and isinstance(value, int)
                                    and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"structured output: unsupported JSON schema keyword 'multipleOf' at {at}: the backend "
                         "enforces it only on integer schemas with a positive integer divisor")
    if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
        raise ValueError(f"structured output: unsupported JSON schema $ref {value!r} at {at}: only references "
                         "inside the schema ('#/...') are resolved")
