"""Features of a constraint spec, read from the spec alone.

:mod:`.spec_predictor` prices a spec no backend measured (the engine is not
installed here, or the user asked for a prediction) from these numbers, so
they come from the spec's text and structure with no grammar engine: what
makes a grammar slow to build or to walk (its size, alternatives, bounded
repetitions that engines unroll, regexes inside it, open objects that admit
any JSON) is visible in the spec itself.

Every feature is finite and non-negative; counts and sizes are ``log1p``'d,
since costs grow with them over orders of magnitude and a regression in log
space wants them on a log scale too. :data:`FEATURE_NAMES` fixes each kind's
names and their order. Content an engine would reject (JSON text that does not
parse, unbalanced parentheses, a broken grammar) still gives features (a
failed compile has a cost too, and ``malformed`` says when the text did not
parse); a spec of the wrong Python type for its kind (a regex that is not a
string) is a caller's mistake and raises :class:`SpecFeatureError`.

>>> from cdbench.backends.base import ConstraintSpec
>>> f = spec_features(ConstraintSpec("regex", "^[a-z]{2,8}(x|y)$"))
>>> round(f["log_repeat_bound"], 3), f["log_alternations"] == math.log1p(1)
(2.197, True)
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

from cdbench.backends.base import ConstraintSpec

_JSON_SCHEMA_FEATURES = (
    "log_bytes", "log_nodes", "log_max_depth", "log_properties", "log_required", "log_open_objects",
    "log_additional_schemas", "log_untyped", "log_type_unions", "log_enums", "log_enum_values", "log_consts",
    "log_patterns", "log_pattern_chars", "log_pattern_repeat_bound", "log_string_bounds", "log_max_lengths",
    "log_string_bound_total", "log_string_bound_max", "log_array_bounds",
    "log_array_bound_max", "log_numeric_bounds", "log_formats", "log_branches", "log_all_of", "log_refs",
    "log_definitions", "log_conditionals", "malformed",
)
_REGEX_FEATURES = (
    "log_length", "log_classes", "log_groups", "log_max_nesting", "log_alternations", "log_quantifiers",
    "log_repeats", "log_repeat_bound", "log_repeat_bound_max", "log_repeat_product", "log_lookarounds",
    "log_backrefs", "log_non_ascii", "anchored_start", "anchored_end", "malformed",
)
_GRAMMAR_FEATURES = (
    "log_bytes", "log_lines", "log_rules", "log_terminal_defs", "log_alternatives", "log_literals",
    "log_literal_chars", "log_terminal_regexes", "log_terminal_regex_chars", "log_quantifiers",
    "log_repeat_bound", "log_directives", "lark", "malformed",
)
_CHOICE_FEATURES = ("log_choices", "log_total_bytes", "log_max_bytes")
_STRUCTURAL_TAG_FEATURES = ("log_tags", "log_delimiter_bytes", "malformed") + tuple(
    f"schema_{name}" for name in _JSON_SCHEMA_FEATURES if name != "malformed"
)

FEATURE_NAMES: dict[str, tuple[str, ...]] = {
    "json_schema": _JSON_SCHEMA_FEATURES,
    "regex": _REGEX_FEATURES,
    "ebnf": _GRAMMAR_FEATURES,
    "choice": _CHOICE_FEATURES,
    "structural_tag": _STRUCTURAL_TAG_FEATURES,
}
"""Each constraint kind's feature names, in the order :func:`spec_features` returns them."""

_BIG = 1e300  # numbers past this (or not finite) are taken as this: log1p stays finite


class SpecFeatureError(ValueError):
    """A spec whose value has the wrong type for its kind; the message names the spec."""


def spec_features(spec: ConstraintSpec) -> dict[str, float]:
    """The features of ``spec``: :data:`FEATURE_NAMES` of its kind, in that order, each finite and >= 0.

    Raises :class:`SpecFeatureError` when the spec's value has the wrong type for its kind
    (a ``regex`` or ``ebnf`` that is not a string, a ``choice`` that is not a list of strings,
    a ``json_schema`` that is not an object, a boolean or JSON text, a ``structural_tag`` that
    is not an object).
    """
    value = spec.spec
    if spec.kind == "json_schema":
        if not isinstance(value, (dict, bool, str)):
            raise _type_error(spec, "an object, a boolean or JSON text")
        features = _json_schema_features(value)
        features["log_bytes"] = math.log1p(_bytes(spec.canonical()))
    elif spec.kind == "regex":
        if not isinstance(value, str):
            raise _type_error(spec, "a string")
        features = _regex_features(value)
    elif spec.kind == "ebnf":
        if not isinstance(value, str):
            raise _type_error(spec, "a string")
        features = _grammar_features(value, lark=spec.options.get("dialect") == "lark")
    elif spec.kind == "choice":
        if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
            raise _type_error(spec, "a list of strings")
        sizes = [_bytes(c) for c in value]
        features = {
            "log_choices": math.log1p(len(sizes)),
            "log_total_bytes": math.log1p(sum(sizes)),
            "log_max_bytes": math.log1p(max(sizes, default=0)),
        }
    else:
        if not isinstance(value, dict):
            raise _type_error(spec, "an object")
        features = _structural_tag_features(value)
    return {name: features[name] for name in FEATURE_NAMES[spec.kind]}


def _type_error(spec: ConstraintSpec, expected: str) -> SpecFeatureError:
    shown = spec.canonical()
    shown = shown if len(shown) <= 120 else shown[:117] + "..."
    return SpecFeatureError(f"{spec.kind} spec must be {expected}, got {type(spec.spec).__name__}: {shown}")


def _bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _number(value: Any) -> float | None:
    """A JSON number as a float in ``[0, _BIG]`` (``None``: not a number; booleans are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return _BIG
    return min(abs(number), _BIG) if math.isfinite(number) else _BIG


# --- JSON Schema -----------------------------------------------------------------------------------------

# Keywords whose value is one subschema, a list of them, or a name → subschema map (where engines look).
_ONE_SCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if",
               "then", "else", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("items", "prefixItems", "allOf", "anyOf", "oneOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas", "dependencies")
_DEFINES_VALUE = ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf", "properties", "items", "prefixItems",
                  "pattern", "format")


def _subschemas(node: dict) -> Iterator[Any]:
    for key in _ONE_SCHEMA:
        if isinstance(node.get(key), (dict, bool)):
            yield node[key]
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from node[key]
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from node[key].values()


def _json_schema_features(value: dict | bool | str) -> dict[str, float]:
    """Counts over the schema nodes reached through schema keywords (an iterative walk: any depth).

    String length bounds get three features (how many, their sum, the largest) and patterns the sum of
    their repetition bounds: a grammar engine unrolls a bounded string or ``\\d{1,14}`` into one state
    per position, and xgrammar's compile grows with its states (measured: schemas with a length bound
    compile 25 times slower than those without, a median 1.4 s against 56 ms).
    """
    malformed = 0.0
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            value = {}
            malformed = 1.0
    if not isinstance(value, (dict, bool)):
        value, malformed = {}, 1.0
    counts = dict.fromkeys(_JSON_SCHEMA_FEATURES, 0.0)
    string_bound_max = string_bound_total = pattern_repeats = array_bound_max = 0.0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict):
            continue  # true / false (any / nothing), or a non-schema where a schema belongs
        counts["log_nodes"] += 1
        counts["log_max_depth"] = max(counts["log_max_depth"], depth)
        types = node.get("type")
        if isinstance(types, list) and len(types) > 1:
            counts["log_type_unions"] += 1
        if not any(key in node for key in _DEFINES_VALUE):
            counts["log_untyped"] += 1  # admits any JSON value: the engines' largest generic grammar
        if isinstance(node.get("properties"), dict):
            counts["log_properties"] += len(node["properties"])
        if isinstance(node.get("required"), list):
            counts["log_required"] += len(node["required"])
        is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in node
        if is_object and node.get("additionalProperties", True) is not False:
            counts["log_open_objects"] += 1
        if isinstance(node.get("additionalProperties"), dict):
            counts["log_additional_schemas"] += 1
        if isinstance(node.get("enum"), list):
            counts["log_enums"] += 1
            counts["log_enum_values"] += len(node["enum"])
        if "const" in node:
            counts["log_consts"] += 1
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        counts["log_patterns"] += len(patterns)
        counts["log_pattern_chars"] += sum(len(p) for p in patterns)
        pattern_repeats += sum(math.expm1(_regex_features(p)["log_repeat_bound"]) for p in patterns)
        for key in ("minLength", "maxLength"):
            bound = _number(node.get(key))
            if bound is not None:
                counts["log_string_bounds"] += 1
                counts["log_max_lengths"] += key == "maxLength"
                string_bound_total += bound
                string_bound_max = max(string_bound_max, bound)
        for key in ("minItems", "maxItems", "minProperties", "maxProperties"):
            bound = _number(node.get(key))
            if bound is not None:
                counts["log_array_bounds"] += 1
                array_bound_max = max(array_bound_max, bound)
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
            if _number(node.get(key)) is not None:
                counts["log_numeric_bounds"] += 1
        if isinstance(node.get("format"), str):
            counts["log_formats"] += 1
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                counts["log_branches"] += len(node[key])
        if isinstance(node.get("allOf"), list):
            counts["log_all_of"] += len(node["allOf"])
        if isinstance(node.get("$ref"), str):
            counts["log_refs"] += 1
        for key in ("definitions", "$defs"):
            if isinstance(node.get(key), dict):
                counts["log_definitions"] += len(node[key])
        counts["log_conditionals"] += sum(key in node for key in ("if", "not", "dependentSchemas", "dependencies"))
        stack.extend((child, depth + 1) for child in _subschemas(node))
    counts["log_string_bound_max"] = string_bound_max
    counts["log_string_bound_total"] = min(string_bound_total, _BIG)
    counts["log_pattern_repeat_bound"] = min(pattern_repeats, _BIG)
    counts["log_array_bound_max"] = array_bound_max
    features = {name: math.log1p(count) for name, count in counts.items()}
    features["malformed"] = malformed
    return features


def _structural_tag_features(value: dict) -> dict[str, float]:
    """Tags and their delimiters, and the JSON Schema features of their schemas taken as one ``anyOf``."""
    tags = value.get("tags") if "tags" in value else [value]
    malformed = 0.0
    if not isinstance(tags, list):
        tags, malformed = [], 1.0
    schemas, delimiter_bytes = [], 0
    for tag in tags:
        if not isinstance(tag, dict):
            malformed = 1.0
            continue
        delimiter_bytes += sum(_bytes(tag[k]) for k in ("begin", "end") if isinstance(tag.get(k), str))
        if isinstance(tag.get("schema"), (dict, bool)):
            schemas.append(tag["schema"])
        else:
            malformed = 1.0
    schema_features = _json_schema_features({"anyOf": schemas})
    schema_features["log_bytes"] = math.log1p(_bytes(json.dumps(schemas, separators=(",", ":"), ensure_ascii=False)))
    features = {f"schema_{name}": v for name, v in schema_features.items() if name != "malformed"}
    features |= {"log_tags": math.log1p(len(tags)), "log_delimiter_bytes": math.log1p(delimiter_bytes),
                 "malformed": malformed}
    return features


# --- regex -----------------------------------------------------------------------------------------------

_BOUND = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")
_SHORTHAND_CLASSES = set("dDwWsSpP")


def _bound(digits: str) -> float:
    return float(digits[:18]) if len(digits) <= 18 else 1e18  # int() refuses very long digit strings


def _regex_features(pattern: str) -> dict[str, float]:
    """A one-pass scan of an ECMA-262 / Python pattern: classes, groups, alternations, repetition bounds.

    ``log_repeat_product`` is the largest product of nested bounds (``(a{10}){10}`` unrolls to 100), what
    DFA- and grammar-building engines expand; unbounded ``*``/``+`` count 1 (a loop, not a copy).
    """
    counts = dict.fromkeys(("classes", "groups", "alternations", "quantifiers", "repeats", "lookarounds",
                            "backrefs", "non_ascii"), 0)
    bound_sum = bound_max = 0.0
    # One frame per open group: the largest unrolled size inside it so far.
    frames: list[float] = [1.0]
    max_nesting = 0
    last_atom = 1.0  # the unrolled size of the atom a quantifier after it repeats
    malformed = 0.0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if ord(c) > 127:
            counts["non_ascii"] += 1
        if c == "\\":
            nxt = pattern[i + 1: i + 2]
            if nxt in _SHORTHAND_CLASSES:
                counts["classes"] += 1
            elif (nxt.isdigit() and nxt != "0") or nxt == "k":
                counts["backrefs"] += 1
            i, last_atom = i + 2, 1.0
            continue
        if c == "[":
            counts["classes"] += 1
            j = i + 1
            j += pattern[j: j + 1] == "^"
            j += pattern[j: j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            if j >= n:
                malformed = 1.0
            i, last_atom = j + 1, 1.0
            continue
        if c == "(":
            counts["groups"] += 1
            if pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
                counts["lookarounds"] += 1
            frames.append(1.0)
            max_nesting = max(max_nesting, len(frames) - 1)
            i += 1
            continue
        if c == ")":
            if len(frames) > 1:
                last_atom = frames.pop()
                frames[-1] = max(frames[-1], last_atom)
            else:
                malformed = 1.0
            i += 1
            continue
        if c == "|":
            counts["alternations"] += 1
        elif c in "*+?":
            if not (c in "?+" and i > 0 and pattern[i - 1] in "*+?}"):  # not a lazy / possessive mark
                counts["quantifiers"] += 1
        elif c == "{" and (m := _BOUND.match(pattern, i)) and (m.group(1) or m.group(3)):
            lower = _bound(m.group(1)) if m.group(1) else 0.0
            top = max(lower, _bound(m.group(3)) if m.group(3) else lower)
            counts["repeats"] += 1
            bound_sum += top
            bound_max = max(bound_max, top)
            frames[-1] = max(frames[-1], top * last_atom)
            i = m.end()
            continue
        elif c == ".":
            counts["classes"] += 1
        last_atom = 1.0
        i += 1
    if len(frames) > 1:
        malformed = 1.0
    product = max(frames)
    features = {f"log_{name}": math.log1p(count) for name, count in counts.items()}
    features |= {
        "log_length": math.log1p(len(pattern)),
        "log_max_nesting": math.log1p(max_nesting),
        "log_repeat_bound": math.log1p(min(bound_sum, _BIG)),
        "log_repeat_bound_max": math.log1p(bound_max),
        "log_repeat_product": math.log1p(min(product, _BIG)) if product > 1 else 0.0,
        "anchored_start": float(pattern.startswith("^")),
        "anchored_end": float(pattern.endswith("$") and not pattern.endswith("\\$")),
        "malformed": malformed,
    }
    return features


# --- EBNF grammars (GBNF, Lark) --------------------------------------------------------------------------

_GBNF_RULE = re.compile(r"^\s*[A-Za-z0-9_.-]+\s*::=", re.MULTILINE)
_LARK_DEF = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?\s*:", re.MULTILINE)
_LARK_RANGE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def _grammar_features(text: str, lark: bool) -> dict[str, float]:
    """Rules, alternatives, literals and terminal regexes of a GBNF or Lark grammar.

    One scan lifts out comments (``#`` in GBNF, ``//`` in Lark), quoted literals, GBNF character classes
    and Lark ``/regex/`` terminals, so that the operators and rule heads are counted on what remains.
    """
    literals = literal_chars = regexes = regex_chars = 0
    code: list[str] = []
    malformed = 0.0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if (c == "#" and not lark) or (lark and text.startswith("//", i)):
            while i < n and text[i] != "\n":
                i += 1
            continue
        close = '"' if c == '"' else "]" if c == "[" and not lark else "/" if c == "/" and lark else None
        if close is None:
            code.append(c)
            i += 1
            continue
        j = i + 1
        while j < n and text[j] != close and text[j] != "\n":
            j += 2 if text[j] == "\\" else 1
        if j >= n or text[j] != close:
            malformed = 1.0
        if c == '"':
            literals += 1
            literal_chars += max(j - i - 1, 0)
        else:
            regexes += 1
            regex_chars += max(j - i - 1, 0)
        code.append(" ")
        i = j + 1
    body = "".join(code)
    if lark:
        heads = [m.group(1) for m in _LARK_DEF.finditer(body)]
        rules = sum(h[0].islower() or (h[0] == "_" and h[1:2].islower()) for h in heads)
        terminal_defs = len(heads) - rules
        bounds = [float(m.group(2) or m.group(1)) for m in _LARK_RANGE.finditer(body)]
        optional = body.count("[")
        directives = len(re.findall(r"^\s*%\w+", body, re.MULTILINE))
    else:
        rules, terminal_defs = len(_GBNF_RULE.findall(body)), 0
        bounds = [_bound(m.group(3) or m.group(1)) for m in _BOUND.finditer(body) if m.group(1) or m.group(3)]
        optional = directives = 0
    return {
        "log_bytes": math.log1p(_bytes(text)),
        "log_lines": math.log1p(text.count("\n") + 1),
        "log_rules": math.log1p(rules),
        "log_terminal_defs": math.log1p(terminal_defs),
        "log_alternatives": math.log1p(body.count("|")),
        "log_literals": math.log1p(literals),
        "log_literal_chars": math.log1p(literal_chars),
        "log_terminal_regexes": math.log1p(regexes),
        "log_terminal_regex_chars": math.log1p(regex_chars),
        "log_quantifiers": math.log1p(sum(body.count(q) for q in "*+?") + optional),
        "log_repeat_bound": math.log1p(min(sum(bounds), _BIG)),
        "log_directives": math.log1p(directives),
        "lark": float(lark),
        "malformed": malformed,
    }
