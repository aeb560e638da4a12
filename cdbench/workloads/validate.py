"""Checks that an instance text satisfies its spec, with a real validator per kind.

- ``json_schema``: parsed as JSON, then the ``jsonschema`` validator of the
  schema's draft with format checking;
- ``regex``: ``re.fullmatch``;
- ``choice``: membership;
- ``ebnf``: the grammar accepts the text (see :mod:`cdbench.workloads.grammar_instances`).

>>> from cdbench.backends.base import ConstraintSpec
>>> check_instance(ConstraintSpec("regex", r"\\d+"), "42") is None
True
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import jsonschema

from cdbench.backends.base import ConstraintSpec


class InvalidInstance(ValueError):
    """The text does not satisfy the spec; the message says why."""


@functools.lru_cache(maxsize=4096)
def _validator_for(schema_text: str) -> Any:
    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def json_validator(schema: Any) -> Any:
    """A cached ``jsonschema`` validator for ``schema`` (its declared draft, formats checked)."""
    return _validator_for(json.dumps(schema, sort_keys=True))


def check_instance(spec: ConstraintSpec, text: str) -> None:
    """Raise :class:`InvalidInstance` unless ``text`` satisfies ``spec``."""
    if spec.kind == "json_schema":
        schema = json.loads(spec.spec) if isinstance(spec.spec, str) else spec.spec
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInstance(f"not JSON: {exc}") from exc
        try:
            error = jsonschema.exceptions.best_match(json_validator(schema).iter_errors(value))
        except Exception as exc:  # noqa: BLE001 - a malformed schema can break the validator in many ways
            raise InvalidInstance(f"validator failed on the schema: {type(exc).__name__}: {exc}") from exc
        if error is not None:
            path = "/".join(map(str, error.absolute_path))
            raise InvalidInstance(f"{error.validator} at /{path}: {error.message[:200]}")
    elif spec.kind == "regex":
        if re.fullmatch(spec.spec, text) is None:
            raise InvalidInstance(f"does not fully match the pattern: {text[:80]!r}")
    elif spec.kind == "choice":
        if text not in spec.spec:
            raise InvalidInstance(f"{text[:80]!r} is not one of the choices")
    elif spec.kind == "ebnf":
        from cdbench.workloads.grammar_instances import grammar_for

        grammar_for(spec).check(text)
    else:
        raise InvalidInstance(f"no validator for kind {spec.kind!r}")
