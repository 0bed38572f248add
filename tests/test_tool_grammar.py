"""Constrained tool calls: structural tags go through the structured-output checks and compile
path, and for any tool schema every call a constrained output can hold parses and validates.

The property test walks the grammar itself, token by token over the default model's
vocabulary (a random allowed token each step, leaning towards closing tokens after a while),
for random schemas, in each call format and tool choice; every call in the result must parse
and validate against its function's parameters (`jsonschema`).
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from contbatch import StructuredOutput
from contbatch.sampling.grammar import GrammarCompiler
from contbatch.server.tools.formats import FORMATS, HERMES
from contbatch.server.tools.spec import FunctionTool, ToolRequest
from contbatch.server.tools.stream import parse_output

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}


@pytest.fixture(scope="module")
def vocab(tiny_dir):
    """The default model's tokenizer, a compiler for it, and which tokens close things."""
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    texts = [tok.decode([i]) for i in range(len(tok))]
    closing = torch.tensor([i for i, t in enumerate(texts) if len(t.strip()) == 1 and t.strip() in '"}],0123456789'])
    return tok, info, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), closing


def walk(vocab, source: str, rng: random.Random, prefix: str = "", steps: int = 300) -> tuple[str, bool]:
    """A random output of the grammar (after `prefix`, which it must accept): its text, and
    whether the grammar reached its end."""
    tok, info, compiler, closing = vocab
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(source))
    ids = list(tok.encode(prefix, add_special_tokens=False)) if prefix else []
    for token in ids:
        assert matcher.accept_token(token), prefix
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    shifts = torch.arange(32, dtype=torch.int32)
    for step in range(steps):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask)
        allowed = ((bitmask[0].unsqueeze(1) >> shifts) & 1).flatten()[:info.vocab_size].bool()
        if step > 25 and allowed[tok.eos_token_id] and rng.random() < 0.5:
            token = tok.eos_token_id
        else:
            near = closing[allowed[closing]] if step > 25 else torch.tensor([], dtype=torch.long)
            pool = near if len(near) else torch.nonzero(allowed).flatten()
            token = int(pool[rng.randrange(len(pool))])
        assert matcher.accept_token(token)
        ids.append(token)
    return tok.decode(ids, skip_special_tokens=True), matcher.is_terminated()


def tag_spec(fmt, req: ToolRequest) -> StructuredOutput:
    return StructuredOutput(structural_tag=fmt.structural_tag(req))


# -- the structured-output contract -----------------------------------------------------
def test_a_structural_tag_is_a_structured_output_kind_with_its_key_small_and_source():
    spec = tag_spec(HERMES, ToolRequest((FunctionTool("get_weather", None, CITY),)))
    assert spec.kind == "structural_tag" and spec.small and spec.key == ("structural_tag", spec.source)
    assert "TagDispatch" in spec.source and spec == tag_spec(HERMES, ToolRequest((FunctionTool("get_weather", None,
                                                                                               CITY),)))
    big = ToolRequest(tuple(FunctionTool(f"f{i}", None, {"type": "object", "properties": {
        f"p{j}": {"type": "string"} for j in range(40)}}) for i in range(3)))
    assert not tag_spec(HERMES, big).small  # 40 optional properties: compiled in a worker first


@pytest.mark.parametrize("tag, message", [
    ({"type": "structural_tag", "format": {"type": "token", "token": 1}}, "unsupported structural tag format"),
    ({"type": "structural_tag", "format": {"type": "const_string", "value": "x", "extra": 1}}, "unknown field"),
    ({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>", "content": {
        "type": "json_schema", "json_schema": {"type": "object", "not": {}}}}}, "keyword 'not'"),
    ({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>", "content": {
        "type": "json_schema", "json_schema": {"type": "object", "properties": {
            f"p{i}": {"type": "string"} for i in range(300)}}}}}, "at most 256"),
    ({"type": "structural_tag", "format": {"type": "or", "elements": []}}, "non-empty list"),
    ({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "content": {"type": "any_text"}}},
     "invalid structural tag"),
    ({"type": "json_schema"}, "must be"),
    ("[" * 100, "nests"),
])
def test_structural_tags_are_checked_before_the_backend_compiles(tag, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(structural_tag=tag)


def test_bounded_strings_in_a_tag_never_allow_control_characters():
    spec = tag_spec(HERMES, ToolRequest((FunctionTool("get_weather", None, CITY),)))
    assert '[^"\\\\\\r\\n]' not in spec.source  # xgrammar's own class for bounded strings lets \x01 through


@pytest.mark.parametrize("tools", [1, 12])
def test_tags_compile_through_the_grammar_compiler(tiny_dir, tools):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    try:
        props = {f"p{j}": {"type": "string", "maxLength": 4} for j in range(40)}
        req = ToolRequest(tuple(FunctionTool(f"f{i}", None, {"type": "object", "properties": props})
                                for i in range(tools)), "required")
        spec = tag_spec(HERMES, req)
        assert spec.small is False  # 40 optional properties: always tried in a worker process first
        compiled = compiler.compile(spec).result(timeout=120)
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string('<tool_call>\n{"name": "f0", "arguments": {"p1": "ab"}}\n</tool_call>')
        assert not xgr.GrammarMatcher(compiled).accept_string('<tool_call>\n{"name": "nope"')
        assert compiler.compile(spec).result() is compiled  # cached by its key
    finally:
        compiler.close()


# -- every constrained call validates ----------------------------------------------------
names = st.from_regex(r"[a-z]{1,6}", fullmatch=True)
leaves = st.one_of(
    st.just({"type": "boolean"}),
    st.integers(-50, 50).flatmap(lambda lo: st.integers(lo, lo + 200).map(
        lambda hi: {"type": "integer", "minimum": lo, "maximum": hi})),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("ab yz", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    st.just({"type": "string", "format": "date"}),
)


def objects(inner):
    return st.dictionaries(names, inner, max_size=4).flatmap(lambda props: st.lists(
        st.sampled_from(sorted(props)), unique=True).map(lambda req: {
            "type": "object", "properties": props, "required": req}) if props else st.just({"type": "object"}))


schemas = objects(st.recursive(leaves, lambda inner: st.one_of(
    objects(inner), inner.map(lambda s: {"type": "array", "items": s, "maxItems": 3})), max_leaves=6))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(fmt=st.sampled_from(sorted(FORMATS)), params=st.lists(schemas, min_size=1, max_size=3),
       choice=st.sampled_from(["required", "named", "auto"]), parallel=st.booleans(), seed=st.integers(0, 2**32))
def test_every_constrained_call_validates_against_its_schema(vocab, fmt, params, choice, parallel, seed):
    fmt = FORMATS[fmt]
    tools = tuple(FunctionTool(f"fn_{i}", None, p) for i, p in enumerate(params))
    req = ToolRequest(tools, choice, "fn_0" if choice == "named" else None, parallel)
    prefix = "Let me check. " + fmt.trigger if choice == "auto" else ""
    text, done = walk(vocab, tag_spec(fmt, req).source, random.Random(seed), prefix)
    assume(done)  # a walk that ran out of steps is cut off, not wrong
    content, calls, failures = parse_output(fmt, req.names, text)
    assert failures == 0 and calls, text
    if choice != "auto":
        assert content is None, text
    if choice == "named" or not parallel:
        assert len(calls) == 1
    for call in calls:
        assert choice != "named" or call.name == "fn_0"
        jsonschema.validate(json.loads(call.arguments), params[int(call.name[3:])],
                            format_checker=jsonschema.FormatChecker())
