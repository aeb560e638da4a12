from __future__ import annotations

import json
import socket

import pytest

from cdbench.backends.base import ConstraintSpec
from cdbench.workloads.validate import (
    InvalidInstance,
    JsonValidator,
    check_instance,
    json_validator,
    spec_validator,
    validity_check,
)

ITEMS = {"type": "object", "required": ["id"],
         "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}}


def spec(schema) -> ConstraintSpec:
    return ConstraintSpec("json_schema", schema)


def test_a_valid_instance_passes_with_the_fast_validator():
    assert JsonValidator(ITEMS).engine == "jsonschema-rs"
    check_instance(spec(ITEMS), '{"id": 3, "tags": ["a"]}')
    check_instance(spec(json.dumps(ITEMS)), '{"id": 3}')  # the spec as JSON text


@pytest.mark.parametrize(("text", "reason"), [
    ('{"id": 3, "tags": ["a", 7]}', 'type at /tags/1: 7 is not of type "string"'),
    ('{"tags": []}', 'required at /: "id" is a required property'),
])
def test_an_invalid_instance_names_the_keyword_and_the_instance_path(text, reason):
    with pytest.raises(InvalidInstance) as caught:
        check_instance(spec(ITEMS), text)
    assert str(caught.value) == reason


@pytest.mark.parametrize("text", ['{"id": 3', "", "NaN", '{"id": Infinity}'])
def test_text_that_is_not_strict_json_is_invalid(text):
    with pytest.raises(InvalidInstance, match="^not JSON: "):
        check_instance(spec({}), text)


def test_a_schema_jsonschema_rs_refuses_falls_back_and_still_judges():
    # A corpus schema's pattern ECMA-262 rejects (a lone "}") but Python's re takes.
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "string", "pattern": ".*\\{\\{.+}}.*"}
    validator = JsonValidator(schema)
    assert validator.engine == "jsonschema"
    assert "is not a \"regex\"" in validator.refusal
    check_instance(spec(schema), '"say {{name}}"')
    with pytest.raises(InvalidInstance, match="^pattern at /: "):
        check_instance(spec(schema), '"say {name}"')


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the validator tried to reach the network")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_a_remote_ref_is_never_fetched_and_makes_the_instance_invalid(no_network):
    # .invalid never resolves: a fetch attempt would fail differently from the refusal checked here.
    schema = {"$ref": "https://schemas.invalid/item.json"}
    assert "'https://schemas.invalid/item.json' is not fetched" in JsonValidator(schema).refusal
    reason = r"^validator failed on the schema: .*Unresolvable: https://schemas\.invalid/item\.json"
    with pytest.raises(InvalidInstance, match=reason):
        check_instance(spec(schema), "3")


def test_a_remote_ref_validation_does_not_reach_keeps_its_verdicts(no_network):
    schema = {"anyOf": [{"type": "integer"}, {"$ref": "https://schemas.invalid/item.json"}]}
    check_instance(spec(schema), "3")  # the first branch holds: the ref is never needed
    with pytest.raises(InvalidInstance, match="Unresolvable"):
        check_instance(spec(schema), '"x"')


def test_formats_are_checked():
    date = {"type": "string", "format": "date"}
    check_instance(spec(date), '"2024-02-29"')
    with pytest.raises(InvalidInstance, match='^format at /: "2024-02-30" is not a "date"'):
        check_instance(spec(date), '"2024-02-30"')  # python jsonschema refused it too


def test_formats_python_jsonschema_skipped_are_checked_now():
    # Before jsonschema-rs these passed: python jsonschema checks date-time and uri only
    # with optional packages cdbench does not install.
    schema = {"properties": {"at": {"format": "date-time"}, "home": {"format": "uri"}}}
    check_instance(spec(schema), '{"at": "2024-05-06T12:30:00Z", "home": "https://example.com/a"}')
    with pytest.raises(InvalidInstance, match='^format at /at: "2024-05-71T12:30:00Z" is not a "date-time"'):
        check_instance(spec(schema), '{"at": "2024-05-71T12:30:00Z"}')
    with pytest.raises(InvalidInstance, match="^format at /home: "):
        check_instance(spec(schema), '{"home": "git@example.com:repo.git"}')


def test_the_declared_draft_is_used_and_2020_12_otherwise():
    integer = {"type": "integer"}
    check_instance(spec(integer), "1.0")  # 2020-12: a number with a zero fraction is an integer
    with pytest.raises(InvalidInstance, match="^type at /: "):
        check_instance(spec({"$schema": "http://json-schema.org/draft-04/schema#", **integer}), "1.0")


def test_validators_are_cached_per_schema():
    text = json.dumps(ITEMS)
    assert spec_validator(spec(text)) is spec_validator(spec(text))
    reordered = dict(reversed(list(ITEMS.items())))
    assert json_validator(reordered) is json_validator(ITEMS) is spec_validator(spec(ITEMS))


@pytest.mark.parametrize(("spec", "text"), [
    (ConstraintSpec("json_schema", ITEMS), '{"id": 1, "tags": ["a"]}'),
    (ConstraintSpec("json_schema", ITEMS), '{"id": "1"}'),
    (ConstraintSpec("json_schema", ITEMS), '{"id": NaN}'),
    (ConstraintSpec("json_schema", ITEMS), '{"id":'),
    (ConstraintSpec("json_schema", {"$ref": "https://schemas.invalid/x.json"}), "1"),
    (ConstraintSpec("regex", r"[0-9]+"), "42"),
    (ConstraintSpec("regex", r"[0-9]+"), "4a"),
    (ConstraintSpec("choice", ["yes", "no"]), "no"),
    (ConstraintSpec("choice", ["yes", "no"]), "maybe"),
])
def test_validity_check_gives_check_instances_verdict(no_network, spec, text):
    try:
        check_instance(spec, text)
        expected = True
    except InvalidInstance:
        expected = False
    assert validity_check(spec)(text) is expected


def test_validity_check_cases_cover_both_verdicts():
    assert validity_check(ConstraintSpec("json_schema", ITEMS))('{"id": 1}')
    assert not validity_check(ConstraintSpec("json_schema", ITEMS))('{"id": NaN}')
