"""Checks that an instance text satisfies its spec, with a real validator per kind.

- ``json_schema``: parsed as strict JSON (``NaN`` and ``Infinity`` are not
  JSON), then checked by the schema's :class:`JsonValidator`: jsonschema-rs
  for the schema's ``$schema`` draft (2020-12 when none), formats checked;
- ``regex``: ``re.fullmatch``;
- ``choice``: membership;
- ``ebnf``: the grammar accepts the text (see :mod:`cdbench.workloads.grammar_instances`).

No validator fetches anything: a ``$ref`` to a resource outside the schema
(``https://...``, ``other.json``) is unresolvable, and a schema that needs
one judges every instance invalid ("validator failed on the schema").

Where jsonschema-rs and python ``jsonschema`` (the validator before it, and
the fallback now) disagree, jsonschema-rs follows the specification (found on
the shared corpora's JSON schemas: 1,656 of 353,410 instances disagree):

- formats: jsonschema-rs checks every format it knows, under every draft
  (``date`` in a draft-04 schema too); python ``jsonschema`` skips those whose
  optional packages are missing (``date-time``, ``time``, ``uri``,
  ``hostname``, ...) and takes any ``email`` with an ``@``. Most
  disagreements are an invalid ``date-time``, ``uri`` or ``email`` now refused;
- ``multipleOf`` with a decimal fraction is exact: ``0.47`` is a multiple of
  ``0.01`` (python's float division says no), ``-99999999.82000001`` is not;
- ``dependencies`` in a 2019-09 or 2020-12 schema is applied (the
  JSON-Schema-Test-Suite's optional compatibility behaviour); python
  ``jsonschema`` ignores it there;
- ``pattern`` is an ECMA-262 regex: ``\\d`` and ``\\w`` are ASCII only
  (Python's ``re`` also matches e.g. Arabic-Indic digits or ``é``).

A schema jsonschema-rs refuses falls back to python ``jsonschema`` and keeps
the verdicts it had (on the corpora: 7 of 8,406 schemas, all for a
``pattern`` that is not an ECMA-262 regex, e.g. ``.*\\{\\{.+}}.*``).

>>> from cdbench.backends.base import ConstraintSpec
>>> check_instance(ConstraintSpec("regex", r"\\d+"), "42") is None
True
>>> check_instance(ConstraintSpec("json_schema", {"properties": {"n": {"type": "integer"}}}), '{"n": "x"}')
Traceback (most recent call last):
...
cdbench.workloads.validate.InvalidInstance: type at /n: "x" is not of type "integer"
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import jsonschema_rs
import referencing

from cdbench.backends.base import ConstraintSpec
from cdbench.workloads.grammar_instances import grammar_for

_MESSAGE_CHARS = 200


class InvalidInstance(ValueError):
    """The text does not satisfy the spec; the message says why."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Made once: json.loads with keyword arguments builds a new decoder per call.
_STRICT_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def parse_json(text: str) -> Any:
    """Parse strict JSON text: ``NaN``, ``Infinity`` and ``-Infinity`` are refused; raises ``ValueError``."""
    return _STRICT_DECODER.decode(text)


def _refuse_retrieval(uri: str) -> Any:
    raise ValueError(f"remote $ref {uri!r} is not fetched (cdbench validates offline)")


# Python jsonschema's default registry fetches remote refs over HTTP; an empty
# one (plus the drafts' meta-schemas jsonschema adds) makes them unresolvable.
_OFFLINE_REGISTRY: referencing.Registry = referencing.Registry()


class JsonValidator:
    """One JSON Schema, compiled once: ``is_valid(value)`` for the verdict, :meth:`error` for the reason.

    jsonschema-rs compiles the schema (its ``$schema`` draft, 2020-12 when
    none; formats checked; remote refs never fetched). A schema jsonschema-rs
    refuses (not a dict or bool, not valid against its meta-schema, a regex
    ECMA-262 rejects, an unknown ``$schema``, an unresolvable ``$ref``) is
    compiled by python ``jsonschema`` instead, as before jsonschema-rs: that
    validator ignores what it does not understand and raises (``is_valid`` and
    :meth:`error` alike) only when validation reaches a part it cannot apply.

    Parameters
    ----------
    schema : Any
        The parsed schema.

    Attributes
    ----------
    is_valid : Callable[[Any], bool]
        Whether a parsed JSON value satisfies the schema (the compiled
        validator's own method: no Python frame in between).
    engine : str
        ``"jsonschema-rs"`` or ``"jsonschema"`` (the fallback).
    refusal : str | None
        Why jsonschema-rs refused the schema (first line), for the fallback.

    Examples
    --------
    >>> v = JsonValidator({"type": "array", "items": {"type": "integer"}})
    >>> v.engine, v.is_valid([1, 2]), v.error([1, "2"])
    ('jsonschema-rs', True, 'type at /1: "2" is not of type "integer"')
    >>> v = JsonValidator({"type": "string", "pattern": "\\\\Z"})  # Python-only regex syntax
    >>> v.engine, v.is_valid("a")
    ('jsonschema', True)
    """

    __slots__ = ("is_valid", "engine", "refusal", "_validator")

    def __init__(self, schema: Any) -> None:
        self.refusal: str | None = None
        try:
            if not isinstance(schema, (dict, bool)):
                # jsonschema-rs would parse a string as schema text; the schema is already parsed.
                raise ValueError(f"a schema is an object or a boolean, not {type(schema).__name__}")
            self._validator = jsonschema_rs.validator_for(
                schema, validate_formats=True, retriever=_refuse_retrieval
            )
            self.engine = "jsonschema-rs"
        except ValueError as exc:  # jsonschema_rs.ValidationError is one: the schema was refused
            self.refusal = str(exc).split("\n", 1)[0]
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            self._validator = cls(schema, format_checker=cls.FORMAT_CHECKER, registry=_OFFLINE_REGISTRY)
            self.engine = "jsonschema"
        self.is_valid = self._validator.is_valid

    def error(self, value: Any) -> str | None:
        """Why ``value`` fails, as ``"<keyword> at /<instance path>: <message>"``; ``None`` if it passes."""
        if self.engine == "jsonschema-rs":
            found = next(iter(self._validator.iter_errors(value)), None)
            if found is None:
                return None
            keyword, path, message = found.kind.name, found.instance_path, found.message
        else:
            best = jsonschema.exceptions.best_match(self._validator.iter_errors(value))
            if best is None:
                return None
            keyword, path, message = best.validator, best.absolute_path, best.message
        return f"{keyword} at /{'/'.join(map(str, path))}: {message[:_MESSAGE_CHARS]}"


# Real schemas mix drafts without saying so (draft-04's ``exclusiveMinimum: true`` with no ``$schema``,
# duplicate ``enum`` values that only draft-04's meta-schema forbids), and engines accept them.
_DRAFTS = (jsonschema.Draft202012Validator, jsonschema.Draft201909Validator, jsonschema.Draft7Validator,
           jsonschema.Draft6Validator, jsonschema.Draft4Validator)


def schema_error(schema: Any) -> str | None:
    """``invalid JSON Schema: <why>``, naming the keyword and its path; ``None`` when ``schema`` is one.

    A schema is refused only when no draft's meta-schema accepts it (its
    declared draft's complaint is reported), so schemas that mix drafts, as
    real ones do, pass. jsonschema-rs checks first (fast); python
    ``jsonschema`` confirms a refusal without the meta-schemas' ``regex``
    format check, which the ``pattern`` checks of :class:`JsonValidator`
    already handle with their fallback.

    >>> schema_error({"type": "object", "properties": {"n": {"exclusiveMinimum": True, "minimum": 0}}}) is None
    True
    >>> schema_error({"properties": {"n": {"type": "nonsense"}}})
    "invalid JSON Schema: keyword type at /properties/n/type: 'nonsense' is not valid under any of the given schemas"
    """
    if not isinstance(schema, (dict, bool)):
        return f"invalid JSON Schema: a schema is an object or a boolean, not {type(schema).__name__}"
    try:
        jsonschema_rs.meta.validate(schema)
        return None
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError):
        pass  # confirmed (or not) below, draft by draft
    declared = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    drafts = (declared, *(d for d in _DRAFTS if d is not declared))
    first: str | None = None
    for draft in drafts:
        best = jsonschema.exceptions.best_match(draft(draft.META_SCHEMA).iter_errors(schema))
        if best is None:
            return None
        if first is None:
            path = list(map(str, best.absolute_path))
            where = f"keyword {path[-1]} at /{'/'.join(path)}" if path else "the schema"
            first = f"invalid JSON Schema: {where}: {best.message[:_MESSAGE_CHARS]}"
    return first


@functools.lru_cache(maxsize=4096)
def _compiled(schema_text: str) -> JsonValidator:
    return JsonValidator(json.loads(schema_text))


def json_validator(schema: Any) -> JsonValidator:
    """The cached :class:`JsonValidator` of a parsed ``schema`` (one serialization per call)."""
    return _compiled(json.dumps(schema, sort_keys=True))


def spec_validator(spec: ConstraintSpec) -> JsonValidator:
    """The cached :class:`JsonValidator` of a ``json_schema`` spec.

    A spec given as JSON text is its own cache key (nothing is serialized per
    call); a dict is serialized once per call to find its entry.
    """
    return _compiled(spec.spec) if isinstance(spec.spec, str) else json_validator(spec.spec)


def check_instance(spec: ConstraintSpec, text: str) -> None:
    """Raise :class:`InvalidInstance` unless ``text`` satisfies ``spec``."""
    if spec.kind == "json_schema":
        try:
            value = parse_json(text)
        except ValueError as exc:
            raise InvalidInstance(f"not JSON: {exc}") from exc
        try:
            validator = spec_validator(spec)
            error = None if validator.is_valid(value) else validator.error(value)
        except Exception as exc:  # noqa: BLE001 - a malformed schema can break the validator in many ways
            raise InvalidInstance(f"validator failed on the schema: {exc}") from exc
        if error is not None:
            raise InvalidInstance(error)
    elif spec.kind == "regex":
        if re.fullmatch(spec.spec, text) is None:
            raise InvalidInstance(f"does not fully match the pattern: {text[:80]!r}")
    elif spec.kind == "choice":
        if text not in spec.spec:
            raise InvalidInstance(f"{text[:80]!r} is not one of the choices")
    elif spec.kind == "ebnf":
        reason = grammar_for(spec).rejection(text)
        if reason is not None:
            raise InvalidInstance(reason)
    else:
        raise InvalidInstance(f"no validator for kind {spec.kind!r}")


def validity_check(spec: ConstraintSpec) -> Callable[[str], bool]:
    """Whether a text satisfies ``spec``: :func:`check_instance`'s verdict, cheaper per call.

    A JSON schema's :class:`JsonValidator` is looked up once here, and a text
    costs one strict JSON parse and one ``is_valid`` pass (the reason for a
    failure is never needed).

    >>> check = validity_check(ConstraintSpec("json_schema", {"type": "integer"}))
    >>> check("3"), check("3.5"), check("{"), check("NaN")
    (True, False, False, False)
    """
    if spec.kind == "json_schema":
        try:
            is_valid = spec_validator(spec).is_valid
        except Exception:  # noqa: BLE001 - check_instance counts a schema the validator cannot take as invalid
            return lambda text: False

        def check_json(text: str) -> bool:
            try:
                value = parse_json(text)
            except ValueError:
                return False
            try:
                return bool(is_valid(value))
            except Exception:  # noqa: BLE001 - as check_instance: a malformed schema can break the validator
                return False

        return check_json

    def check_other(text: str) -> bool:
        try:
            check_instance(spec, text)
        except InvalidInstance:
            return False
        return True

    return check_other
