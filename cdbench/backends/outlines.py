"""outlines-core behind :class:`~cdbench.backends.base.GrammarBackend` (regular languages only).

>>> from cdbench.backends import ConstraintSpec, create_backend
>>> backend = create_backend("outlines", "cl100k")
>>> matcher = backend.matcher(backend.compile(ConstraintSpec("regex", "[0-9]{3}")))
>>> matcher.jump_forward()
[]

JSON schemas, choices and tool-call tags become regexes; EBNF grammars are
not regular and raise ``CompileError(reason="unsupported")``. The vocabulary
map leaves out every special, added and unused id, so none can spell text.
EOS is handled here: ``Guide.advance`` refuses it even in a final state.

Known outlines-core 0.2.14 limitations, left as the engine has them. These
refuse valid text, so they show as false rejects in ``cdbench profile``:

- Leftmost-first matching: once a preferred branch of the regex has matched,
  the other branches that would go on are dropped. ``(1|10)`` refuses ``10``,
  a lazy ``.+?`` stops after one character, ``a|aT[0-9]`` refuses ``aT1``, and
  a loop may end early (``([a-z]+|[a-z]+:)*`` refuses ``ab:``). The same holds
  for the regexes outlines builds from a schema (``enum: [1, 10]``). Choices
  are built here, so they are ordered longest first, which avoids it.
- From a state where the regex may end, a one-byte token into a state where it
  may not is missing from the index: after ``1`` of ``1(a[0-9]+)?`` only EOS
  is allowed, not ``a``.
- An object schema with ``properties`` admits no other key, even with
  ``additionalProperties: true``; an array with ``prefixItems`` admits exactly
  those items.

These accept invalid text; each is reported in the compiled grammar's
``warnings`` (``IGNORED_KEYWORDS`` anywhere, ``IGNORED_WHEN`` where its
condition holds): a ``required`` key not listed in ``properties`` is ignored
(``{}`` is accepted); ``pattern`` is not checked when ``minLength`` or
``maxLength`` is given; ``minItems`` above the number of ``prefixItems`` is not
checked.

Compile time: the index is built from a DFA, which can be exponential in the
regex. ``(a|b)*a(a|b){n}`` (the character n+1 from the end is ``a``: 2^(n+1)
DFA states) compiled on cl100k in 16 s for n = 8 and 44 s for n = 10 on a
2-core machine, about 3x per two more, and took 222 s for n = 14 in an audit
run; nothing here interrupts it. Compile untrusted or corpus regexes where a
timeout can stop them: ``cdbench profile`` compiles in worker processes and
kills a compile after ``--compile-timeout`` seconds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from outlines_core import Guide, Index
from outlines_core import Vocabulary as OutlinesVocabulary
from outlines_core.json_schema import build_regex_from_schema

from cdbench.backends import specs
from cdbench.backends.base import (
    CompiledGrammar,
    CompileError,
    ConstraintSpec,
    GrammarBackend,
    MaskChecks,
    Matcher,
    check_rollback,
    row_error,
)
from cdbench.backends.vocab import Vocabulary

# JSON Schema keywords outlines-core 0.2.14 turns into a regex that does not
# check them (each verified with an instance that violates it and is accepted).
IGNORED_KEYWORDS = frozenset({"not", "if", "then", "else", "oneOf", "uniqueItems", "contains", "minContains",
                              "maxContains", "dependentRequired", "dependentSchemas", "dependencies", "propertyNames",
                              "multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                              "minProperties", "maxProperties"})


def _more_items_than_prefix(node: Mapping[str, Any]) -> bool:
    prefix, least = node.get("prefixItems"), node["minItems"]
    return isinstance(prefix, list) and isinstance(least, int) and least > len(prefix)


# Keywords outlines-core 0.2.14 drops only in some schemas (each verified the same way).
IGNORED_WHEN = (
    specs.REQUIRED_UNLISTED,
    specs.IgnoredWhen("pattern", lambda node: "minLength" in node or "maxLength" in node,
                      "beside 'minLength'/'maxLength'"),
    specs.IgnoredWhen("minItems", _more_items_than_prefix, "more than the 'prefixItems'"),
)

# Placeholder whitespace pattern: outlines puts its whitespace regex around
# every ':', next to every ',' and inside brackets; the compact language keeps
# one space after each separator and nothing elsewhere.
_WS_MARK = "\ue000"


def _compact(regex: str) -> str:
    """``regex`` (built with ``_WS_MARK`` as whitespace) in the compact convention.

    A ',' may carry the mark on one side only: an optional property ends with
    its comma, ``(M"a"M:MvalueM,)?M"b"``, and an array item starts with one,
    ``(,M item)``. Every mark next to a ',' makes it the item separator.
    """
    for old, new in ((f"{_WS_MARK}:{_WS_MARK}", specs.KEY_SEPARATOR), (f"{_WS_MARK},{_WS_MARK}", specs.ITEM_SEPARATOR),
                     (f"{_WS_MARK},", specs.ITEM_SEPARATOR), (f",{_WS_MARK}", specs.ITEM_SEPARATOR), (_WS_MARK, "")):
        regex = regex.replace(old, new)
    return regex


def _choice_regex(options: list[str]) -> str:
    # Longest first: outlines-core matches leftmost-first, so in (Inf|Infinity)
    # the match of Inf would drop Infinity. A longer option is never a prefix
    # of a shorter one, so no option can cut another off.
    return specs.choice_regex(sorted(options, key=len, reverse=True))


def _without_outer_anchors(regex: str) -> str:
    """``regex`` less a leading ``^`` and a trailing unescaped ``$``.

    A regex constraint matches the whole output, so these change nothing (as
    in xgrammar and llguidance); outlines-core refuses anchored patterns, which
    most JSON Schema patterns are. Anchors elsewhere stay and are refused.
    """
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$"):
        body = regex[:-1]
        if (len(body) - len(body.rstrip("\\"))) % 2 == 0:  # an odd run of backslashes escapes the $
            regex = body
    return regex


class OutlinesMatcher(Matcher):
    """One request's state: an outlines-core ``Guide`` plus the tokens it accepted.

    The token list lets :meth:`copy` replay the state into a new ``Guide`` and
    lets EOS, which the ``Guide`` does not take, be accepted and rolled back.
    """

    __slots__ = ("_guide", "_write", "_advance", "_index", "_checks", "_mask", "_base", "_rows", "_eos",
                 "_max_rollback", "_row_bytes", "_tokens", "_terminated")

    def __init__(self, index: Index, checks: MaskChecks, eos: int, max_rollback: int, row_bytes: int) -> None:
        self._index = index
        self._checks = checks
        self._mask, self._base, self._rows = checks.last  # the mask this matcher fills, its pointer and rows
        self._eos = eos
        self._max_rollback = max_rollback
        self._row_bytes = row_bytes
        self._guide = Guide(index, max_rollback=max_rollback)
        self._write = self._guide.write_mask_into  # bound once: called per token
        self._advance = self._guide.advance
        self._tokens: list[int] = []
        self._terminated = False

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        # outlines-core writes through a raw pointer: the mask was checked when
        # the backend first saw it (the matcher keeps that check), the row is checked here.
        if mask is not self._mask:
            self._mask, self._base, self._rows = self._checks.check(mask)
        if 0 <= row < self._rows:
            self._write(self._base + row * self._row_bytes, self._row_bytes >> 2, 4)
        else:
            raise row_error("outlines", row, self._rows)

    def accept(self, token: int) -> bool:
        if token == self._eos or self._terminated:
            return self._accept_eos(token)
        try:
            self._advance(token, return_tokens=False)
        except (ValueError, OverflowError):  # "No next state found", or a negative id: rejected
            return False
        self._tokens.append(token)
        return True

    def _accept_eos(self, token: int) -> bool:
        if self._terminated or not self._guide.is_finished():
            return False
        self._terminated = True
        self._tokens.append(token)
        return True

    @property
    def history_length(self) -> int:
        return len(self._tokens)

    def rollback(self, k: int) -> None:
        check_rollback(k, len(self._tokens))
        if k == 0:
            return
        in_guide = k - self._terminated  # EOS never went into the Guide
        if in_guide:
            try:
                self._guide.rollback_state(in_guide)  # first: it raises, changing nothing, past max_rollback
            except ValueError as exc:
                raise ValueError(f"cannot roll back {k} tokens: {exc}") from None
        del self._tokens[-k:]
        self._terminated = False

    def jump_forward(self) -> list[int]:
        if self._terminated:
            return []
        tokens = []
        state = self._guide.get_state()
        while True:
            allowed = self._index.get_allowed_tokens(state)
            if allowed is None or len(allowed) != 1 or allowed[0] == self._eos:
                return tokens
            tokens.append(allowed[0])
            state = self._index.get_next_state(state, allowed[0])

    def is_terminated(self) -> bool:
        return self._terminated

    def copy(self) -> OutlinesMatcher:
        twin = OutlinesMatcher(self._index, self._checks, self._eos, self._max_rollback, self._row_bytes)
        for token in self._tokens:
            twin.accept(token)
        return twin


class OutlinesBackend(GrammarBackend):
    """outlines-core bound to one vocabulary.

    Parameters
    ----------
    vocab : the vocabulary.
    whitespace : ``"compact"`` (default: no optional whitespace, separators
        ``", "`` and ``": "``) or ``"flexible"`` (outlines' own optional ``[ ]?``).
    max_rollback : how many tokens a matcher can roll back.
    """

    name = "outlines"

    def __init__(self, vocab: Vocabulary, *, whitespace: str = "compact", max_rollback: int = 64) -> None:
        super().__init__(vocab)
        self.whitespace = specs.check_whitespace(whitespace)
        self.max_rollback = max_rollback
        self.eos_token_id = vocab.eos_token_ids[0]
        self._checks = MaskChecks(self.mask_format, vocab.size, self.name)
        forbidden = vocab.forbidden_token_ids
        by_bytes: dict[bytes, list[int]] = {}
        for tid, raw in enumerate(vocab.token_bytes):
            if tid not in forbidden:
                by_bytes.setdefault(raw, []).append(tid)
        self.outlines_vocabulary = OutlinesVocabulary(self.eos_token_id, by_bytes)

    def options_key(self) -> str:
        return f"{super().options_key()}:whitespace={self.whitespace}:max_rollback={self.max_rollback}"

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        warnings: tuple[str, ...] = ()
        try:
            if spec.kind == "ebnf":
                raise CompileError(self.name, spec.kind, "unsupported",
                                   "outlines-core compiles regular languages only, not grammars")
            if spec.kind == "json_schema":
                schema = specs.load_schema(spec, self.name)
                regex = self._schema_regex(schema)
                warnings = specs.unenforced_warnings(self.name, schema, IGNORED_KEYWORDS, IGNORED_WHEN)
            elif spec.kind == "regex":
                regex = _without_outer_anchors(specs.load_text(spec, self.name))
            elif spec.kind == "choice":
                regex = _choice_regex(specs.load_choices(spec, self.name))
            else:
                tags = specs.load_tool_call_tags(spec, self.name)
                regex = "(" + "|".join(
                    specs.regex_literal(t.begin) + "(" + self._schema_regex(t.schema) + ")" + specs.regex_literal(t.end)
                    for t in tags) + ")"
                for tag in tags:
                    warnings += specs.unenforced_warnings(self.name, tag.schema, IGNORED_KEYWORDS, IGNORED_WHEN)
            index = Index(regex, self.outlines_vocabulary)
        except CompileError:
            raise
        except Exception as exc:  # outlines-core raises ValueError and TypeError
            raise specs.failure(self.name, spec, str(exc)) from None
        return CompiledGrammar(self.name, spec, index, warnings)

    def matcher(self, grammar: CompiledGrammar) -> OutlinesMatcher:
        return OutlinesMatcher(grammar.handle, self._checks, self.eos_token_id, self.max_rollback,
                               (self.vocab.size + 31) // 32 * 4)

    def _schema_regex(self, schema: dict) -> str:
        if self.whitespace == "flexible":
            return build_regex_from_schema(json.dumps(schema))
        return _compact(build_regex_from_schema(json.dumps(schema), whitespace_pattern=_WS_MARK))
