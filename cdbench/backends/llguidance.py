"""llguidance behind :class:`~cdbench.backends.base.GrammarBackend`.

>>> from cdbench.backends import ConstraintSpec, create_backend
>>> backend = create_backend("llguidance", "cl100k")
>>> matcher = backend.matcher(backend.compile(ConstraintSpec("choice", ["yes", "no"])))
>>> matcher.accept(backend.vocab.encode("yes")[0])
True

The tokenizer is built from the vocabulary's own byte table with every
special, added and unused id marked special, so none of them can spell grammar
text. (Built from DeepSeek's ``tokenizer.json``, llguidance would treat four
added tokens such as ``<dsml:`` as text.)
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import llguidance as llg
import torch

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


class _ByteTableTokenizer:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, special ids, eos, an encoder."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.eos_token_id = vocab.eos_token_ids[0]
        self.bos_token_id = None
        self.tokens = list(vocab.token_bytes)
        self.special_token_ids = sorted(vocab.forbidden_token_ids)
        self._encode = vocab.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


class LLGuidanceMatcher(Matcher):
    """One request's state: a thin wrapper over ``llguidance.LLMatcher``.

    llguidance stops by itself once nothing but EOS can follow, and a stopped
    matcher does not record EOS in its history. The matcher reports
    termination only after EOS is accepted, as the other engines do, and keeps
    track of whether llguidance counted that EOS, so rollback stays exact.

    llguidance turns a refused rollback or an id past its vocabulary into an
    error state it never leaves, so both are refused here before it sees them.
    """

    __slots__ = ("_matcher", "_fill", "_try_consume", "_checks", "_mask", "_base", "_rows", "_row_bytes", "_size",
                 "_eos", "_accepted", "_terminated", "_eos_uncounted")

    def __init__(self, matcher: llg.LLMatcher, checks: MaskChecks, row_bytes: int, size: int,
                 eos: frozenset[int]) -> None:
        self._matcher = matcher
        self._checks = checks
        # Bound once: fill_mask and accept run per token, and an attribute lookup there is measurable.
        self._fill = matcher.unsafe_compute_mask_ptr
        self._try_consume = matcher.try_consume_tokens
        self._mask, self._base, self._rows = checks.last  # the mask this matcher fills, its pointer and rows
        self._row_bytes = row_bytes
        self._size = size
        self._eos = eos
        self._accepted = 0  # tokens rollback can undo, an uncounted EOS included
        self._terminated = False
        self._eos_uncounted = False

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        # llguidance writes through a raw pointer: the mask was checked when the
        # backend first saw it (the matcher keeps that check), the row is checked here.
        if mask is not self._mask:
            self._mask, self._base, self._rows = self._checks.check(mask)
        if 0 <= row < self._rows:
            self._fill(self._base + row * self._row_bytes, self._row_bytes)
        else:
            raise row_error("llguidance", row, self._rows)

    def accept(self, token: int) -> bool:
        # try_consume_tokens leaves the state unchanged on rejection;
        # consume_token would put the matcher into its error state for good,
        # and so would an id past the vocabulary, hence the range test first.
        if 0 <= token < self._size and self._try_consume([token]):
            self._accepted += 1
            if token in self._eos:
                self._terminated = True
            return True
        if token in self._eos and not self._terminated and self._matcher.is_stopped():
            self._terminated = self._eos_uncounted = True
            self._accepted += 1
            return True
        return False

    @property
    def history_length(self) -> int:
        return self._accepted

    def rollback(self, k: int) -> None:
        check_rollback(k, self._accepted)
        if k == 0:
            return
        counted = k - self._eos_uncounted  # an EOS llguidance did not record is not rolled back there
        if counted and not self._matcher.rollback(counted):
            raise ValueError(f"cannot roll back {k} tokens: {self._matcher.get_error()}")
        self._terminated = self._eos_uncounted = False
        self._accepted -= k

    def jump_forward(self) -> list[int]:
        return self._matcher.compute_ff_tokens()

    def is_terminated(self) -> bool:
        return self._terminated

    def copy(self) -> LLGuidanceMatcher:
        twin = LLGuidanceMatcher(self._matcher.deep_copy(), self._checks, self._row_bytes, self._size, self._eos)
        twin._accepted, twin._terminated, twin._eos_uncounted = self._accepted, self._terminated, self._eos_uncounted
        return twin


class LLGuidanceBackend(GrammarBackend):
    """llguidance bound to one vocabulary.

    Parameters
    ----------
    vocab : the vocabulary.
    whitespace : ``"compact"`` (default: no optional whitespace, separators
        ``", "`` and ``": "``) or ``"flexible"`` (llguidance's ``whitespace_flexible``).

    Compiling builds and validates an ``LLMatcher``; each new matcher is a deep
    copy of it, which is far cheaper than building another.
    """

    name = "llguidance"

    def __init__(self, vocab: Vocabulary, *, whitespace: str = "compact") -> None:
        super().__init__(vocab)
        self.whitespace = specs.check_whitespace(whitespace)
        self.tokenizer = llg.LLTokenizer(
            llg.TokenizerWrapper(_ByteTableTokenizer(vocab)),
            n_vocab=vocab.size,
            eos_token=list(vocab.eos_token_ids),
        )
        self._row_bytes = (vocab.size + 31) // 32 * 4
        self._checks = MaskChecks(self.mask_format, vocab.size, self.name)
        self._eos = frozenset(vocab.eos_token_ids)
        # One LLMatcher must not be used by two threads at once ("Already borrowed").
        self._template_lock = threading.Lock()

    def options_key(self) -> str:
        return f"{super().options_key()}:whitespace={self.whitespace}"

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        try:
            grammar = self._grammar(spec)
        except CompileError:
            raise
        except Exception as exc:  # grammar_from* raise ValueError for text they cannot convert
            raise specs.failure(self.name, spec, str(exc)) from None
        template = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise specs.failure(self.name, spec, template.get_error())
        return CompiledGrammar(self.name, spec, template, tuple(template.get_grammar_warnings()))

    def matcher(self, grammar: CompiledGrammar) -> LLGuidanceMatcher:
        with self._template_lock:
            return LLGuidanceMatcher(grammar.handle.deep_copy(), self._checks, self._row_bytes, self.vocab.size,
                                     self._eos)

    def _grammar(self, spec: ConstraintSpec) -> str:
        if spec.kind == "json_schema":
            schema = specs.load_schema(spec, self.name)
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=self._json_options())
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(specs.load_text(spec, self.name))
        if spec.kind == "choice":
            return llg.grammar_from("choice", json.dumps(specs.load_choices(spec, self.name)))
        if spec.kind == "ebnf":
            return llg.grammar_from(specs.ebnf_dialect(spec, self.name), specs.load_text(spec, self.name))
        return llg.LLMatcher.grammar_from_lark(self._tool_call_lark(specs.load_tool_call_tags(spec, self.name)))

    def _json_options(self) -> dict:
        if self.whitespace == "flexible":
            return {"whitespace_flexible": True}
        return {"whitespace_flexible": False,
                "item_separator": specs.ITEM_SEPARATOR, "key_separator": specs.KEY_SEPARATOR}

    def _tool_call_lark(self, tags: Sequence[specs.ToolCallTag]) -> str:
        """A Lark grammar: one of the tags, each ``begin %json end``."""
        rules = ["start: " + " | ".join(f"tag_{i}" for i in range(len(tags)))]
        for i, tag in enumerate(tags):
            parts = [_lark_string(tag.begin), f"json_{i}"] + ([_lark_string(tag.end)] if tag.end else [])
            rules.append(f"tag_{i}: " + " ".join(parts))
            # Whitespace options ride in the schema: %json has no other way to receive them.
            schema = {**tag.schema, "x-guidance": self._json_options()}
            rules.append(f"json_{i}: %json {json.dumps(schema)}")
        return "\n".join(rules) + "\n"


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
