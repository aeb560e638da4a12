from __future__ import annotations

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdbench.backends.base import ConstraintSpec
from cdbench.workloads.instances import InstanceFailure, valid_instances
from cdbench.workloads.json_instances import SchemaInstanceError, json_instance

SCHEMAS = {
    "object": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 9},
                                                  "b": {"type": "string", "minLength": 3, "maxLength": 4}},
               "required": ["a", "b"], "additionalProperties": False},
    "enum_const": {"type": "object", "properties": {"e": {"enum": ["x", "y"]}, "c": {"const": 3}}, "required": ["e", "c"]},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "formats": {"type": "array", "minItems": 4, "maxItems": 4, "prefixItems": [
        {"type": "string", "format": "email"}, {"type": "string", "format": "date-time"},
        {"type": "string", "format": "ipv4"}, {"type": "string", "format": "uuid"}]},
    "ref_recursive": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v", "kids"]}},
        "$ref": "#/$defs/node"},
    "allof": {"allOf": [{"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}, "required": ["x"]},
                        {"properties": {"y": {"type": "boolean"}}, "required": ["y"]}]},
    "anyof": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "integer"}, "uniqueItems": True,
                                           "minItems": 3}]},
    "draft4_exclusive": {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "minimum": 0,
                         "exclusiveMinimum": True, "maximum": 2, "exclusiveMaximum": True},
    "min_properties": {"type": "object", "minProperties": 2, "additionalProperties": {"type": "integer"}},
    "no_type": {"properties": {"k": {"type": ["string", "null"], "maxLength": 2}}, "required": ["k"]},
}


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(SCHEMAS)), seed=st.integers(0, 2**32 - 1))
def test_generated_values_validate(name, seed):
    schema = SCHEMAS[name]
    value = json_instance(schema, np.random.default_rng(seed))
    validator = jsonschema.validators.validator_for(schema)
    validator(schema, format_checker=validator.FORMAT_CHECKER).validate(value)


def test_draft4_exclusive_bounds_give_the_only_integer():
    assert json_instance(SCHEMAS["draft4_exclusive"], np.random.default_rng(0)) == 1


def test_remote_ref_is_reported():
    with pytest.raises(SchemaInstanceError, match="remote \\$ref"):
        json_instance({"$ref": "https://example.com/s.json"}, np.random.default_rng(0))


def test_unsatisfiable_schema_is_a_reported_failure():
    spec = ConstraintSpec("json_schema", {"type": "integer", "minimum": 5, "maximum": 1})
    with pytest.raises(InstanceFailure) as info:
        valid_instances("bad", spec, 2, 0)
    assert info.value.spec_id == "bad" and "empty numeric range" in info.value.reason


def test_not_keyword_is_enforced_by_validation():
    spec = ConstraintSpec("json_schema", {"type": "integer", "minimum": 0, "maximum": 3, "not": {"const": 2}})
    texts = valid_instances("n", spec, 3, 0)
    assert "2" not in texts and len(texts) == 3


def test_instances_use_the_stated_separators():
    spec = ConstraintSpec("json_schema", SCHEMAS["enum_const"])
    text = valid_instances("s", spec, 1, 0)[0]
    assert text.startswith('{"e": "') and ', "c": 3' in text


def test_hypothesis_fallback_covers_what_the_direct_generator_misses():
    from cdbench.workloads.instances import hypothesis_json_instance
    from cdbench.workloads.json_instances import json_instance as direct
    from cdbench.workloads.validate import InvalidInstance, check_instance

    schema = {"type": "string", "not": {"pattern": "^[a-z0-9]*$"}}
    spec = ConstraintSpec("json_schema", schema)
    for seed in range(5):  # the direct generator only draws [a-z0-9] strings
        with pytest.raises(InvalidInstance):
            check_instance(spec, '"' + direct(schema, np.random.default_rng(seed)) + '"')
    text = valid_instances("fallback", spec, 2, 0)[0]
    check_instance(spec, text)
    assert hypothesis_json_instance(spec) == text  # derandomized: deterministic
    assert hypothesis_json_instance(ConstraintSpec("json_schema", {"type": "integer", "minimum": 5, "maximum": 1})) is None


def test_generation_never_mutates_the_spec():
    import copy

    # hypothesis-jsonschema inlines a $ref like this one into the dict it is given
    schema = {"type": "object", "properties": {"a": {"$ref": "#/definitions/x"}},
              "required": ["a"], "definitions": {"x": {"allOf": [{"type": "string"}, {"minLength": 2}]}}}
    before = copy.deepcopy(schema)
    spec = ConstraintSpec("json_schema", schema)
    from cdbench.workloads.instances import hypothesis_json_instance

    hypothesis_json_instance(spec)
    valid_instances("m", spec, 3, 0)
    assert schema == before


def test_hypothesis_fallback_does_not_depend_on_the_clock(monkeypatch):
    """A loaded machine must draw the same workload as an idle one: no wall-clock cap on the fallback."""
    import itertools
    import time

    from cdbench.workloads.instances import hypothesis_json_instance

    spec = ConstraintSpec("json_schema", {"type": "string", "not": {"pattern": "^[a-z0-9]*$"}})
    expected = hypothesis_json_instance(spec)
    ticks = itertools.count(step=3600.0)  # every clock reading an hour after the last
    monkeypatch.setattr(time, "monotonic", lambda: next(ticks))
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    assert expected is not None and hypothesis_json_instance(spec) == expected
