from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdbench.backends.base import ConstraintSpec
from cdbench.workloads.grammar_instances import (
    Alternatives,
    AnyChar,
    CharClass,
    EbnfGrammar,
    GrammarError,
    Literal,
    Repeat,
    RuleRef,
    Sequence,
    parse_gbnf,
    to_gbnf,
)
from cdbench.workloads.instances import InstanceFailure, valid_instances

NAMES = ["root", "a", "b-c", "x1"]
chars = st.characters(min_codepoint=1, max_codepoint=0x2FFF, exclude_categories=("Cs",))


def exprs() -> st.SearchStrategy:
    leaves = st.one_of(
        st.builds(Literal, st.text(chars, min_size=1, max_size=4)),
        st.builds(lambda r, n: CharClass(tuple(sorted(set(r))), n),
                  st.lists(st.tuples(st.integers(32, 200), st.integers(0, 20)).map(lambda t: (t[0], t[0] + t[1])),
                           min_size=1, max_size=3), st.booleans()),
        st.just(AnyChar()),
        st.builds(RuleRef, st.sampled_from(NAMES)),
    )
    return st.recursive(leaves, lambda inner: st.one_of(
        st.builds(lambda xs: Sequence(tuple(xs)), st.lists(inner, min_size=2, max_size=3)),
        st.builds(lambda xs: Alternatives(tuple(xs)), st.lists(inner, min_size=2, max_size=3)),
        st.builds(lambda e, lo, extra: Repeat(e, lo, None if extra < 0 else lo + extra),
                  inner, st.integers(0, 3), st.integers(-1, 3)),
    ), max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({name: exprs() for name in NAMES}))
def test_gbnf_print_parse_round_trip(rules):
    assert parse_gbnf(to_gbnf(rules)) == rules


def test_gbnf_syntax():
    rules = parse_gbnf('# comment\nroot ::= "a\\n" [^x-z\\]] b{2,3} c? .\n  | ("q")*\nb ::= [0-9]\nc ::= "\\u00e9"\n')
    assert rules["root"] == Alternatives((
        Sequence((Literal("a\n"), CharClass(((120, 122), (93, 93)), True), Repeat(RuleRef("b"), 2, 3),
                  Repeat(RuleRef("c"), 0, 1), AnyChar())),
        Repeat(Literal("q"), 0, None)))
    assert rules["c"] == Literal("é")


@pytest.mark.parametrize("text, message", [
    ('root ::= "a" b', "undefined rule 'b'"),
    ('root ::= ("a"', "unclosed"),
    ('root ::= "a" @', "unexpected character '@' on line 1"),
    ('"a"', "expected 'name ::='"),
    ('root ::= [z-a]', "empty range"),
])
def test_gbnf_errors_say_what_is_wrong(text, message):
    with pytest.raises(GrammarError, match=message):
        parse_gbnf(text)


GBNF = 'root ::= "(" expr ")"\nexpr ::= num (op num)*\nnum ::= [1-9] [0-9]{0,2}\nop ::= " + " | " * "\n'
LARK = """start: pair ("," pair)*
pair: KEY "=" VALUE
KEY: /[a-z]+/
VALUE: INT | ESCAPED_STRING
%import common.INT
%import common.ESCAPED_STRING
%import common.WS
%ignore WS
"""


@pytest.mark.parametrize("text, dialect, start", [(GBNF, "gbnf", "root"), (LARK, "lark", "start")])
def test_walk_instances_are_accepted_and_others_rejected(text, dialect, start):
    grammar = EbnfGrammar.from_text(text, dialect, start)
    accepted = 0
    for seed in range(20):
        # lookbehinds inside terminals (ESCAPED_STRING) are not steered: some draws miss
        accepted += grammar.rejection(grammar.instance(np.random.default_rng(seed))) is None
    assert accepted >= 15
    assert grammar.rejection("(1 + )").startswith("grammar rejects")


def test_walks_are_seeded():
    grammar = EbnfGrammar.from_text(GBNF, "gbnf", "root")
    draws = [grammar.instance(np.random.default_rng(s)) for s in range(10)]
    assert draws == [grammar.instance(np.random.default_rng(s)) for s in range(10)]
    assert len(set(draws)) > 3


def test_recursive_grammar_terminates():
    grammar = EbnfGrammar.from_text('root ::= "[" (root ("," root)*)? "]"', "gbnf", "root")
    for seed in range(10):
        assert len(grammar.instance(np.random.default_rng(seed))) < 2000


def test_grammar_without_finite_text_is_an_error():
    with pytest.raises(GrammarError, match="no finite text"):
        EbnfGrammar.from_text('root ::= "a" root', "gbnf", "root")


def test_indentation_grammar_fails_with_reason():
    spec = ConstraintSpec("ebnf", "start: _INDENT NAME\n%declare _INDENT\n%import common.CNAME -> NAME\n",
                          {"dialect": "lark", "start": "start"})
    with pytest.raises(InstanceFailure, match="post-lexer"):
        valid_instances("indent", spec, 1, 0)


def test_shared_grammars_mostly_produce_instances(corpora_dir):
    from cdbench.workloads.corpora import read_corpus

    items = [i for stem in ("gbnf_llama_cpp", "gbnf_transformers_cfg", "lark_outlines")
             for i in read_corpus(corpora_dir / f"{stem}.jsonl").items]
    produced = 0
    for item in items:
        try:
            valid_instances(item.id, item.to_spec(), 1, 0)
            produced += 1
        except InstanceFailure:
            pass
    assert produced == len(items)
