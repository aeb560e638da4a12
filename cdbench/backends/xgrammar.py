"""xgrammar behind :class:`~cdbench.backends.base.GrammarBackend`.

>>> from cdbench.backends import ConstraintSpec, create_backend
>>> backend = create_backend("xgrammar", "cl100k")
>>> matcher = backend.matcher(backend.compile(ConstraintSpec("regex", "[0-9]{3}")))
>>> mask = backend.allocate_mask(1)
>>> matcher.fill_mask(mask, 0)

The tokenizer info is built from the vocabulary's own byte table with every
special, added and unused id blanked: ``TokenizerInfo.from_huggingface`` misses
DeepSeek's added tokens and would let them through inside strings.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import torch
import xgrammar as xgr

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
from cdbench.backends.engine_log import engine_log, logged_warning
from cdbench.backends.vocab import Vocabulary

_LOG_TIME = re.compile(r"^\[\d\d:\d\d:\d\d\] ")

# JSON Schema keywords xgrammar 0.2.8 compiles without enforcing them (each
# verified with an instance that violates it and is accepted). allOf is merged
# only partly; oneOf is compiled as anyOf.
IGNORED_KEYWORDS = frozenset({"not", "if", "then", "else", "uniqueItems", "allOf", "oneOf", "contains",
                              "dependentRequired", "dependentSchemas", "dependencies"})
# Keywords xgrammar 0.2.8 drops only in some schemas (each verified the same way):
# a $ref outside the document compiles to any JSON value, a string's length
# bounds are dropped beside a pattern (xgrammar logs as much), and a required
# key outside 'properties' may be left out (its strict mode, on by default as
# in the engines, also never lets that key be written).
IGNORED_WHEN = (
    specs.REQUIRED_UNLISTED,
    specs.IgnoredWhen("$ref", lambda node: isinstance(node["$ref"], str) and not node["$ref"].startswith("#"),
                      "not a '#' reference: compiled as any JSON value"),
    specs.IgnoredWhen("minLength", lambda node: "pattern" in node, "beside 'pattern'"),
    specs.IgnoredWhen("maxLength", lambda node: "pattern" in node, "beside 'pattern'"),
)


class XGrammarMatcher(Matcher):
    """One request's state: a thin wrapper over ``xgrammar.GrammarMatcher``.

    A terminated matcher has no next mask: ``fill_mask`` raises ``RuntimeError``.
    """

    __slots__ = ("_matcher", "_vocab", "_checks", "_mask", "_rows", "_fill", "_accept", "_accepted")

    def __init__(self, matcher: xgr.GrammarMatcher, vocab: Vocabulary, checks: MaskChecks) -> None:
        self._matcher = matcher
        self._vocab = vocab
        self._checks = checks
        self._mask, _, self._rows = checks.last  # the mask this matcher fills and its rows
        # GrammarMatcher's methods are one-line Python frames over its native
        # handle (xgrammar 0.2.8); bound here once, so this class's frame is
        # the only Python one per call, as it would be without cdbench.
        self._fill = matcher._handle.fill_next_token_bitmask
        self._accept = matcher._handle.accept_token
        self._accepted = 0  # xgrammar does not report its history length

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        # xgrammar checks dtype, width and row on every call but writes a
        # strided mask as if it were contiguous: that is checked once per
        # tensor (the matcher keeps the check). The row is checked here, as
        # xgrammar would wrap a row past int32 around to another one.
        if mask is not self._mask:
            self._mask, _, self._rows = self._checks.check(mask)
        if 0 <= row < self._rows:
            self._fill(mask, row, False)
        else:
            raise row_error("xgrammar", row, self._rows)

    def accept(self, token: int) -> bool:
        # An id outside the vocabulary is rejected by xgrammar itself (with a logged warning).
        if self._accept(token, False):
            self._accepted += 1
            return True
        return False

    @property
    def history_length(self) -> int:
        return self._accepted

    def rollback(self, k: int) -> None:
        check_rollback(k, self._accepted)
        try:
            self._matcher.rollback(k)
        except RuntimeError as exc:  # past what xgrammar keeps; it changes nothing then
            raise ValueError(f"cannot roll back {k} tokens: {specs.failure_message(exc)}") from None
        self._accepted -= k

    def jump_forward(self) -> list[int]:
        if self._matcher.is_terminated():  # xgrammar raises past the end; nothing is forced there
            return []
        forced = self._matcher.find_jump_forward_string()
        if not forced:
            return []
        # xgrammar gives text, not tokens; keep only the tokens a forked matcher
        # accepts, so a tokenization that disagrees with the grammar at a
        # boundary (or a character cut in half) is never returned.
        probe = self._matcher.fork()
        tokens = []
        for token in self._vocab.encode(forced):
            if not probe.accept_token(token):
                break
            tokens.append(token)
        return tokens

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def copy(self) -> XGrammarMatcher:
        twin = XGrammarMatcher(self._matcher.fork(), self._vocab, self._checks)
        twin._accepted = self._accepted
        return twin


class XGrammarBackend(GrammarBackend):
    """xgrammar bound to one vocabulary.

    Parameters
    ----------
    vocab : the vocabulary.
    whitespace : ``"compact"`` (default: no optional whitespace, separators
        ``", "`` and ``": "``, the language every engine here produces) or
        ``"flexible"`` (xgrammar's ``any_whitespace``).
    max_threads : threads of xgrammar's grammar compiler.
    compiler_cache : xgrammar's own compile cache; turn it off to time every
        compile cold (cdbench's compile cache sits above it either way).
    """

    name = "xgrammar"
    shares_compile_work = True  # its compiler caches the token masks of rules that grammars share

    def __init__(self, vocab: Vocabulary, *, whitespace: str = "compact", max_threads: int = 8,
                 compiler_cache: bool = True) -> None:
        super().__init__(vocab)
        self.whitespace = specs.check_whitespace(whitespace)
        self.max_threads = max_threads
        self.compiler_cache = compiler_cache
        forbidden = vocab.forbidden_token_ids
        encoded = [b"" if i in forbidden else raw for i, raw in enumerate(vocab.token_bytes)]
        self.tokenizer_info = xgr.TokenizerInfo(
            encoded, xgr.VocabType.RAW, vocab_size=vocab.size, stop_token_ids=list(vocab.eos_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                             cache_enabled=compiler_cache)
        self._checks = MaskChecks(self.mask_format, vocab.size, self.name)

    def options_key(self) -> str:
        return (f"{super().options_key()}:whitespace={self.whitespace}:max_threads={self.max_threads}"
                f":compiler_cache={self.compiler_cache}")

    def clear_engine_cache(self) -> None:
        # xgrammar's compiler also keeps what grammars share (the token masks of common JSON rules), so
        # with its cache on, a schema compiles several times faster after others than alone
        self._compiler.clear_cache()

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        with engine_log() as logged:
            grammar = self._compile(spec)
        if not logged:
            return grammar
        # xgrammar logs what it drops (e.g. a string's length bounds beside a pattern) on stderr: kept here,
        # without the wall-clock prefix, so the same spec gives the same warnings.
        lines = tuple(logged_warning(self.name, _LOG_TIME.sub("", line)) for line in logged)
        return replace(grammar, warnings=grammar.warnings + lines)

    def _compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        warnings: tuple[str, ...] = ()
        try:
            if spec.kind == "json_schema":
                schema = specs.load_schema(spec, self.name)
                handle = self._compiler.compile_json_schema(json.dumps(schema), **self._json_options())
                warnings = specs.unenforced_warnings(self.name, schema, IGNORED_KEYWORDS, IGNORED_WHEN)
            elif spec.kind == "regex":
                handle = self._compiler.compile_regex(specs.load_text(spec, self.name))
            elif spec.kind == "choice":
                handle = self._compiler.compile_regex(specs.choice_regex(specs.load_choices(spec, self.name)))
            elif spec.kind == "ebnf":
                text = specs.load_text(spec, self.name)
                if specs.ebnf_dialect(spec, self.name) == "lark":
                    handle = self._compiler.compile_lark(text)
                else:
                    handle = self._compiler.compile_grammar(text)
            else:
                tags = specs.load_tool_call_tags(spec, self.name)
                handle = self._compiler.compile_structural_tag(self._structural_tag(tags))
                for tag in tags:
                    warnings += specs.unenforced_warnings(self.name, tag.schema, IGNORED_KEYWORDS, IGNORED_WHEN)
        except CompileError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError, pydantic errors, ...
            raise specs.failure(self.name, spec, str(exc)) from None
        return CompiledGrammar(self.name, spec, handle, warnings)

    def matcher(self, grammar: CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(grammar.handle), self.vocab, self._checks)

    def _json_options(self) -> dict:
        if self.whitespace == "flexible":
            return {"any_whitespace": True}
        return {"any_whitespace": False, "separators": (specs.ITEM_SEPARATOR, specs.KEY_SEPARATOR)}

    def _structural_tag(self, tags: list[specs.ToolCallTag]) -> dict:
        formats = [{"type": "tag", "begin": tag.begin, "content": self._tag_content(tag.schema), "end": tag.end}
                   for tag in tags]
        root = formats[0] if len(formats) == 1 else {"type": "or", "elements": formats}
        return {"type": "structural_tag", "format": root}

    def _tag_content(self, schema: dict) -> dict:
        if self.whitespace == "flexible":
            return {"type": "json_schema", "json_schema": schema}
        # The structural tag's own json_schema content has flexible whitespace;
        # the compact language goes in as a grammar built with our separators.
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), **self._json_options())
        return {"type": "grammar", "grammar": str(grammar)}
