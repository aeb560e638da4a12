"""Engine-specific behaviour: options, warnings, the none backend, known engine differences."""

from __future__ import annotations

import json
import re

import pytest
import torch
from cases import ENGINES, allowed_ids, is_allowed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cdbench.backends as backends_api
from cdbench.backends import CompileError, ConstraintSpec, MaskFormat, create_backend
from cdbench.backends.llguidance import LLGuidanceBackend
from cdbench.backends.none import NoneBackend
from cdbench.backends.outlines import IGNORED_KEYWORDS as OUTLINES_IGNORED
from cdbench.backends.outlines import IGNORED_WHEN as OUTLINES_IGNORED_WHEN
from cdbench.backends.outlines import OutlinesBackend
from cdbench.backends.specs import (
    choice_regex,
    load_schema,
    regex_literal,
    unenforced_keywords,
)
from cdbench.backends.xgrammar import IGNORED_KEYWORDS as XGRAMMAR_IGNORED
from cdbench.backends.xgrammar import IGNORED_WHEN as XGRAMMAR_IGNORED_WHEN
from cdbench.backends.xgrammar import XGrammarBackend

VOCAB = "cl100k"


def _accepts(backend, grammar, text: str) -> bool:
    """Whether ``text`` followed by EOS is accepted token by token."""
    matcher = backend.matcher(grammar)
    return all(matcher.accept(t) for t in [*backend.vocab.encode(text), backend.vocab.eos_token_ids[0]])


def test_public_api_is_exported():
    for name in ("available_backends", "create_backend", "register_backend", "ConstraintSpec", "CompileError",
                 "CompiledGrammar", "GrammarBackend", "Matcher", "MaskFormat", "Vocabulary", "load_vocab",
                 "available_vocabs"):
        assert hasattr(backends_api, name), name


@pytest.mark.parametrize(("name", "cls"), [("xgrammar", XGrammarBackend), ("llguidance", LLGuidanceBackend),
                                           ("outlines", OutlinesBackend), ("none", NoneBackend)])
def test_registry_builds_each_engine(engines, name, cls):
    backend = engines.backend(name, VOCAB) if name != "none" else create_backend("none", VOCAB)
    assert type(backend) is cls and backend.name == name
    assert backend.mask_format is MaskFormat.BITMASK
    mask = backend.allocate_mask(2)
    assert mask.dtype == torch.int32 and mask.shape == (2, (backend.vocab.size + 31) // 32)


@pytest.mark.parametrize("engine", ENGINES)
def test_fill_mask_writes_only_its_row(engines, engine):
    backend = engines.backend(engine, VOCAB)
    matcher = backend.matcher(engines.compiled(engine, VOCAB, ConstraintSpec("regex", "[0-9]{3}")))
    mask = backend.allocate_mask(3)
    mask[0].fill_(7)
    mask[2].fill_(11)
    matcher.fill_mask(mask, 1)
    assert bool((mask[0] == 7).all()) and bool((mask[2] == 11).all())
    digits = {backend.vocab.encode(str(d))[0] for d in range(10)}
    assert digits <= set(allowed_ids(mask, 1, backend.vocab.size).tolist())


@pytest.mark.parametrize("engine", ENGINES)
def test_whitespace_option_sets_the_language(engine):
    compact = create_backend(engine, VOCAB)
    flexible = create_backend(engine, VOCAB, whitespace="flexible")
    assert compact.options_key() != flexible.options_key()
    spec = ConstraintSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                          "required": ["a"], "additionalProperties": False})
    assert _accepts(compact, compact.compile(spec), '{"a": 1}')
    assert not _accepts(compact, compact.compile(spec), '{"a":1}')
    assert _accepts(flexible, flexible.compile(spec), '{"a":1}')
    assert _accepts(flexible, flexible.compile(spec), '{"a": 1}')


@pytest.mark.parametrize("engine", ENGINES)
def test_unknown_whitespace_style_is_refused(engine):
    with pytest.raises(ValueError, match="'tabs'.*compact, flexible"):
        create_backend(engine, VOCAB, whitespace="tabs")


def test_xgrammar_compiler_options_are_part_of_the_key():
    keys = {create_backend("xgrammar", VOCAB, max_threads=n, compiler_cache=c).options_key()
            for n in (1, 2) for c in (True, False)}
    assert len(keys) == 4
    uncached = create_backend("xgrammar", VOCAB, compiler_cache=False)
    assert _accepts(uncached, uncached.compile(ConstraintSpec("regex", "[0-9]+")), "123")


@pytest.mark.parametrize("engine", ENGINES)
def test_several_tool_call_tags_accept_either(engines, engine):
    backend = engines.backend(engine, VOCAB)
    spec = ConstraintSpec("structural_tag", {"tags": [
        {"begin": "<a>", "schema": {"type": "integer"}, "end": "</a>"},
        {"begin": "<b>", "schema": {"type": "boolean"}, "end": "</b>"},
    ]})
    grammar = backend.compile(spec)
    assert _accepts(backend, grammar, "<a>12</a>")
    assert _accepts(backend, grammar, "<b>true</b>")
    assert not _accepts(backend, grammar, "<a>true</a>")


_AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
_INTS = {"type": "array", "items": {"type": "integer"}}
# keyword: (schema using it, an instance violating it)
VIOLATIONS = {
    "not": ({"type": "string", "not": {"const": "abc"}}, '"abc"'),
    "if": ({"type": "object", "properties": _AB, "if": {"properties": {"a": {"const": 1}}},
            "then": {"required": ["b"]}}, '{"a": 1}'),
    "then": ({"type": "object", "properties": _AB, "if": {"properties": {"a": {"const": 1}}},
              "then": {"required": ["b"]}}, '{"a": 1}'),
    "else": ({"type": "object", "properties": _AB, "if": {"properties": {"a": {"const": 1}}},
              "else": {"required": ["b"]}}, '{"a": 2}'),
    "uniqueItems": ({**_INTS, "uniqueItems": True}, "[1, 1]"),
    "allOf": ({"type": "integer", "allOf": [{"minimum": 3}]}, "1"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    "contains": ({**_INTS, "contains": {"const": 5}}, "[1]"),
    "minContains": ({**_INTS, "contains": {"const": 5}, "minContains": 2}, "[5]"),
    "maxContains": ({**_INTS, "contains": {"const": 5}, "maxContains": 1}, "[5, 5]"),
    "dependentRequired": ({"type": "object", "properties": _AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({"type": "object", "properties": _AB, "dependentSchemas": {"a": {"required": ["b"]}}},
                         '{"a": 1}'),
    "dependencies": ({"type": "object", "properties": _AB, "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": {"type": "integer"}},
                      '{"abcd": 1}'),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "4"),
    "minimum": ({"type": "integer", "minimum": 3}, "1"),
    "maximum": ({"type": "integer", "maximum": 3}, "10"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, "3"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 3}, "3"),
    "minProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, '{"a": 1}'),
    "maxProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
                      '{"a": 1, "b": 2}'),
}


@pytest.mark.parametrize(("engine", "keyword"), [
    pytest.param(engine, keyword, id=f"{engine}-{keyword}")
    for engine, ignored in (("xgrammar", XGRAMMAR_IGNORED), ("outlines", OUTLINES_IGNORED))
    for keyword in sorted(ignored)
])
def test_unenforced_keywords_are_reported_truthfully(engines, engine, keyword):
    """Every keyword an engine is said to ignore: compiled, warned about, and really not enforced."""
    schema, violating = VIOLATIONS[keyword]
    backend = engines.backend(engine, VOCAB)
    grammar = backend.compile(ConstraintSpec("json_schema", schema))
    assert any(f"'{keyword}' at #" in w for w in grammar.warnings), grammar.warnings
    assert _accepts(backend, grammar, violating), "the warning says unenforced, but the engine enforces it"


_LOWER = {"type": "string", "pattern": "^[a-z]+$"}
# (engine, keyword): (schema where the engine drops it, an instance violating it,
#                     the same keyword where the engine enforces it, an instance that shows it)
VIOLATIONS_WHEN = {
    ("xgrammar", "$ref"): ({"type": "object", "properties": {"a": {"$ref": "https://example.com/int.json"}},
                           "required": ["a"]}, '{"a": [true, "x"]}',
                          {"$ref": "#/$defs/int", "$defs": {"int": {"type": "integer"}}}, '"x"'),
    ("xgrammar", "minLength"): ({**_LOWER, "minLength": 4}, '"ab"', {"type": "string", "minLength": 4}, '"ab"'),
    ("xgrammar", "maxLength"): ({**_LOWER, "maxLength": 2}, '"abcd"', {"type": "string", "maxLength": 2}, '"abcd"'),
    ("xgrammar", "required"): ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["top"]},
                               '{"a": 1}',
                               {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}"),
    ("outlines", "required"): ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["top"]}, "{}",
                               {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}"),
    ("outlines", "pattern"): ({**_LOWER, "maxLength": 5}, '"AB1"', _LOWER, '"AB1"'),
    ("outlines", "minItems"): ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "integer"},
                                "minItems": 3}, "[1]",
                               {"type": "array", "items": {"type": "integer"}, "minItems": 3}, "[1]"),
}


@pytest.mark.parametrize(("engine", "keyword"), [
    pytest.param(engine, rule.keyword, id=f"{engine}-{rule.keyword}")
    for engine, rules in (("xgrammar", XGRAMMAR_IGNORED_WHEN), ("outlines", OUTLINES_IGNORED_WHEN))
    for rule in rules
])
def test_keywords_ignored_in_some_schemas_are_reported_only_there(engines, engine, keyword):
    """Where the condition holds: warned about and really not enforced; elsewhere: enforced, no warning."""
    dropped, violating, kept, violating_kept = VIOLATIONS_WHEN[(engine, keyword)]
    backend = engines.backend(engine, VOCAB)
    grammar = backend.compile(ConstraintSpec("json_schema", dropped))
    assert any(f"'{keyword}' at #" in w for w in grammar.warnings), grammar.warnings
    assert _accepts(backend, grammar, violating), "the warning says unenforced, but the engine enforces it"
    grammar = backend.compile(ConstraintSpec("json_schema", kept))
    assert grammar.warnings == ()
    assert not _accepts(backend, grammar, violating_kept), f"{engine} does not enforce {keyword!r} even here"


@pytest.mark.parametrize("engine", ENGINES)
def test_fully_enforced_schema_has_no_warnings(engines, engine):
    schema = {"type": "object", "properties": {"n": {"type": "string", "maxLength": 3}}, "required": ["n"]}
    assert engines.backend(engine, VOCAB).compile(ConstraintSpec("json_schema", schema)).warnings == ()


def test_llguidance_refuses_what_it_cannot_enforce(engines):
    with pytest.raises(CompileError) as info:
        engines.backend("llguidance", VOCAB).compile(ConstraintSpec("json_schema", {"not": {"type": "string"}}))
    assert info.value.reason == "unsupported" and "not" in info.value.message


def test_walker_reports_nested_uses_and_skips_property_names():
    schema = {
        "type": "object",
        "properties": {"not": {"type": "string"}, "list": {"type": "array", "uniqueItems": True}},
        "$defs": {"x/y": {"anyOf": [{"not": {"type": "null"}}]}},
        "const": {"uniqueItems": True},
    }
    found = unenforced_keywords(schema, frozenset({"not", "uniqueItems"}))
    assert found == ("'uniqueItems' at #/properties/list", "'not' at #/$defs/x~1y/anyOf/0")


def test_walker_applies_conditional_rules_where_they_hold():
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "object", "properties": {"b": {}}, "required": ["b", "c"]},
        "d": {"type": "string", "pattern": "x", "maxLength": 2},
        "e": {"type": "string", "pattern": "x"}}}
    found = unenforced_keywords(schema, frozenset(), OUTLINES_IGNORED_WHEN)
    assert found == ("'required' at #/properties/a (names a key not in 'properties')",
                     "'pattern' at #/properties/d (beside 'minLength'/'maxLength')")


def test_regex_literal_escapes_only_metacharacters():
    text = "a.b*c (d) [e] {f} ^g$ h|i \\j+k?\nl-m #n"
    assert re.fullmatch(regex_literal(text), text)
    assert "\\ " not in regex_literal(text)
    assert choice_regex(["a", "b.c"]) == "(a|b\\.c)"


@pytest.mark.parametrize("engine", ENGINES)
def test_choice_options_with_metacharacters_are_literal(engines, engine):
    backend = engines.backend(engine, VOCAB)
    grammar = backend.compile(ConstraintSpec("choice", ["a+b", "(c)", "d.e", "line\nbreak"]))
    assert _accepts(backend, grammar, "a+b") and _accepts(backend, grammar, "(c)")
    assert _accepts(backend, grammar, "line\nbreak")
    assert not _accepts(backend, grammar, "aab") and not _accepts(backend, grammar, "dxe")


@pytest.mark.parametrize(("engine", "reason"), [("xgrammar", "unsupported"), ("llguidance", None), ("outlines", None)])
def test_unicode_property_classes(engines, engine, reason):
    backend = engines.backend(engine, VOCAB)
    spec = ConstraintSpec("regex", r"\p{L}+")
    if reason:
        with pytest.raises(CompileError) as info:
            backend.compile(spec)
        assert info.value.reason == reason
    else:
        assert _accepts(backend, backend.compile(spec), "héllo")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("regex", "text", "valid"), [("^abc$", "abc", True), ("^ab\\$", "ab$", True),
                                                      ("^ab\\$", "ab", False), ("^a+", "aaa", True)])
def test_outer_anchors_change_nothing(engines, engine, regex, text, valid):
    backend = engines.backend(engine, VOCAB)
    assert _accepts(backend, backend.compile(ConstraintSpec("regex", regex)), text) is valid


def test_outlines_refuses_inner_anchors_and_grammars(engines):
    backend = engines.backend("outlines", VOCAB)
    with pytest.raises(CompileError) as info:
        backend.compile(ConstraintSpec("regex", "^a$|^b$"))
    assert info.value.reason == "unsupported"
    with pytest.raises(CompileError) as info:
        backend.compile(ConstraintSpec("ebnf", 'root ::= "a"', {"dialect": "gbnf"}))
    assert info.value.reason == "unsupported"


@pytest.mark.parametrize("engine", ENGINES)
def test_rollback_past_the_history_raises(engines, engine):
    backend = engines.backend(engine, VOCAB)
    matcher = backend.matcher(engines.compiled(engine, VOCAB, ConstraintSpec("regex", "[0-9]{3}")))
    assert matcher.accept(backend.vocab.encode("1")[0])
    with pytest.raises(ValueError):
        matcher.rollback(5)


@pytest.mark.parametrize("engine", ENGINES)
def test_eos_after_a_grammar_that_must_end(engines, engine):
    """A grammar that cannot continue allows only EOS, and terminates only once EOS is accepted."""
    backend = engines.backend(engine, VOCAB)
    voc = backend.vocab
    matcher = backend.matcher(engines.compiled(engine, VOCAB, ConstraintSpec("choice", ["done"])))
    for token in voc.encode("done"):
        assert matcher.accept(token)
    assert not matcher.is_terminated()
    mask = backend.allocate_mask(1)
    matcher.fill_mask(mask, 0)
    assert allowed_ids(mask, 0, voc.size).tolist() == [voc.eos_token_ids[0]]
    assert matcher.accept(voc.eos_token_ids[0]) and matcher.is_terminated()
    assert matcher.jump_forward() == []
    matcher.rollback(2)
    assert not matcher.is_terminated()
    matcher.fill_mask(mask, 0)
    assert not is_allowed(mask, 0, voc.eos_token_ids[0])


@pytest.mark.parametrize("engine", ENGINES)
def test_jump_forward_returns_the_only_possible_token(engines, engine):
    backend = engines.backend(engine, VOCAB)
    voc = backend.vocab
    matcher = backend.matcher(engines.compiled(engine, VOCAB, ConstraintSpec("regex", "x{3}")))
    assert voc.encode("xx") == [voc.encode("xx")[0]]  # one token, so one "x" is left
    assert matcher.accept(voc.encode("xx")[0])
    assert matcher.jump_forward() == voc.encode("x")


def test_outlines_drops_tokens_that_leave_a_final_state(engines):
    """Known outlines-core 0.2.14 difference: from a state where the regex may
    end, tokens into a state where it may not are missing from the index.

    After "1" of ``1(a[0-9]+)?`` xgrammar allows "a"; outlines allows only EOS.
    If this test fails, outlines-core fixed it: let the conformance cases pass
    through such states again.
    """
    spec = ConstraintSpec("regex", "1(a[0-9]+)?")
    voc = engines.backend("xgrammar", VOCAB).vocab
    a = voc.encode("a")[0]
    allowed = {}
    for engine in ("xgrammar", "outlines"):
        backend = engines.backend(engine, VOCAB)
        matcher = backend.matcher(backend.compile(spec))
        assert matcher.accept(voc.encode("1")[0])
        mask = backend.allocate_mask(1)
        matcher.fill_mask(mask, 0)
        allowed[engine] = is_allowed(mask, 0, a)
    assert allowed == {"xgrammar": True, "outlines": False}


@pytest.mark.parametrize(("regex", "text"), [("(1|10)", "10"), ("x.+?", "xabc"), ("a|aT[0-9]", "aT1")])
def test_outlines_matches_leftmost_first(engines, regex, text):
    """Known outlines-core 0.2.14 difference: once a preferred branch has matched,
    branches that would go on are dropped, so valid text is refused.

    If this test fails, outlines-core fixed it: drop the note in the outlines
    module docstring and the longest-first order of choices.
    """
    spec = ConstraintSpec("regex", regex)
    accepts = {e: _accepts(engines.backend(e, VOCAB), engines.compiled(e, VOCAB, spec), text)
               for e in ("xgrammar", "outlines")}
    assert accepts == {"xgrammar": True, "outlines": False}


@pytest.mark.parametrize("engine", ENGINES)
def test_choice_accepts_options_that_extend_others(engines, engine):
    backend = engines.backend(engine, VOCAB)
    grammar = backend.compile(ConstraintSpec("choice", ["1", "10", "100", "Inf", "Infinity"]))
    assert all(_accepts(backend, grammar, option) for option in ("1", "10", "100", "Inf", "Infinity"))
    assert not _accepts(backend, grammar, "1000") and not _accepts(backend, grammar, "Infinit")


@st.composite
def _closed_objects(draw, depth: int = 1) -> tuple[dict, dict]:
    """A closed object schema with optional properties, and one of its instances."""
    kinds = ["integer", "boolean", "null"] + (["array", "object"] if depth else [])
    properties, required, instance = {}, [], {}
    for name in draw(st.lists(st.sampled_from("abcde"), min_size=1, max_size=4, unique=True)):
        kind = draw(st.sampled_from(kinds))
        if kind == "object":
            properties[name], value = draw(_closed_objects(depth - 1))
        elif kind == "array":
            properties[name] = {"type": "array", "items": {"type": "integer"}}
            value = draw(st.lists(st.integers(-99, 99), max_size=3))
        else:
            properties[name] = {"type": kind}
            value = {"integer": draw(st.integers(-999, 999)), "boolean": draw(st.booleans()), "null": None}[kind]
        if draw(st.booleans()):
            required.append(name)
        if name in required or draw(st.booleans()):
            instance[name] = value
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}, instance


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_closed_objects())
def test_compact_whitespace_is_json_dumps(engines, engine, case):
    """Any mix of required and optional properties: ``json.dumps`` output is
    accepted and the same value without the separators' spaces is not."""
    schema, instance = case
    backend = engines.backend(engine, VOCAB)
    grammar = backend.compile(ConstraintSpec("json_schema", schema))
    assert _accepts(backend, grammar, json.dumps(instance))
    tight = json.dumps(instance, separators=(",", ":"))
    if tight != json.dumps(instance):
        assert not _accepts(backend, grammar, tight)


def test_only_llguidance_allows_undeclared_properties_by_default(engines):
    """Known engine difference: without ``additionalProperties``, llguidance follows
    JSON Schema (extra properties allowed); xgrammar (strict mode) and outlines do not."""
    spec = ConstraintSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}})
    allows = {e: _accepts(engines.backend(e, VOCAB), engines.compiled(e, VOCAB, spec), '{"a": 1, "b": 2}')
              for e in ENGINES}
    assert allows == {"xgrammar": False, "llguidance": True, "outlines": False}


def test_compile_error_names_backend_kind_and_reason(engines):
    with pytest.raises(CompileError) as info:
        engines.backend("xgrammar", VOCAB).compile(ConstraintSpec("regex", "[a-z"))
    error = info.value
    assert (error.backend, error.kind, error.reason) == ("xgrammar", "regex", "invalid")
    assert "xgrammar cannot compile regex: invalid" in str(error) and not error.message.startswith("[")


@pytest.mark.parametrize("engine", ENGINES)
def test_structural_tag_given_as_json_text_compiles(engines, engine):
    backend = engines.backend(engine, VOCAB)
    spec = ConstraintSpec("structural_tag", json.dumps({"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}))
    assert _accepts(backend, backend.compile(spec), "<f>42</f>")


def test_boolean_schemas_become_objects():
    assert load_schema(ConstraintSpec("json_schema", True), "x") == {}
    assert load_schema(ConstraintSpec("json_schema", "true"), "x") == {}


# outlines is left out of the "true" half: its index for any JSON value takes seconds.
@pytest.mark.parametrize("engine", ENGINES)
def test_boolean_schemas(engines, engine):
    backend = engines.backend(engine, VOCAB)
    if engine != "outlines":
        assert _accepts(backend, backend.compile(ConstraintSpec("json_schema", True)), '[1, "a"]')
    with pytest.raises(CompileError) as info:
        backend.compile(ConstraintSpec("json_schema", False))
    assert info.value.reason == "invalid"


def test_schema_given_as_json_text_compiles(engines):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    backend = engines.backend("llguidance", VOCAB)
    assert _accepts(backend, backend.compile(ConstraintSpec("json_schema", json.dumps(schema))), '{"a": 3}')


class TestNoneBackend:
    @pytest.fixture(scope="class")
    def backend(self):
        return create_backend("none", VOCAB)

    def test_everything_is_allowed_including_eos(self, backend):
        matcher = backend.matcher(backend.compile(ConstraintSpec("regex", "[0-9]")))
        mask = torch.zeros((2, (backend.vocab.size + 31) // 32), dtype=torch.int32)
        matcher.fill_mask(mask, 1)
        assert allowed_ids(mask, 1, backend.vocab.size).size == backend.vocab.size
        assert bool((mask[0] == 0).all())

    def test_accepts_anything_until_eos(self, backend):
        voc = backend.vocab
        matcher = backend.matcher(backend.compile(ConstraintSpec("json_schema", {"type": "integer"})))
        assert all(matcher.accept(t) for t in voc.encode("not an integer"))
        assert not matcher.is_terminated()
        assert matcher.jump_forward() == []
        twin = matcher.copy()
        assert matcher.accept(voc.eos_token_ids[0]) and matcher.is_terminated()
        assert not matcher.accept(voc.encode("x")[0])
        assert not twin.is_terminated()
        matcher.rollback(1)
        assert not matcher.is_terminated()
        with pytest.raises(ValueError):
            matcher.rollback(100)

    def test_compiles_any_spec(self, backend):
        grammar = backend.compile(ConstraintSpec("ebnf", "not even a grammar", {"dialect": "gbnf"}))
        assert grammar.backend == "none" and grammar.warnings == ()


def test_mask_bit_layout_is_token_32w_plus_i(engines):
    """Bit i of word w is token 32*w+i: the allowed ids equal the ones computed from the byte table."""
    backend = engines.backend("xgrammar", VOCAB)
    voc = backend.vocab
    matcher = backend.matcher(engines.compiled("xgrammar", VOCAB, ConstraintSpec("choice", ["yes"])))
    mask = backend.allocate_mask(1)
    matcher.fill_mask(mask, 0)
    expected = [i for i, raw in enumerate(voc.token_bytes)
                if raw and b"yes".startswith(raw) and i not in voc.forbidden_token_ids]
    assert allowed_ids(mask, 0, voc.size).tolist() == expected


PHONE = r"[0-9]{3}-[0-9]{4}"


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="0123456789-x", max_size=10))
def test_acceptance_matches_python_re(engines, engine, text):
    """Token by token plus EOS, a matcher accepts exactly the strings ``re.fullmatch`` accepts."""
    backend = engines.backend(engine, VOCAB)
    grammar = engines.compiled(engine, VOCAB, ConstraintSpec("regex", PHONE))
    assert _accepts(backend, grammar, text) == bool(re.fullmatch(PHONE, text))


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_accept_rollback_copy_sequence_matches_a_replay(engines, engine, data):
    """After random accepts (allowed tokens), rollbacks and copies, the mask equals
    that of a fresh matcher fed the tokens still accepted."""
    backend = engines.backend(engine, VOCAB)
    voc = backend.vocab
    grammar = engines.compiled(engine, VOCAB, ConstraintSpec("regex", r"[a-c]{1,6}(x|yz)?"))
    matcher, accepted = backend.matcher(grammar), []
    mask, replayed = backend.allocate_mask(1), backend.allocate_mask(1)
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        op = data.draw(st.sampled_from(["accept", "accept", "rollback", "copy"]), label="op")
        if op == "accept" and not matcher.is_terminated():
            matcher.fill_mask(mask, 0)
            token = data.draw(st.sampled_from(allowed_ids(mask, 0, voc.size).tolist()), label="token")
            assert matcher.accept(token)
            accepted.append(token)
        elif op == "rollback" and accepted:
            k = data.draw(st.integers(1, len(accepted)), label="k")
            matcher.rollback(k)
            del accepted[-k:]
        elif op == "copy":
            matcher = matcher.copy()
        fresh = backend.matcher(grammar)
        assert all(fresh.accept(t) for t in accepted)
        assert matcher.is_terminated() == fresh.is_terminated()
        if not matcher.is_terminated():  # a finished request has no next mask (xgrammar raises)
            matcher.fill_mask(mask, 0)
            fresh.fill_mask(replayed, 0)
            assert torch.equal(mask, replayed), f"after {op} with {voc.decode(accepted)!r}"
