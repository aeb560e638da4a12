"""The unconstrained backend: every token allowed, EOS included, at every step.

It is the baseline a constrained run is compared with, and the backend of
requests without a constraint.

>>> from cdbench.backends import ConstraintSpec, create_backend
>>> backend = create_backend("none", "cl100k")
>>> matcher = backend.matcher(backend.compile(ConstraintSpec("regex", "[0-9]")))
>>> matcher.accept(backend.vocab.encode("not a digit")[0]), matcher.is_terminated()
(True, False)
"""

from __future__ import annotations

import torch

from cdbench.backends.base import (
    CompiledGrammar,
    ConstraintSpec,
    GrammarBackend,
    MaskChecks,
    Matcher,
    check_rollback,
    row_error,
)
from cdbench.backends.vocab import Vocabulary


class NoneMatcher(Matcher):
    """Accepts every token of the vocabulary; terminates once it accepts an EOS token."""

    __slots__ = ("_eos", "_size", "_checks", "_accepted", "_terminated")

    def __init__(self, eos: frozenset[int], size: int, checks: MaskChecks) -> None:
        self._eos = eos
        self._size = size
        self._checks = checks
        self._accepted = 0
        self._terminated = False

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        # The engines' checks, so a bad mask fails alike on every backend.
        checked = self._checks.check(mask)
        if not 0 <= row < checked[2]:
            raise row_error("none", row, checked[2])
        mask[row].fill_(-1)

    def accept(self, token: int) -> bool:
        if self._terminated or not 0 <= token < self._size:
            return False
        self._accepted += 1
        self._terminated = token in self._eos
        return True

    @property
    def history_length(self) -> int:
        return self._accepted

    def rollback(self, k: int) -> None:
        check_rollback(k, self._accepted)
        if k > 0:
            self._accepted -= k
            self._terminated = False  # EOS is always the last token accepted

    def jump_forward(self) -> list[int]:
        return []

    def is_terminated(self) -> bool:
        return self._terminated

    def copy(self) -> NoneMatcher:
        twin = NoneMatcher(self._eos, self._size, self._checks)
        twin._accepted, twin._terminated = self._accepted, self._terminated
        return twin


class NoneBackend(GrammarBackend):
    """No constraint: compiles any spec to "anything goes"."""

    name = "none"

    def __init__(self, vocab: Vocabulary) -> None:
        super().__init__(vocab)
        self._eos = frozenset(vocab.eos_token_ids)
        self._checks = MaskChecks(self.mask_format, vocab.size, self.name)

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        return CompiledGrammar(self.name, spec, None)

    def matcher(self, grammar: CompiledGrammar) -> NoneMatcher:
        return NoneMatcher(self._eos, self.vocab.size, self._checks)
