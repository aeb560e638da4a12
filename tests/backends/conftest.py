"""Session-wide engines: each (engine, vocabulary) backend and each compiled case is built once.

Building a backend costs 0.2-2 s (tokenizer tables), an outlines index up to
seconds, so tests share them through the ``engines`` fixture.
"""

from __future__ import annotations

import pytest

from cdbench.backends import (
    CompiledGrammar,
    ConstraintSpec,
    GrammarBackend,
    create_backend,
    load_vocab,
)
from cdbench.backends.reasoner import ReasonerBackend


class Engines:
    """Backends and compiled grammars, built on first use and kept for the session."""

    def __init__(self) -> None:
        self._backends: dict[tuple[str, str], GrammarBackend] = {}
        self._grammars: dict[tuple[str, str, str], CompiledGrammar] = {}

    def backend(self, engine: str, vocab: str) -> GrammarBackend:
        key = (engine, vocab)
        if key not in self._backends:
            self._backends[key] = create_backend(engine, load_vocab(vocab))
        return self._backends[key]

    def reasoner(self, inner: str, vocab: str) -> ReasonerBackend:
        """The reasoner over the session's ``inner`` backend (so it shares its compiled grammars)."""
        key = (f"reasoner:{inner}", vocab)
        if key not in self._backends:
            self._backends[key] = ReasonerBackend(load_vocab(vocab), inner=self.backend(inner, vocab))
        return self._backends[key]

    def compiled(self, engine: str, vocab: str, spec: ConstraintSpec) -> CompiledGrammar:
        key = (engine, vocab, spec.canonical())
        if key not in self._grammars:
            self._grammars[key] = self.backend(engine, vocab).compile(spec)
        return self._grammars[key]


@pytest.fixture(scope="session")
def engines() -> Engines:
    return Engines()

