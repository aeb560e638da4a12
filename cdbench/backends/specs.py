r"""Spec handling shared by the engine adapters: parsing, error reasons, unenforced keywords.

Every engine reports failures in its own words and with its own exception
types; the helpers here turn a spec and an engine's message into the same
:class:`~cdbench.backends.base.CompileError` reasons for all of them, and find
the JSON Schema keywords an engine compiles but does not enforce.

>>> unenforced_keywords({"type": "array", "uniqueItems": True}, frozenset({"uniqueItems"}))
("'uniqueItems' at #",)
>>> beside_pattern = IgnoredWhen("maxLength", lambda node: "pattern" in node, "beside 'pattern'")
>>> unenforced_keywords({"type": "string", "pattern": "a+", "maxLength": 3}, frozenset(), (beside_pattern,))
("'maxLength' at # (beside 'pattern')",)
>>> choice_regex(["a.b", "c"])
'(a\\.b|c)'
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema

from cdbench.backends.base import CompileError, ConstraintSpec

WHITESPACE_STYLES = ("compact", "flexible")
# The compact convention every engine can express: no optional whitespace,
# separators as Python's json.dumps writes them.
ITEM_SEPARATOR = ", "
KEY_SEPARATOR = ": "

_UNSUPPORTED_WORDS = re.compile(
    r"unsupport|not supported|unimplemented|not implemented|unknown format|not yet", re.IGNORECASE
)

# Schema keywords whose value is one subschema, a map of subschemas, or a list of them.
_SUBSCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames",
              "not", "if", "then", "else", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def check_whitespace(whitespace: str) -> str:
    if whitespace not in WHITESPACE_STYLES:
        raise ValueError(
            f"whitespace={whitespace!r} is not a whitespace style; use one of {', '.join(WHITESPACE_STYLES)}"
        )
    return whitespace


def load_schema(spec: ConstraintSpec, backend: str) -> dict[str, Any]:
    """The JSON Schema of a ``json_schema`` spec as an object; ``CompileError`` if it is not one.

    The boolean schema ``true`` becomes ``{}`` (engines differ on booleans);
    ``false`` admits no instance and is refused.
    """
    schema = spec.spec
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise CompileError(backend, spec.kind, "invalid", f"schema is not JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise CompileError(backend, spec.kind, "invalid",
                           f"a JSON Schema is an object or a boolean, not {type(schema).__name__}")
    return _object_schema(schema, backend, spec.kind)


def _object_schema(schema: dict[str, Any] | bool, backend: str, kind: str) -> dict[str, Any]:
    if schema is False:
        raise CompileError(backend, kind, "invalid", "the schema false admits no instance")
    return {} if schema is True else schema


def load_choices(spec: ConstraintSpec, backend: str) -> list[str]:
    """The options of a ``choice`` spec; ``CompileError`` unless a non-empty list of strings."""
    options = spec.spec
    if not isinstance(options, (list, tuple)) or not options or not all(isinstance(o, str) for o in options):
        raise CompileError(backend, spec.kind, "invalid", "a choice is a non-empty list of strings")
    return list(options)


def load_text(spec: ConstraintSpec, backend: str) -> str:
    """The text of a ``regex`` or ``ebnf`` spec; ``CompileError`` unless a string."""
    if not isinstance(spec.spec, str):
        raise CompileError(backend, spec.kind, "invalid",
                           f"a {spec.kind} spec is text, not {type(spec.spec).__name__}")
    return spec.spec


def ebnf_dialect(spec: ConstraintSpec, backend: str) -> str:
    dialect = spec.options.get("dialect", "gbnf")
    if dialect not in ("gbnf", "lark"):
        raise CompileError(backend, spec.kind, "invalid",
                           f"unknown grammar dialect {dialect!r}; use 'gbnf' or 'lark'")
    return dialect


@dataclass(frozen=True)
class ToolCallTag:
    """One tool call of a ``structural_tag`` spec: ``begin``, a JSON value matching ``schema``, ``end``."""

    begin: str
    schema: dict[str, Any]
    end: str


def load_tool_call_tags(spec: ConstraintSpec, backend: str) -> list[ToolCallTag]:
    """The tags of a ``structural_tag`` spec: ``{"begin", "schema", "end"}`` or ``{"tags": [...]}``."""
    value = spec.spec
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise CompileError(backend, spec.kind, "invalid", f"structural tag is not JSON: {exc}") from None
    items = value.get("tags") if isinstance(value, Mapping) and "tags" in value else [value]
    if not isinstance(items, list) or not items:
        raise CompileError(backend, spec.kind, "invalid", "'tags' must be a non-empty list")
    tags = []
    for item in items:
        if not (isinstance(item, Mapping) and isinstance(item.get("begin"), str) and item["begin"]
                and isinstance(item.get("end"), str) and isinstance(item.get("schema"), (dict, bool))):
            raise CompileError(backend, spec.kind, "invalid",
                               "a tag is {'begin': non-empty str, 'schema': JSON Schema, 'end': str}")
        tags.append(ToolCallTag(item["begin"], _object_schema(item["schema"], backend, spec.kind), item["end"]))
    return tags


def failure(backend: str, spec: ConstraintSpec, message: str) -> CompileError:
    """A :class:`CompileError` for an engine that refused ``spec`` with ``message``.

    The reason is ``invalid`` for a schema (or a tool call's schema) that fails the JSON Schema
    meta-schema; else ``unsupported`` when the engine says it lacks the
    feature, or for a regex Python's ``re`` compiles (anchors, lookaround);
    else ``invalid``.
    """
    message = failure_message(message)
    if not all(_meets_metaschema(schema) for schema in _schemas_in(spec)):
        return CompileError(backend, spec.kind, "invalid", message)
    if _UNSUPPORTED_WORDS.search(message):
        return CompileError(backend, spec.kind, "unsupported", message)
    if spec.kind == "regex" and isinstance(spec.spec, str):
        try:
            re.compile(spec.spec)
        except re.error:
            return CompileError(backend, spec.kind, "invalid", message)
        return CompileError(backend, spec.kind, "unsupported", message)
    return CompileError(backend, spec.kind, "invalid", message)


def failure_message(message: object) -> str:
    """An engine's error text without its source location.

    xgrammar prefixes ``[hh:mm:ss] /project/cpp/file.cc:123:``, which says nothing to a user.
    """
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(message).strip())


def _schemas_in(spec: ConstraintSpec) -> list[Any]:
    if spec.kind == "json_schema":
        return [spec.spec]
    if spec.kind == "structural_tag" and isinstance(spec.spec, Mapping):
        items = spec.spec.get("tags", [spec.spec])
        return [item["schema"] for item in items if isinstance(item, Mapping) and "schema" in item]
    return []


def _meets_metaschema(schema: Any) -> bool:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            return False
    if not isinstance(schema, (dict, bool)):
        return False
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError:
        return False
    return True


@dataclass(frozen=True)
class IgnoredWhen:
    """A keyword an engine ignores only in some schemas: where ``applies(node)`` holds.

    ``node`` is the schema object that holds ``keyword``; ``why`` says what
    makes the engine drop it (shown in the warning).
    """

    keyword: str
    applies: Callable[[Mapping[str, Any]], bool]
    why: str


def _requires_unlisted(node: Mapping[str, Any]) -> bool:
    properties = node.get("properties", {})
    return (isinstance(node["required"], list) and isinstance(properties, Mapping)
            and any(name not in properties for name in node["required"]))


#: xgrammar and outlines-core let an object end without a required key that
#: ``properties`` does not list (whatever ``additionalProperties`` says).
REQUIRED_UNLISTED = IgnoredWhen("required", _requires_unlisted, "names a key not in 'properties'")


def unenforced_keywords(schema: Any, ignored: frozenset[str],
                        ignored_when: tuple[IgnoredWhen, ...] = ()) -> tuple[str, ...]:
    """Where ``schema`` uses keywords in ``ignored``, or ``ignored_when`` applies, as ``"'keyword' at <pointer>"``.

    Walks only schema positions, so a property *named* ``not`` is not reported.
    """
    found: dict[str, None] = {}
    for node, path in _nodes(schema, "#"):
        for key in node:
            if key in ignored:
                found[f"'{key}' at {path}"] = None
        for rule in ignored_when:
            if rule.keyword in node and rule.applies(node):
                found[f"'{rule.keyword}' at {path} ({rule.why})"] = None
    return tuple(found)


def _nodes(schema: Any, path: str) -> Iterator[tuple[Mapping[str, Any], str]]:
    """Every schema object in ``schema`` with its JSON pointer."""
    if not isinstance(schema, Mapping):
        return
    yield schema, path
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), Mapping):
            yield from _nodes(schema[key], f"{path}/{key}")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), Mapping):
            for name, sub in schema[key].items():
                yield from _nodes(sub, f"{path}/{key}/{_pointer_escape(name)}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from _nodes(sub, f"{path}/{key}/{i}")


def _pointer_escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def unenforced_warnings(backend: str, schema: Any, ignored: frozenset[str],
                        ignored_when: tuple[IgnoredWhen, ...] = ()) -> tuple[str, ...]:
    """Warnings for :attr:`CompiledGrammar.warnings`: one per ignored keyword use."""
    return tuple(f"{backend} compiles but does not enforce {where}"
                 for where in unenforced_keywords(schema, ignored, ignored_when))


_REGEX_META = frozenset("\\.+*?()|[]{}^$")
_REGEX_CONTROL = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def regex_literal(text: str) -> str:
    """``text`` as a regex matching exactly it, in the syntax all three engines read.

    Only metacharacters are escaped: xgrammar warns on needless escapes (an escaped space).
    """
    out = []
    for ch in text:
        if ch in _REGEX_META:
            out.append("\\" + ch)
        elif ch in _REGEX_CONTROL:
            out.append(_REGEX_CONTROL[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def choice_regex(options: list[str]) -> str:
    """A regex matching exactly one of ``options``."""
    return "(" + "|".join(regex_literal(o) for o in options) + ")"
