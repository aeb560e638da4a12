from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdbench.workloads.regex_instances import RegexInstanceError, regex_instance

PATTERNS = [
    r"[a-z]{3}-\d+",
    r"^(foo|bar)+baz?$",
    r"[^0-9]{2,4}",
    r"\w+@\w+\.(com|org)",
    r"(ab)\1",
    r"[A-F0-9]{8}(-[A-F0-9]{4}){3}",
    r"(?i)hello",
    r"\s?\S*x",
    r"(?:a|b|c){0,5}[.]",
    r"^[\u00e0-\u00ff]+$",
]


@settings(max_examples=60, deadline=None)
@given(pattern=st.sampled_from(PATTERNS), seed=st.integers(0, 2**32 - 1))
def test_instances_fully_match(pattern, seed):
    text = regex_instance(pattern, np.random.default_rng(seed))
    assert re.fullmatch(pattern, text), (pattern, text)


@settings(max_examples=40, deadline=None)
@given(st.from_regex(r"[a-c]([0-9]|[xy]{1,3})*", fullmatch=True))
def test_literal_patterns_reproduce_themselves(literal):
    # A pattern of plain letters and digits has exactly one instance: itself.
    assert regex_instance(re.escape(literal), np.random.default_rng(0)) == literal


def test_same_seed_same_instance():
    a = regex_instance(r"[a-z]{5,9}", np.random.default_rng(7))
    assert a == regex_instance(r"[a-z]{5,9}", np.random.default_rng(7))


def test_invalid_pattern_names_the_pattern():
    with pytest.raises(RegexInstanceError, match=r"invalid regex '\(ab'"):
        regex_instance("(ab", np.random.default_rng(0))


def test_shared_regex_corpus_mostly_generates(corpora_dir):
    from cdbench.workloads.corpora import read_corpus

    items = read_corpus(corpora_dir / "regex_from_json_schemas.jsonl", sample=150, seed=0).items
    ok = 0
    for item in items:
        for seed in range(5):
            try:
                if re.fullmatch(item.spec, regex_instance(item.spec, np.random.default_rng(seed))):
                    ok += 1
                    break
            except RegexInstanceError:
                break
    assert ok >= 0.9 * len(items)
