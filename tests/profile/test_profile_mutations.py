"""Invalid instances for the profile: every mutation is truly invalid, and seeded."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdbench.backends.base import ConstraintSpec
from cdbench.profile.mutations import mutate
from cdbench.workloads.validate import InvalidInstance, check_instance, validity_check

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000},
        "name": {"type": "string", "pattern": "^[a-z]+$"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["id", "name", "tags"],
    "additionalProperties": False,
}
VALID = json.dumps({"id": 7, "name": "abc", "tags": ["x"]}, separators=(", ", ": "))


def test_json_mutations_are_invalid_and_cover_several_families():
    spec = ConstraintSpec("json_schema", SCHEMA)
    assert validity_check(spec)(VALID)
    mutations = mutate(spec, VALID, validity_check(spec), np.random.default_rng(0), 8)
    assert len(mutations) == 8
    assert len({m.text for m in mutations}) == 8
    assert {"truncate", "wrong_type", "drop_key", "extra_key", "break_string", "out_of_range", "array_length"} <= {
        m.label for m in mutations
    }
    for m in mutations:
        with pytest.raises(InvalidInstance):
            check_instance(spec, m.text)


def test_a_mutation_that_stays_valid_is_not_kept():
    # Nothing is required and any value is allowed, so dropping a key or changing a type stays valid.
    spec = ConstraintSpec("json_schema", {"type": "object"})
    mutations = mutate(spec, '{"a": 1}', validity_check(spec), np.random.default_rng(0), 10)
    assert {m.label for m in mutations} == {"truncate", "wrong_type"}  # truncated text; an array at the root
    assert all(not validity_check(spec)(m.text) for m in mutations)


def test_same_seed_same_mutations_and_none_when_zero_asked():
    spec = ConstraintSpec("json_schema", SCHEMA)
    one = mutate(spec, VALID, validity_check(spec), np.random.default_rng(3), 4)
    two = mutate(spec, VALID, validity_check(spec), np.random.default_rng(3), 4)
    assert one == two
    assert mutate(spec, VALID, validity_check(spec), np.random.default_rng(3), 0) == []


def test_choice_mutations_are_not_choices():
    options = ["red", "green", "blue"]
    spec = ConstraintSpec("choice", options)
    mutations = mutate(spec, "green", validity_check(spec), np.random.default_rng(1), 5)
    assert len(mutations) == 5
    assert all(m.text not in options for m in mutations)


PATTERNS = [r"[0-9]{3}-[0-9]{4}", r"[a-z]+(\.[a-z]+)*", r"(yes|no)", r"[A-F0-9]{2,6}", r"v[0-9]+(\.[0-9]+){0,2}"]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), pattern=st.sampled_from(PATTERNS), seed=st.integers(0, 2**32 - 1))
def test_regex_mutations_never_fully_match(data, pattern, seed):
    text = data.draw(st.from_regex(pattern, fullmatch=True))
    spec = ConstraintSpec("regex", pattern)
    mutations = mutate(spec, text, validity_check(spec), np.random.default_rng(seed), 3)
    assert mutations, f"no invalid mutation of {text!r}"
    for m in mutations:
        assert m.text != text
        assert re.fullmatch(pattern, m.text) is None
