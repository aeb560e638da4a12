"""The reasoner wrapper: free thinking first, then the inner backend's grammar.

A reasoning model writes ``<think> … </think>`` before its answer. The
constraint applies to the answer only, so a :class:`ReasonerMatcher` has two
phases, as SGLang's ``ReasonerGrammarObject`` does:

* **thinking**: the inner grammar is not consulted. Every token is allowed, or
  with *strict thinking* only the configured token filter plus the think-end
  token. Once the *thinking budget* is spent, only the think-end token is
  allowed (and ``jump_forward`` returns it).
* **answer**: after the think-end token every call goes to the inner matcher.
  The think-end token itself is **not** passed to the inner grammar.

EOS while thinking: allowed unless strict thinking filters it out, because both
engines leave a thinking row all-allowed (SGLang does not consult the grammar,
vLLM does not fill the row). Accepting it counts as a think token and does not
terminate the matcher (``is_terminated`` is the inner grammar's); a request that
samples it ends by EOS without an answer, exactly as it would in the engines.

>>> from cdbench.backends import ConstraintSpec, create_backend
>>> backend = create_backend("reasoner", "qwen3.6", inner="xgrammar", thinking_budget=512)
>>> grammar = backend.compile(ConstraintSpec("regex", "[0-9]+"))
>>> m = backend.matcher(grammar)                  # starts thinking
>>> m.accept(backend.think_end_id), m.thinking    # the switch to the answer
(True, False)
>>> no_think = backend.matcher(grammar, thinking=False)   # a request that does not think

The compiled grammar is the inner backend's own: the wrapper compiles nothing,
so ``options_key`` is the inner's and a compile cache is shared with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch

from cdbench.backends.base import (
    CompiledGrammar,
    ConstraintSpec,
    GrammarBackend,
    MaskChecks,
    MaskFormat,
    Matcher,
    row_error,
)
from cdbench.backends.registry import create_backend
from cdbench.backends.vocab import Vocabulary

__all__ = ["ReasonerBackend", "ReasonerMatcher"]


class _BackendDefault:
    def __repr__(self) -> str:
        return "<backend default>"


BACKEND_DEFAULT: Final = _BackendDefault()
"""Sentinel for ``matcher(..., thinking_budget=)``: use the backend's budget."""


class ReasonerBackend(GrammarBackend):
    """Wraps ``inner`` with a thinking phase that the constraint does not apply to.

    Parameters
    ----------
    vocab : the vocabulary; an ``inner`` instance must use the same one.
    inner : a backend name (created through the registry with ``**inner_options``)
        or a backend instance.
    think_end : the marker that ends thinking; it must be exactly one token.
    thinking_budget : think tokens allowed before only ``think_end`` is
        (``None``: unlimited, SGLang's ``SGLANG_MAX_THINK_TOKENS=-1``). Matchers
        may override it.
    strict_thinking_tokens : with strict thinking, the only tokens allowed while
        thinking (``think_end`` is always allowed too). SGLang configures the
        complement (``think_excluded_token_ids``); pass the allowed ids here.

    Raises
    ------
    ValueError : ``think_end`` is not one token, a budget is negative, a filter id
        is out of range, or ``inner`` was built for another vocabulary.
    """

    name = "reasoner"

    def __init__(
        self,
        vocab: Vocabulary,
        inner: str | GrammarBackend = "xgrammar",
        think_end: str = "</think>",
        thinking_budget: int | None = None,
        strict_thinking_tokens: Sequence[int] | None = None,
        **inner_options: Any,
    ) -> None:
        super().__init__(vocab)
        if isinstance(inner, GrammarBackend):
            if inner_options:
                raise TypeError(
                    f"options {sorted(inner_options)} are for building an inner backend by name; "
                    f"{inner.name!r} was given already built"
                )
            if inner.vocab.name != vocab.name:
                raise ValueError(
                    f"inner backend {inner.name!r} uses vocabulary {inner.vocab.name!r}, "
                    f"the reasoner {vocab.name!r}"
                )
        else:
            inner = create_backend(inner, vocab, **inner_options)
        self.inner = inner
        self.mask_format = inner.mask_format
        self._checks = MaskChecks(self.mask_format, vocab.size, self.name)
        try:
            self.think_end_id = vocab.token_id(think_end)
        except ValueError as err:
            raise ValueError(
                f"think-end marker {think_end!r} must be exactly one token in vocabulary "
                f"{vocab.name!r} ({err})"
            ) from None
        self.think_end = think_end
        self.thinking_budget = _check_budget(thinking_budget)
        self.strict_thinking_tokens: frozenset[int] | None = None
        self._strict_row: torch.Tensor | None = None
        if strict_thinking_tokens is not None:
            ids = np.asarray(list(strict_thinking_tokens), dtype=np.int64)
            bad = ids[(ids < 0) | (ids >= vocab.size)]
            if bad.size:
                raise ValueError(
                    f"strict thinking token ids {bad[:5].tolist()} are outside vocabulary "
                    f"{vocab.name!r} (0..{vocab.size - 1})"
                )
            self.strict_thinking_tokens = frozenset(ids.tolist()) | {self.think_end_id}
            self._strict_row = self._row_allowing(sorted(self.strict_thinking_tokens))
        self._end_only_row = self._row_allowing([self.think_end_id])
        # Strict thinking whose filter is think-end alone forces it like a spent budget.
        self._strict_forces_end = self.strict_thinking_tokens == {self.think_end_id}

    def _row_allowing(self, ids: Sequence[int]) -> torch.Tensor:
        """One mask row, in this backend's format, allowing exactly ``ids``."""
        if self.mask_format is MaskFormat.BOOL:
            row = torch.zeros(self.vocab.size, dtype=torch.bool)
            row[list(ids)] = True
            return row
        words = np.zeros((self.vocab.size + 31) // 32, dtype=np.uint32)
        arr = np.asarray(ids, dtype=np.int64)
        np.bitwise_or.at(words, arr >> 5, (np.uint32(1) << (arr & 31).astype(np.uint32)))
        return torch.from_numpy(words.view(np.int32))

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        """The inner backend's compiled grammar (raises its :class:`CompileError`)."""
        return self.inner.compile(spec)

    def matcher(
        self,
        grammar: CompiledGrammar,
        *,
        thinking: bool = True,
        thinking_budget: int | None | _BackendDefault = BACKEND_DEFAULT,
    ) -> ReasonerMatcher:
        """A matcher at the start of thinking, or with ``thinking=False`` at the start of the answer.

        ``thinking_budget`` overrides the backend's budget for this request
        (SGLang's per-request ``custom_params["thinking_budget"]``).
        """
        budget = (
            self.thinking_budget
            if thinking_budget is BACKEND_DEFAULT
            else _check_budget(thinking_budget)  # type: ignore[arg-type]
        )
        return ReasonerMatcher(self, self.inner.matcher(grammar), thinking, budget)

    def options_key(self) -> str:
        # Compiled output is the inner's, so cached grammars are interchangeable with it.
        return self.inner.options_key()


def _check_budget(budget: int | None) -> int | None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ValueError(f"thinking budget must be None (unlimited) or an int >= 0, got {budget!r}")
    return budget


class ReasonerMatcher(Matcher):
    """One request's phase (thinking or answer) plus its inner matcher.

    State, as in SGLang: ``think_tokens`` accepted while thinking (the
    think-end token not counted), then the inner matcher's own history
    (``answer_tokens``: the tokens it accepted since think-end; the inner
    matcher sees no think token, so that is its ``history_length``).
    ``rollback`` moves back through both: the inner matcher is rolled back by
    its own tokens only, then the think-end token returns the matcher to
    thinking.

    Speed: in the answer phase ``fill_mask`` and ``accept`` are the inner
    matcher's own bound methods, set on the instance, so the wrapper adds no
    Python call per token. A method bound by the caller belongs to the phase it
    was taken in (one bound while thinking still works, through the class's
    method): take it again after an ``accept`` or ``rollback`` that crosses
    think-end.
    """

    def __init__(
        self,
        backend: ReasonerBackend,
        inner: Matcher,
        thinking: bool,
        thinking_budget: int | None,
    ) -> None:
        self._backend = backend
        self.inner = inner
        self.thinking_budget = thinking_budget
        self.think_tokens = 0
        self._answering = False
        self._thought = thinking  # False: started in the answer, no think span to roll back into
        if not thinking:
            self._enter_answer()

    def _enter_answer(self) -> None:
        self._answering = True
        self.fill_mask = self.inner.fill_mask  # type: ignore[method-assign]
        self.accept = self.inner.accept  # type: ignore[method-assign]

    def _enter_thinking(self) -> None:
        self._answering = False
        del self.fill_mask, self.accept  # back to the class's methods

    @property
    def thinking(self) -> bool:
        """True while in the thinking phase."""
        return not self._answering

    @property
    def answer_tokens(self) -> int:
        """Tokens accepted since think-end (``-1`` while thinking)."""
        return self.inner.history_length if self._answering else -1

    def _budget_spent(self) -> bool:
        return self.thinking_budget is not None and self.think_tokens >= self.thinking_budget

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        if self._answering:  # only through a fill_mask bound while thinking
            self.inner.fill_mask(mask, row)
            return
        backend = self._backend
        checked = backend._checks.check(mask)
        if not 0 <= row < checked[2]:
            raise row_error("reasoner", row, checked[2])
        if self._budget_spent():
            mask[row].copy_(backend._end_only_row)
        elif backend._strict_row is not None:
            mask[row].copy_(backend._strict_row)
        else:
            mask[row].fill_(True if backend.mask_format is MaskFormat.BOOL else -1)

    def accept(self, token: int) -> bool:
        if self._answering:  # only through an accept bound while thinking
            return self.inner.accept(token)
        backend = self._backend
        if token == backend.think_end_id:
            self._enter_answer()
            return True
        if not 0 <= token < backend.vocab.size or self._budget_spent():
            return False
        strict = backend.strict_thinking_tokens
        if strict is not None and token not in strict:
            return False
        self.think_tokens += 1
        return True

    def rollback(self, k: int) -> None:
        """Undo the last ``k`` tokens, across the think-end token if need be.

        Raises ``ValueError`` (state unchanged) when ``k`` is negative or larger
        than the tokens accepted.
        """
        if k < 0 or k > self.history_length:
            raise ValueError(
                f"cannot roll back {k} tokens: {self.history_length} accepted "
                f"({self.think_tokens} thinking, {max(self.answer_tokens, 0)} answer)"
            )
        if self._answering:
            undo_inner = min(k, self.inner.history_length)
            if undo_inner:
                self.inner.rollback(undo_inner)
                k -= undo_inner
            if k == 0:
                return
            self._enter_thinking()  # undoes the think-end token
            k -= 1
        self.think_tokens -= k

    @property
    def history_length(self) -> int:
        """Tokens accepted so far (think tokens, the think-end token, answer tokens)."""
        if not self._answering:
            return self.think_tokens
        return self.think_tokens + int(self._thought) + self.inner.history_length

    def jump_forward(self) -> list[int]:
        if self._answering:
            return self.inner.jump_forward()
        if self._budget_spent() or self._backend._strict_forces_end:
            return [self._backend.think_end_id]
        return []

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def copy(self) -> ReasonerMatcher:
        twin = ReasonerMatcher(self._backend, self.inner.copy(), self._thought, self.thinking_budget)
        twin.think_tokens = self.think_tokens
        if self._answering and not twin._answering:
            twin._enter_answer()
        return twin
