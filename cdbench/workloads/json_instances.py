"""Seeded JSON values that satisfy a JSON Schema.

A direct recursive generator: it honours types, ``required``, ``enum``,
``const``, string and array lengths, numeric bounds and ``multipleOf``,
``pattern`` (through :mod:`cdbench.workloads.regex_instances`), common
``format`` values, local ``$ref``, ``allOf`` (merged), ``anyOf``/``oneOf``
(one branch drawn), ``if``/``then``/``else``, tuples and ``contains``.
Keywords it cannot steer (``not``, ``uniqueItems`` on complex items,
``oneOf`` exclusivity, ``dependentSchemas``) are left to the validator that
checks every draw; the caller retries with a fresh draw.

>>> import numpy as np
>>> schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"]}
>>> value = json_instance(schema, np.random.default_rng(0))
>>> value["n"] >= 3
True
"""

from __future__ import annotations

import math
import string
from typing import Any
from urllib.parse import unquote

import numpy as np

from cdbench.workloads.regex_instances import RegexInstanceError, regex_instance

# Beyond this nesting depth, optional properties are left out and arrays are
# kept at their minimum, so recursive schemas terminate.
MAX_DEPTH = 12
# Values drawn before the generator switches to minimal mode (keeps instances short).
NODE_BUDGET = 150
# Probability that an optional property is included.
OPTIONAL_PROPERTY_P = 0.35
_WORD_CHARS = string.ascii_lowercase + string.digits

_FORMATS: dict[str, str] = {
    "date-time": "2024-05-{d:02d}T12:{m:02d}:00Z",
    "date": "2024-05-{d:02d}",
    "time": "12:{m:02d}:00Z",
    "email": "user{n}@example.com",
    "idn-email": "user{n}@example.com",
    "hostname": "host{n}.example.com",
    "idn-hostname": "host{n}.example.com",
    "ipv4": "192.168.{d}.{m}",
    "ipv6": "2001:db8::{n:x}",
    "uri": "https://example.com/item/{n}",
    "iri": "https://example.com/item/{n}",
    "uri-reference": "https://example.com/ref/{n}",
    "iri-reference": "https://example.com/ref/{n}",
    "url": "https://example.com/page/{n}",
    "uri-template": "https://example.com/{{id}}/{n}",
    "uuid": "123e4567-e89b-42d3-a456-{n:012d}",
    "duration": "P{d}D",
    "json-pointer": "/items/{n}",
    "relative-json-pointer": "0/items/{n}",
    "regex": "^[a-z]{{{d}}}$",
    "color": "#a{n:05d}",
}


class SchemaInstanceError(ValueError):
    """The schema has a construct the generator cannot satisfy (e.g. a remote ``$ref``)."""


def json_instance(schema: Any, rng: np.random.Generator) -> Any:
    """One JSON value drawn for ``schema`` (to be validated by the caller)."""
    return _Generator(schema, rng).value(schema, 0)


class _Generator:
    def __init__(self, root: Any, rng: np.random.Generator) -> None:
        self.root = root
        self.rng = rng
        self.nodes = 0

    def minimal(self, depth: int) -> bool:
        """Past the depth or size budget: only what is required, smallest branches."""
        return depth >= MAX_DEPTH or self.nodes > NODE_BUDGET

    # -- helpers ----------------------------------------------------------
    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def pick(self, options: list[Any]) -> Any:
        return options[int(self.rng.integers(len(options)))]

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise SchemaInstanceError(f"remote $ref {ref!r} is not supported")
        node = self.root
        for part in ref[1:].lstrip("/").split("/") if ref not in ("#", "#/") else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, list):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                raise SchemaInstanceError(f"$ref {ref!r} does not resolve")
        return node

    def expand(self, schema: Any, depth: int) -> Any:
        """Resolve ``$ref`` and merge ``allOf`` into one schema dict."""
        seen = 0
        while isinstance(schema, dict) and "$ref" in schema:
            target = self.resolve(schema["$ref"])
            rest = {k: v for k, v in schema.items() if k not in ("$ref", "definitions", "$defs")}
            schema = _merge(target, rest) if rest and isinstance(target, dict) else target
            seen += 1
            if seen > 50:
                raise SchemaInstanceError("$ref cycle without content")
        if isinstance(schema, dict) and "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                merged = _merge(merged, self.expand(part, depth))
            schema = self.expand(merged, depth) if "$ref" in merged or "allOf" in merged else merged
        return schema

    # -- values -----------------------------------------------------------
    def value(self, schema: Any, depth: int) -> Any:
        self.nodes += 1
        if depth > 3 * MAX_DEPTH:
            raise SchemaInstanceError("schema recursion too deep")
        if schema is True or schema == {}:
            return self.scalar_any()
        if schema is False:
            raise SchemaInstanceError("schema `false` admits no value")
        if not isinstance(schema, dict):
            raise SchemaInstanceError(f"schema must be an object, got {type(schema).__name__}")
        schema = self.expand(schema, depth)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            if not schema["enum"]:
                raise SchemaInstanceError("empty enum")
            return self.pick(list(schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema and schema[key]:
                branches = list(schema[key])
                # Deep in a recursive schema, take the simplest branch so the value ends.
                branch = min(branches, key=_weight) if self.minimal(depth) else self.pick(branches)
                rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
                return self.value(_merge(rest, self.expand(branch, depth)), depth + 1)
        if "if" in schema:
            rest = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
            if self.chance(0.5) and isinstance(schema["if"], dict):
                merged = _merge(_merge(rest, schema["if"]), schema.get("then") or {})
            else:
                merged = _merge(rest, schema.get("else") or {})
            return self.value(merged, depth + 1)
        kind = self.choose_type(schema, depth)
        return getattr(self, f"gen_{kind}")(schema, depth)

    def choose_type(self, schema: dict, depth: int) -> str:
        declared = schema.get("type")
        if isinstance(declared, list):
            # "null" is legal but uninformative: prefer a real type when there is one.
            real = [t for t in declared if t != "null"] or declared
            if self.minimal(depth):
                real = [t for t in declared if t not in ("object", "array")] or real
            return self.pick(real)
        if isinstance(declared, str):
            return declared
        if any(k in schema for k in ("properties", "required", "additionalProperties", "patternProperties", "minProperties")):
            return "object"
        if any(k in schema for k in ("items", "prefixItems", "minItems", "maxItems", "contains")):
            return "array"
        if any(k in schema for k in ("minLength", "maxLength", "pattern", "format")):
            return "string"
        if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")):
            return "number"
        return "string"

    def scalar_any(self) -> Any:
        return self.pick(["value", 1, True])

    def gen_null(self, schema: dict, depth: int) -> None:
        return None

    def gen_boolean(self, schema: dict, depth: int) -> bool:
        return self.chance(0.5)

    def gen_integer(self, schema: dict, depth: int) -> int:
        lo, hi = _bounds(schema, integer=True)
        step = schema.get("multipleOf")
        if isinstance(step, (int, float)) and step > 0 and float(step).is_integer():
            step = int(step)
            first = math.ceil(lo / step) * step
            count = max(0, (hi - first) // step)
            return int(first + step * int(self.rng.integers(0, min(count, 100) + 1)))
        return int(self.rng.integers(lo, hi + 1))

    def gen_number(self, schema: dict, depth: int) -> float | int:
        step = schema.get("multipleOf")
        if isinstance(step, (int, float)) and step > 0:
            lo, hi = _bounds(schema, integer=False)
            first = math.ceil(lo / step)
            last = math.floor(hi / step)
            if last < first:
                raise SchemaInstanceError("no multiple of multipleOf within the bounds")
            k = int(self.rng.integers(first, min(last, first + 100) + 1))
            value = k * step
            return int(value) if float(value).is_integer() else round(value, 10)
        if self.chance(0.5):
            return self.gen_integer(schema, depth)
        lo, hi = _bounds(schema, integer=False)
        value = round(float(self.rng.uniform(lo, hi)), 2)
        return value if lo <= value <= hi else lo

    def gen_string(self, schema: dict, depth: int) -> str:
        lo = int(schema.get("minLength", 0))
        hi = int(schema.get("maxLength", max(lo, 12)))
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            try:
                text = regex_instance(pattern, self.rng)
            except RegexInstanceError as exc:
                raise SchemaInstanceError(str(exc)) from exc
            if len(text) < lo:  # pattern is unanchored search: padding may still match
                text += "".join(self.pick(list(_WORD_CHARS)) for _ in range(lo - len(text)))
            return text
        fmt = schema.get("format")
        if isinstance(fmt, str) and fmt in _FORMATS:
            return _FORMATS[fmt].format(n=int(self.rng.integers(1, 10_000)), d=int(self.rng.integers(1, 29)),
                                        m=int(self.rng.integers(0, 60)))
        hi = max(lo, min(hi, lo + 12))
        length = int(self.rng.integers(lo, hi + 1))
        return "".join(self.pick(list(_WORD_CHARS)) for _ in range(length))

    def gen_array(self, schema: dict, depth: int) -> list:
        prefix = schema.get("prefixItems")
        items = schema.get("items", True)
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, schema.get("additionalItems", True)
        prefix = list(prefix or [])
        lo = int(schema.get("minItems", 0))
        hi = int(schema.get("maxItems", max(lo, len(prefix), 3)))
        if self.minimal(depth):
            hi = max(lo, min(hi, len(prefix)))
        count = int(self.rng.integers(lo, max(lo, min(hi, lo + 3)) + 1))
        if prefix:
            count = max(count, min(len(prefix), hi))
        if items is False:
            count = min(count, len(prefix))
        out: list = []
        for i in range(count):
            sub = prefix[i] if i < len(prefix) else items
            out.append(self.value(sub, depth + 1))
        contains = schema.get("contains")
        if contains is not None and isinstance(contains, (dict, bool)):
            needed = int(schema.get("minContains", 1))
            extra = [self.value(contains, depth + 1) for _ in range(needed)]
            out = (extra + out)[: max(hi, needed)]
        if schema.get("uniqueItems"):
            out = _unique(out)
            while len(out) < lo:
                candidate = self.value(items if items is not True else {"type": "integer"}, depth + 1)
                if not any(_json_equal(candidate, o) for o in out):
                    out.append(candidate)
                elif self.chance(0.05):
                    raise SchemaInstanceError("cannot draw enough unique items")
        return out

    def gen_object(self, schema: dict, depth: int) -> dict:
        properties: dict = schema.get("properties") or {}
        required = [r for r in schema.get("required", []) if isinstance(r, str)]
        out: dict[str, Any] = {}
        names = list(properties)
        chosen = [n for n in names if n in required or (not self.minimal(depth) and self.chance(OPTIONAL_PROPERTY_P))]
        for name in required:
            if name not in chosen:
                chosen.append(name)
        dependent = schema.get("dependentRequired") or {
            k: v for k, v in (schema.get("dependencies") or {}).items() if isinstance(v, list)
        }
        for name in list(chosen):
            for other in dependent.get(name, []):
                if other not in chosen:
                    chosen.append(other)
        lo = int(schema.get("minProperties", 0))
        for name in names:
            if len(chosen) >= lo:
                break
            if name not in chosen:
                chosen.append(name)
        additional = schema.get("additionalProperties", True)
        pattern_props: dict = schema.get("patternProperties") or {}
        hi = schema.get("maxProperties")
        if hi is not None:
            keep_required = [n for n in chosen if n in required]
            chosen = keep_required + [n for n in chosen if n not in required][: max(0, int(hi) - len(keep_required))]
        for name in chosen:
            sub = properties.get(name)
            if sub is None:
                sub = _pattern_schema(name, pattern_props)
                if sub is None:
                    sub = additional if isinstance(additional, dict) else True
            out[name] = self.value(sub, depth + 1)
        extra_index = 0
        while len(out) < lo:
            if pattern_props:
                pattern, sub = self.pick(list(pattern_props.items()))
                try:
                    key = regex_instance(pattern, self.rng)
                except RegexInstanceError as exc:
                    raise SchemaInstanceError(str(exc)) from exc
            elif additional is not False:
                key, sub = f"key{extra_index}", additional if isinstance(additional, dict) else True
            else:
                raise SchemaInstanceError("minProperties cannot be met without additional properties")
            extra_index += 1
            if extra_index > 50:
                raise SchemaInstanceError("cannot draw enough distinct property names")
            if key not in out:
                out[key] = self.value(sub, depth + 1)
        return out


def _weight(schema: Any) -> int:
    """Rough size of a schema branch; ``$ref`` and containers weigh most."""
    import json

    text = json.dumps(schema)
    return len(text) + 1000 * (text.count('"$ref"') + text.count('"properties"') + text.count('"items"'))


def _pattern_schema(name: str, pattern_props: dict) -> Any | None:
    import re

    for pattern, sub in pattern_props.items():
        try:
            if re.search(pattern, name):
                return sub
        except re.error:
            continue
    return None


def _bounds(schema: dict, *, integer: bool) -> tuple[Any, Any]:
    """Inclusive [lo, hi] from minimum/maximum/exclusive* (draft 4 booleans and later numbers)."""
    lo = schema.get("minimum")
    hi = schema.get("maximum")
    ex_lo = schema.get("exclusiveMinimum")
    ex_hi = schema.get("exclusiveMaximum")
    nudge = 1 if integer else 0.01
    if isinstance(ex_lo, bool):
        ex_lo = lo if ex_lo else None
        if ex_lo is not None:
            lo = None
    if isinstance(ex_hi, bool):
        ex_hi = hi if ex_hi else None
        if ex_hi is not None:
            hi = None
    if isinstance(ex_lo, (int, float)):
        lo = max(lo, ex_lo + nudge) if isinstance(lo, (int, float)) else ex_lo + nudge
    if isinstance(ex_hi, (int, float)):
        hi = min(hi, ex_hi - nudge) if isinstance(hi, (int, float)) else ex_hi - nudge
    lo = lo if isinstance(lo, (int, float)) else None
    hi = hi if isinstance(hi, (int, float)) else None
    if lo is None and hi is None:
        lo, hi = 0, 100
    elif lo is None:
        lo = hi - 100
    elif hi is None:
        hi = lo + 100
    if integer:
        lo, hi = math.ceil(lo), math.floor(hi)
    if hi < lo:
        raise SchemaInstanceError(f"empty numeric range [{lo}, {hi}]")
    return lo, hi


def _merge(a: Any, b: Any) -> Any:
    """Conjunction of two schema dicts, as far as a generator needs it."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return b if isinstance(b, dict) else a
    out = dict(a)
    for key, value in b.items():
        if key == "properties" and isinstance(out.get(key), dict) and isinstance(value, dict):
            props = dict(out[key])
            for name, sub in value.items():
                props[name] = _merge(props[name], sub) if name in props else sub
            out[key] = props
        elif key == "required" and isinstance(out.get(key), list) and isinstance(value, list):
            out[key] = list(dict.fromkeys(out[key] + value))
        elif key in ("minimum", "minLength", "minItems", "minProperties") and isinstance(out.get(key), (int, float)):
            out[key] = max(out[key], value)
        elif key in ("maximum", "maxLength", "maxItems", "maxProperties") and isinstance(out.get(key), (int, float)):
            out[key] = min(out[key], value)
        elif key == "type" and key in out and out[key] != value:
            left = out[key] if isinstance(out[key], list) else [out[key]]
            right = value if isinstance(value, list) else [value]
            common = [t for t in left if t in right] or [t for t in left if t == "integer" and "number" in right]
            out[key] = common if len(common) != 1 else common[0]
        elif key == "enum" and "enum" in out:
            out[key] = [v for v in out[key] if v in value]
        elif key in ("allOf", "anyOf", "oneOf") and key in out:
            if key == "allOf":
                out[key] = list(out[key]) + list(value)
            else:
                out.setdefault("allOf", [])
                out["allOf"] = list(out["allOf"]) + [{key: value}]
        else:
            out[key] = value
    return out


def _json_equal(a: Any, b: Any) -> bool:
    import json

    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _unique(values: list) -> list:
    out: list = []
    for v in values:
        if not any(_json_equal(v, o) for o in out):
            out.append(v)
    return out
