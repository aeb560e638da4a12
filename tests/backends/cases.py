"""Conformance cases: specs with instances known to be valid or invalid.

Instances follow the compact whitespace convention (separators ``", "`` and
``": "``, no other optional whitespace), the language every engine produces by
default. Corpus cases come from ``$CDBENCH_SHARED/corpora`` when it exists.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import jsonschema
import lark
import numpy as np
import torch

from cdbench.backends import ConstraintSpec

ENGINES = ("xgrammar", "llguidance", "outlines")
VOCABS = ("deepseek-v4", "qwen3.6", "cl100k")


@dataclass(frozen=True)
class Case:
    """A spec and instances of its language.

    ``invalid`` pairs a valid prefix with a continuation whose first token the
    grammar must reject. ``comparable``: xgrammar, llguidance and outlines must
    allow the same tokens at every step (one fixed whitespace convention, and
    nothing where the engines legitimately differ). Where EOS may come is
    decided by :func:`is_complete`.
    """

    id: str
    spec: ConstraintSpec
    valid: tuple[str, ...]
    invalid: tuple[tuple[str, str], ...] = ()
    comparable: bool = False
    free_text: str | None = field(default=None)  # a valid prefix that ends inside free text

    @property
    def kind(self) -> str:
        return self.spec.kind


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}

# No free strings: the engines disagree on which characters a JSON string may
# hold raw (outlines forbids U+007F-U+009F, xgrammar allows them), so only
# string-free schemas compare mask for mask. additionalProperties is false
# because by default llguidance allows undeclared properties and the others do not.
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "status": {"enum": ["new", "paid", "shipped"]},
        "items": {"type": "array", "items": {"type": "integer"}},
        "gift": {"type": "boolean"},
    },
    "required": ["id", "status", "items", "gift"],
    "additionalProperties": False,
}

# Optional properties on both sides of the required one, and objects whose
# properties are all optional: outlines-core writes an optional property's ','
# inside its optional group, so compact whitespace must still space it.
SETTINGS_SCHEMA = {
    "type": "object",
    "properties": {
        "retries": {"type": "integer"},
        "port": {"type": "integer"},
        "debug": {"type": "boolean"},
        "limits": {"type": "array", "items": {
            "type": "object",
            "properties": {"cpu": {"type": "integer"}, "mem": {"type": "integer"}},
            "additionalProperties": False,
        }},
    },
    "required": ["port"],
    "additionalProperties": False,
}

TOOL_CALL = {
    "begin": "<tool_call>",
    "schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "end": "</tool_call>",
}

ARITH_GBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""

ARITH_LARK = """start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""

EMBEDDED: tuple[Case, ...] = (
    Case("person", ConstraintSpec("json_schema", PERSON_SCHEMA),
         valid=('{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "active": true}',
                '{"name": "", "age": -7, "tags": [], "active": false}'),
         invalid=(('{"name": "Ada", "age": ', '"thirty"'), ('{"name": "Ada", "', 'nickname"')),
         free_text='{"name": "Ada Love'),
    Case("order", ConstraintSpec("json_schema", ORDER_SCHEMA),
         valid=('{"id": 42, "status": "paid", "items": [3, 14, 159], "gift": false}',
                '{"id": 0, "status": "shipped", "items": [], "gift": true}'),
         invalid=(('{"id": 42, "status": "', 'lost"'), ('{"id": ', 'forty')),
         comparable=True),
    Case("phone", ConstraintSpec("regex", r"[0-9]{3}-[0-9]{4}"),
         valid=("555-1234", "000-0000"), invalid=(("555", "x"), ("555-12", "-")), comparable=True),
    Case("email", ConstraintSpec("regex", r"[a-z0-9._]{1,16}@[a-z0-9]{1,12}\.(com|org|net)"),
         valid=("ada.l@example.com", "x_1@b.net"), invalid=(("ada", " at"), ("ada@example.", "io")),
         comparable=True),
    Case("date", ConstraintSpec("regex", r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
         valid=("2024-02-29", "1999-12-31"), invalid=(("2024-", "9"),), comparable=True),
    Case("colors", ConstraintSpec("choice", ["red", "green", "blue", "light gray"]),
         valid=("red", "green", "light gray"), invalid=(("", "purple"), ("light", "blue")), comparable=True),
    Case("settings", ConstraintSpec("json_schema", SETTINGS_SCHEMA),
         valid=('{"retries": 3, "port": 80, "debug": true}',
                '{"port": 8080, "limits": [{"cpu": 2, "mem": 512}, {"mem": 64}, {}]}', '{"port": 0}'),
         invalid=(('{"retries": 3', ',"port"'), ('{"port": 1, "limits": [{"cpu": 2', ',"mem"')),
         comparable=True),
    # Options that are prefixes of others (from choice/00bd2b712754acee). Not
    # comparable: outlines drops one-byte tokens out of the final state "inf".
    Case("infinity", ConstraintSpec("choice", ["inf", "infinity", "Inf", "Infinity"]),
         valid=("Infinity", "inf", "infinity", "Inf"), invalid=(("Infinity", "!"), ("", "INF"))),
    Case("arith", ConstraintSpec("ebnf", ARITH_GBNF, {"dialect": "gbnf"}),
         valid=("(1+2)*34-5", "7"), invalid=(("(1+", ")"), ("12", "x"))),
    Case("arith", ConstraintSpec("ebnf", ARITH_LARK, {"dialect": "lark"}),
         valid=("(1+2)*34-5", "7"), invalid=(("(1+", ")"), ("12", "x"))),
    Case("tool-call", ConstraintSpec("structural_tag", TOOL_CALL),
         valid=('<tool_call>{"city": "Paris", "days": 3}</tool_call>',),
         invalid=(("<tool_call>", "hello"), ('<tool_call>{"city": "Paris", "days": 3}', " </tool_call>")),
         free_text='<tool_call>{"city": "Par'),
)


def case_id(case: Case) -> str:
    dialect = case.spec.options.get("dialect")
    return f"{case.kind}-{dialect + '-' if dialect else ''}{case.id}"


# Malformed specs: (id, spec, the reason every engine that has the kind must give).
MALFORMED: tuple[tuple[str, ConstraintSpec, str], ...] = (
    ("json-broken-text", ConstraintSpec("json_schema", '{"type": "object",'), "invalid"),
    ("json-unknown-type", ConstraintSpec("json_schema", {"type": "foo"}), "invalid"),
    ("json-not-an-object", ConstraintSpec("json_schema", 42), "invalid"),
    ("regex-unclosed-class", ConstraintSpec("regex", "[a-z"), "invalid"),
    ("regex-unbalanced-paren", ConstraintSpec("regex", "(ab"), "invalid"),
    ("regex-lookahead", ConstraintSpec("regex", "a(?=b)"), "unsupported"),
    ("regex-not-text", ConstraintSpec("regex", 7), "invalid"),
    ("gbnf-undefined-rule", ConstraintSpec("ebnf", "root ::= foo", {"dialect": "gbnf"}), "invalid"),
    ("gbnf-unterminated-string", ConstraintSpec("ebnf", 'root ::= "a', {"dialect": "gbnf"}), "invalid"),
    ("lark-undefined-rule", ConstraintSpec("ebnf", "start: foo", {"dialect": "lark"}), "invalid"),
    ("ebnf-unknown-dialect", ConstraintSpec("ebnf", "root ::= \"a\"", {"dialect": "yacc"}), "invalid"),
    ("choice-empty", ConstraintSpec("choice", []), "invalid"),
    ("choice-not-strings", ConstraintSpec("choice", [1, 2]), "invalid"),
    ("tag-missing-end", ConstraintSpec("structural_tag", {"begin": "<a>", "schema": {}}), "invalid"),
    ("tag-bad-schema", ConstraintSpec("structural_tag", {"begin": "<a>", "schema": {"type": "foo"}, "end": "</a>"}),
     "invalid"),
)


def shared_dir() -> Path:
    """``$CDBENCH_SHARED``, else ``shared`` next to the repository."""
    default = Path(__file__).resolve().parents[2].parent / "shared"
    return Path(os.environ.get("CDBENCH_SHARED", default))


def _corpus(name: str) -> dict[str, dict]:
    path = shared_dir() / "corpora" / name
    if not path.exists():
        return {}
    items = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return {item["id"]: item for item in items}


# Corpus regexes (anchored JSON Schema patterns) with instances written for them.
_CORPUS_REGEXES = {
    "regex/003be4bdfe1179ca": ("0123456789abcdef0123456789ABCDEF01234567",),
    "regex/05187f96c6e3fe35": ("12.50", "0.99"),
    "regex/0a69c18ca5f6cdf2": ("12A", "7B"),
    "regex/0df5bff1ddb9ae83": ("openid", "mbox"),
}
# Corpus JSON schemas with instances written for them (xgrammar and llguidance
# emit properties in declaration order).
_CORPUS_SCHEMAS = {
    "jsb/Github_trivial/o27832": ('{"en": "hello", "ru": "privet"}',),
    "jsb/Github_trivial/o81745": ('"STATIC"', '"PUBLIC"'),
    "jsb/Github_trivial/o69512": ('{"gender": "female"}',),
}
# Left out: llama.cpp's arithmetic.gbnf (its "ws ::= [ \t\n]*" before the
# final "\n" is one greedy lexeme for llguidance, which then never ends) and
# json.gbnf (xgrammar 0.2.8 rejects its empty alternative "ws ::= | ...").
_CORPUS_GRAMMARS = {
    "gbnf/llama.cpp/list": ("- apples\n- pears\n",),
}


@cache
def corpus_cases() -> tuple[Case, ...]:
    """A handful of corpus items per kind, or none when the corpus is absent."""
    cases: list[Case] = []
    regexes = _corpus("regex_from_json_schemas.jsonl")
    for item_id, valid in _CORPUS_REGEXES.items():
        if item_id in regexes:
            cases.append(Case(item_id, ConstraintSpec("regex", regexes[item_id]["spec"]), valid))
    schemas = {}
    for name in ("jsonschemabench_github_trivial.jsonl",):
        schemas.update(_corpus(name))
    for item_id, valid in _CORPUS_SCHEMAS.items():
        if item_id in schemas:
            cases.append(Case(item_id, ConstraintSpec("json_schema", schemas[item_id]["spec"]), valid))
    grammars = _corpus("gbnf_llama_cpp.jsonl")
    for item_id, valid in _CORPUS_GRAMMARS.items():
        if item_id in grammars:
            cases.append(Case(item_id, ConstraintSpec("ebnf", grammars[item_id]["spec"], {"dialect": "gbnf"}), valid))
    # Choices: the first lists whose options are short ASCII and none a prefix
    # of another; every option is a valid instance.
    picked = 0
    for item_id, item in sorted(_corpus("choice_from_json_schema_enums.jsonl").items()):
        options = item["spec"]
        if picked == 3:
            break
        if len(options) <= 6 and all(o.isascii() and 0 < len(o) <= 24 for o in options) and not any(
                a != b and b.startswith(a) for a in options for b in options):
            cases.append(Case(item_id, ConstraintSpec("choice", options), tuple(options), comparable=True))
            picked += 1
    return tuple(cases)


def allowed_ids(mask: torch.Tensor, row: int, vocab_size: int) -> np.ndarray:
    """Ids whose bit is set in ``mask[row]``."""
    bits = np.unpackbits(mask[row].numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def mask_bits(mask: torch.Tensor, row: int, vocab_size: int) -> np.ndarray:
    """``mask[row]`` as one bool per token id (bits past the vocabulary dropped)."""
    return np.unpackbits(mask[row].numpy().view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def is_allowed(mask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)


def is_complete(case: Case, text: str) -> bool | None:
    """Whether ``text`` is itself an instance of ``case``'s language, so EOS may follow it.

    Decided outside the engines: ``re.fullmatch`` for regexes, membership for
    choices, ``jsonschema`` for JSON (with the tags around it for a tool call),
    Lark's own parser for Lark grammars. ``None`` for GBNF, which nothing here parses.
    """
    spec = case.spec.spec
    if case.kind == "regex":
        return re.fullmatch(spec, text) is not None
    if case.kind == "choice":
        return text in spec
    if case.kind == "json_schema":
        return _is_json_instance(spec, text)
    if case.kind == "structural_tag":
        begin, end = spec["begin"], spec["end"]
        return (len(text) >= len(begin) + len(end) and text.startswith(begin) and text.endswith(end)
                and _is_json_instance(spec["schema"], text[len(begin):len(text) - len(end)]))
    if case.spec.options.get("dialect") == "lark":
        try:
            _lark_parser(spec).parse(text)
        except lark.exceptions.LarkError:
            return False
        return True
    return None


@cache
def _lark_parser(grammar: str) -> lark.Lark:
    return lark.Lark(grammar)


def _is_json_instance(schema: dict | str, text: str) -> bool:
    if isinstance(schema, str):
        schema = json.loads(schema)
    try:  # JSON only: no NaN/Infinity, no whitespace around the value (the compact convention)
        value = json.loads(text, parse_constant=_refuse)
    except ValueError:
        return False
    return text == text.strip() and jsonschema.validators.validator_for(schema)(schema).is_valid(value)


def _refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")
