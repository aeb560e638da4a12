"""EBNF grammars (GBNF and Lark): parsing, seeded instances, and acceptance checks.

GBNF text (llama.cpp's ``rule ::= ...`` syntax) is parsed here into a small
expression tree (:func:`parse_gbnf`), then translated into an equivalent Lark
grammar. Lark text is loaded by Lark's own grammar loader, which resolves
``%import common.X`` against Lark's bundled grammars. Either way one
:class:`EbnfGrammar` results: a seeded walk over its rules produces instances
(:meth:`EbnfGrammar.instance`) and Lark's Earley parser checks that the grammar
accepts a text (:meth:`EbnfGrammar.rejection`).

>>> import numpy as np
>>> g = EbnfGrammar.from_text('root ::= "a" [0-9]+ ("!" | "?")', "gbnf", "root")
>>> text = g.instance(np.random.default_rng(0))
>>> g.rejection(text) is None
True
>>> g.rejection('b')[:22]
'grammar rejects the te'
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import lark
import numpy as np

from cdbench.backends.base import ConstraintSpec
from cdbench.workloads.regex_instances import RegexInstanceError, regex_instance

# Walk limits: past either, the walk takes the cheapest expansion everywhere.
MAX_DEPTH = 40
MAX_TERMINALS = 80


class GrammarError(ValueError):
    """Grammar text that does not parse, or a grammar no instance can be drawn from."""


# ---------------------------------------------------------------- GBNF tree
@dataclass(frozen=True)
class Literal:
    text: str


@dataclass(frozen=True)
class CharClass:
    """``[...]``: ``ranges`` of (low, high) code points, inclusive."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False


@dataclass(frozen=True)
class AnyChar:
    pass


@dataclass(frozen=True)
class RuleRef:
    name: str


@dataclass(frozen=True)
class Sequence:
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class Alternatives:
    options: tuple[Expr, ...]


@dataclass(frozen=True)
class Repeat:
    """``item{low,high}``; ``high`` ``None`` is unbounded (``*``, ``+``, ``{m,}``)."""

    item: Expr
    low: int
    high: int | None


Expr = Literal | CharClass | AnyChar | RuleRef | Sequence | Alternatives | Repeat

_GBNF_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r\n]+|\#[^\n]*)
  | (?P<define>::=)
  | (?P<name>[A-Za-z0-9_-]+)
  | (?P<string>"(?:\\.|[^"\\])*")
  | (?P<cls>\[(?:\\.|[^\]\\])*\])
  | (?P<brace>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[()|*+?.])
    """,
    re.VERBOSE | re.DOTALL,
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "/": "/", "^": "^"}


def _unescape(body: str) -> list[str]:
    """Characters of a GBNF string/class body, one entry per character (escapes decoded)."""
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(body):
            raise GrammarError("dangling backslash")
        e = body[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width:
            digits = body[i + 2 : i + 2 + width]
            if len(digits) != width or not re.fullmatch(r"[0-9a-fA-F]+", digits):
                raise GrammarError(f"bad escape \\{e}{digits}")
            out.append(chr(int(digits, 16)))
            i += 2 + width
        elif e in _ESCAPES:
            out.append(_ESCAPES[e])
            i += 2
        else:
            raise GrammarError(f"unknown escape \\{e}")
    return out


def _parse_class(text: str) -> CharClass:
    body = text[1:-1]
    negated = body.startswith("^")
    if negated:
        body = body[1:]
    # A literal '-' at either end or escaped is a member; between two chars it is a range.
    raw: list[tuple[str, bool]] = []  # (char, was_escaped)
    i = 0
    while i < len(body):
        if body[i] == "\\":
            j = i + 2 + {"x": 2, "u": 4, "U": 8}.get(body[i + 1 : i + 2], 0)
            raw.append((_unescape(body[i:j])[0], True))
            i = j
        else:
            raw.append((body[i], False))
            i += 1
    ranges: list[tuple[int, int]] = []
    k = 0
    while k < len(raw):
        c, _ = raw[k]
        if k + 2 < len(raw) and raw[k + 1] == ("-", False):
            lo, hi = ord(c), ord(raw[k + 2][0])
            if hi < lo:
                raise GrammarError(f"empty range {c!r}-{raw[k + 2][0]!r}")
            ranges.append((lo, hi))
            k += 3
        else:
            ranges.append((ord(c), ord(c)))
            k += 1
    return CharClass(tuple(ranges), negated)


def parse_gbnf(text: str) -> dict[str, Expr]:
    """Rules of a GBNF grammar, by name, in source order.

    >>> parse_gbnf('root ::= "a" b*\\nb ::= [xy]')["b"]
    CharClass(ranges=((120, 120), (121, 121)), negated=False)
    """
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _GBNF_TOKEN.match(text, pos)
        if m is None:
            line = text.count("\n", 0, pos) + 1
            raise GrammarError(f"unexpected character {text[pos]!r} on line {line}")
        if m.lastgroup != "ws":
            tokens.append((m.lastgroup, m.group()))
        pos = m.end()
    rules: dict[str, Expr] = {}
    i = 0

    def rule_start(k: int) -> bool:
        return k + 1 < len(tokens) and tokens[k][0] == "name" and tokens[k + 1][0] == "define"

    def parse_alternatives(k: int) -> tuple[Expr, int]:
        options = []
        seq, k = parse_sequence(k)
        options.append(seq)
        while k < len(tokens) and tokens[k] == ("op", "|"):
            seq, k = parse_sequence(k + 1)
            options.append(seq)
        return (options[0] if len(options) == 1 else Alternatives(tuple(options))), k

    def parse_sequence(k: int) -> tuple[Expr, int]:
        items: list[Expr] = []
        while k < len(tokens) and not rule_start(k) and tokens[k] not in (("op", "|"), ("op", ")")):
            kind, value = tokens[k]
            if kind == "name":
                item: Expr = RuleRef(value)
                k += 1
            elif kind == "string":
                item = Literal("".join(_unescape(value[1:-1])))
                k += 1
            elif kind == "cls":
                item = _parse_class(value)
                k += 1
            elif (kind, value) == ("op", "."):
                item = AnyChar()
                k += 1
            elif (kind, value) == ("op", "("):
                item, k = parse_alternatives(k + 1)
                if k >= len(tokens) or tokens[k] != ("op", ")"):
                    raise GrammarError("unclosed '('")
                k += 1
            else:
                raise GrammarError(f"unexpected {value!r}")
            while k < len(tokens) and (tokens[k][0] == "brace" or tokens[k] in (("op", "*"), ("op", "+"), ("op", "?"))):
                op = tokens[k][1]
                if op == "*":
                    item = Repeat(item, 0, None)
                elif op == "+":
                    item = Repeat(item, 1, None)
                elif op == "?":
                    item = Repeat(item, 0, 1)
                else:
                    parts = [p.strip() for p in op[1:-1].split(",")]
                    low = int(parts[0])
                    high = low if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
                    if high is not None and high < low:
                        raise GrammarError(f"bad repetition {op}")
                    item = Repeat(item, low, high)
                k += 1
            items.append(item)
        return (items[0] if len(items) == 1 else Sequence(tuple(items))), k

    while i < len(tokens):
        if not rule_start(i):
            raise GrammarError(f"expected 'name ::=' but found {tokens[i][1]!r}")
        name = tokens[i][1]
        body, i = parse_alternatives(i + 2)
        if i < len(tokens) and not rule_start(i):
            raise GrammarError(f"unexpected {tokens[i][1]!r} in rule {name!r}")
        # A repeated definition adds alternatives, as llama.cpp does.
        rules[name] = Alternatives((rules[name], body)) if name in rules else body
    for name, body in rules.items():
        for ref in _refs(body):
            if ref not in rules:
                raise GrammarError(f"rule {name!r} refers to undefined rule {ref!r}")
    return rules


def _refs(expr: Expr):
    if isinstance(expr, RuleRef):
        yield expr.name
    elif isinstance(expr, (Sequence, Alternatives)):
        for sub in expr.items if isinstance(expr, Sequence) else expr.options:
            yield from _refs(sub)
    elif isinstance(expr, Repeat):
        yield from _refs(expr.item)


def _gbnf_char(c: str) -> str:
    if c in '"\\[]-^' or not c.isprintable() or c.isspace():
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else (f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")
    return c


def to_gbnf(rules: dict[str, Expr]) -> str:
    """GBNF text for ``rules``; ``parse_gbnf(to_gbnf(r)) == r``."""

    def show(e: Expr) -> str:
        if isinstance(e, Literal):
            return '"' + "".join(_gbnf_char(c) for c in e.text) + '"'
        if isinstance(e, CharClass):
            body = "".join(_gbnf_char(chr(lo)) + ("" if lo == hi else "-" + _gbnf_char(chr(hi))) for lo, hi in e.ranges)
            return "[" + ("^" if e.negated else "") + body + "]"
        if isinstance(e, AnyChar):
            return "."
        if isinstance(e, RuleRef):
            return e.name
        if isinstance(e, Sequence):
            return "(" + " ".join(show(i) for i in e.items) + ")"
        if isinstance(e, Alternatives):
            return "(" + " | ".join(show(o) for o in e.options) + ")"
        high = "" if e.high is None else str(e.high)
        return f"({show(e.item)}){{{e.low},{high}}}"

    return "\n".join(f"{name} ::= {show(body)}" for name, body in rules.items()) + "\n"


def _lark_regex_char(c: str) -> str:
    # Lark decodes \xNN inside /.../ before compiling, so punctuation is escaped
    # with a backslash (a decoded "(" would open a group) and only blanks use \xNN.
    if c.isalnum() or (not c.isascii() and c.isprintable()):
        return c
    if c.isascii() and c.isprintable() and not c.isspace():
        return "\\" + c
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else (f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")


def gbnf_to_lark(rules: dict[str, Expr], start: str) -> str:
    """An equivalent Lark grammar (character-level terminals) with start rule ``start``."""
    names = {name: f"r{i}_{re.sub(r'[^a-z0-9_]', '_', name.lower())}" for i, name in enumerate(rules)}

    def show(e: Expr) -> str:
        if isinstance(e, Literal):
            return "/" + "".join(_lark_regex_char(c) for c in e.text) + "/" if e.text else "empty__"
        if isinstance(e, CharClass):
            body = "".join(
                _lark_regex_char(chr(lo)) + ("" if lo == hi else "-" + _lark_regex_char(chr(hi))) for lo, hi in e.ranges
            )
            return "/[" + ("^" if e.negated else "") + body + "]/"
        if isinstance(e, AnyChar):
            return r"/[\s\S]/"
        if isinstance(e, RuleRef):
            return names[e.name]
        if isinstance(e, Sequence):
            return "(" + " ".join(show(i) for i in e.items) + ")" if e.items else "empty__"
        if isinstance(e, Alternatives):
            return "(" + " | ".join(show(o) for o in e.options) + ")"
        inner = show(e.item)
        if (e.low, e.high) == (0, None):
            return f"({inner})*"
        if (e.low, e.high) == (1, None):
            return f"({inner})+"
        if (e.low, e.high) == (0, 1):
            return f"({inner})?"
        if e.high is None:
            return f"({inner})~{e.low} ({inner})*"
        if e.high == 0:
            return "empty__"
        return f"({inner})~{e.low}..{e.high}" if e.low != e.high else f"({inner})~{e.low}"

    if start not in rules:
        raise GrammarError(f"start rule {start!r} is not defined")
    lines = [f"start__: {names[start]}", "empty__:"]
    lines += [f"{names[name]}: {show(body)}" for name, body in rules.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- grammar
class EbnfGrammar:
    """A loaded grammar: seeded instances and an Earley acceptance check."""

    def __init__(self, parser: lark.Lark, start: str) -> None:
        self.parser = parser
        self.start = start
        self.rules: dict[str, list[list]] = {}
        for rule in parser.rules:
            self.rules.setdefault(rule.origin.name, []).append(list(rule.expansion))
        self.terminals = {t.name: t for t in parser.terminals}
        self.space_separates = any(
            name in self.terminals and re.fullmatch(self.terminals[name].pattern.to_regexp(), " ")
            for name in parser.ignore_tokens
        )
        self.cost = self._min_costs()
        if start not in self.rules:
            raise GrammarError(f"start rule {start!r} has no expansion")
        if self.cost[start] == float("inf"):
            raise GrammarError(f"start rule {start!r} derives no finite text")

    @classmethod
    def from_text(cls, text: str, dialect: str, start: str | None) -> EbnfGrammar:
        """Load grammar ``text`` of ``dialect`` (``gbnf`` or ``lark``)."""
        if dialect == "gbnf":
            lark_text = gbnf_to_lark(parse_gbnf(text), start or "root")
            lark_start = "start__"
        elif dialect == "lark":
            lark_text, lark_start = text, start or "start"
        else:
            raise GrammarError(f"unknown EBNF dialect {dialect!r} (known: gbnf, lark)")
        try:
            parser = lark.Lark(lark_text, start=lark_start, parser="earley", lexer="dynamic", keep_all_tokens=True)
        except Exception as exc:  # noqa: BLE001 - Lark raises many types for bad grammars
            raise GrammarError(f"the grammar does not load: {str(exc).strip().splitlines()[0][:200]}") from exc
        return cls(parser, lark_start)

    def _min_costs(self) -> dict[str, float]:
        """Fewest terminals each nonterminal derives (a fixpoint), to steer walks to an end."""
        cost = {name: float("inf") for name in self.rules}
        changed = True
        while changed:
            changed = False
            for name, expansions in self.rules.items():
                best = min(self._expansion_cost(e, cost) for e in expansions)
                if best < cost[name]:
                    cost[name], changed = best, True
        return cost

    def _expansion_cost(self, expansion: list, cost: dict[str, float]) -> float:
        return sum(1 if s.is_term else cost.get(s.name, float("inf")) for s in expansion)

    def instance(self, rng: np.random.Generator) -> str:
        """One text the grammar derives, drawn by a seeded walk (validate with :meth:`check`)."""
        pieces: list[str] = []
        self._walk(self.start, rng, 0, pieces)
        return "".join(pieces)

    def _walk(self, name: str, rng: np.random.Generator, depth: int, pieces: list[str]) -> None:
        expansions = self.rules[name]
        finite = [e for e in expansions if self._expansion_cost(e, self.cost) < float("inf")]
        if depth > MAX_DEPTH or len(pieces) > MAX_TERMINALS:
            expansion = min(finite, key=lambda e: self._expansion_cost(e, self.cost))
        else:
            expansion = finite[int(rng.integers(len(finite)))]
        for symbol in expansion:
            if symbol.is_term:
                pieces.append(self._terminal_text(symbol.name, rng, bool(pieces)))
            else:
                self._walk(symbol.name, rng, depth + 1, pieces)

    def _terminal_text(self, name: str, rng: np.random.Generator, separated: bool) -> str:
        term = self.terminals.get(name)
        if term is None:
            raise GrammarError(f"terminal {name} is declared without a pattern (needs a post-lexer)")
        pattern = term.pattern
        if pattern.type == "str":
            text = pattern.value
        else:
            flags = re.IGNORECASE if "i" in pattern.flags else 0
            try:
                text = regex_instance(pattern.to_regexp(), rng, flags=flags)
            except RegexInstanceError as exc:
                raise GrammarError(f"terminal {name}: {exc}") from exc
        # Where whitespace is ignored, a space keeps adjacent tokens apart.
        return (" " + text) if separated and self.space_separates else text

    def rejection(self, text: str) -> str | None:
        """Why the grammar rejects ``text``, or ``None`` when it accepts it."""
        try:
            self.parser.parse(text)
        except lark.exceptions.LarkError as exc:
            return f"grammar rejects the text: {str(exc).strip().splitlines()[0][:160]}"
        return None


@functools.lru_cache(maxsize=256)
def _grammar(text: str, dialect: str, start: str | None) -> EbnfGrammar:
    return EbnfGrammar.from_text(text, dialect, start)


def grammar_for(spec: ConstraintSpec) -> EbnfGrammar:
    """The loaded grammar of an ``ebnf`` spec (cached); raises :class:`GrammarError`."""
    options = dict(spec.options)
    return _grammar(spec.spec, options.get("dialect", "gbnf"), options.get("start"))
