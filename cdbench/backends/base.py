"""The two abstract classes every grammar engine implements, and the values they pass.

An engine-level :class:`GrammarBackend` (one per engine and vocabulary) compiles a
:class:`ConstraintSpec` into a :class:`CompiledGrammar`; a request-level
:class:`Matcher` holds one request's grammar state and fills its row of the
token mask. This mirrors vLLM's StructuredOutputBackend / StructuredOutputGrammar
and SGLang's BaseGrammarBackend / BaseGrammarObject.

Threading: a backend's ``compile`` may be called from several threads at once;
a matcher belongs to one thread at a time.
"""

from __future__ import annotations

import enum
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from cdbench.backends.vocab import Vocabulary

ConstraintKind = Literal["json_schema", "regex", "ebnf", "choice", "structural_tag"]
CONSTRAINT_KINDS: tuple[str, ...] = ("json_schema", "regex", "ebnf", "choice", "structural_tag")


class MaskFormat(str, enum.Enum):
    """How a backend's mask rows are laid out."""

    BITMASK = "bitmask"  # int32 [B, ceil(V/32)], bit i of word w is token 32*w+i, 1 = allowed
    BOOL = "bool"  # bool [B, V], True = allowed


@dataclass(frozen=True)
class ConstraintSpec:
    """What a request's output must match.

    ``spec`` by kind: a JSON Schema (dict or JSON text) for ``json_schema``; a
    pattern for ``regex``; grammar text for ``ebnf`` (``options["dialect"]`` is
    ``gbnf`` or ``lark``); a list of strings for ``choice``; for
    ``structural_tag`` a dict ``{"begin": str, "schema": dict, "end": str}``
    (one tool-call tag) or ``{"tags": [...]}`` of several.
    """

    kind: ConstraintKind
    spec: Any
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(
                f"unknown constraint kind {self.kind!r}; known: {', '.join(CONSTRAINT_KINDS)}"
            )

    def canonical(self) -> str:
        """A stable text form: equal specs give equal text (the compile-cache key)."""
        spec = self.spec
        if self.kind in ("json_schema", "structural_tag") and isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError:
                pass  # malformed text stays as written; compile reports it
        return json.dumps(
            {"kind": self.kind, "spec": spec, "options": dict(self.options)},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        )

    def __hash__(self) -> int:
        return hash(self.canonical())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConstraintSpec) and self.canonical() == other.canonical()


class CompileError(Exception):
    """A spec a backend cannot compile.

    ``reason`` is ``unsupported`` for features the engine does not have, or
    ``invalid`` for a malformed spec; ``message`` is the engine's own words.
    """

    def __init__(self, backend: str, kind: str, reason: str, message: str = "") -> None:
        self.backend, self.kind, self.reason, self.message = backend, kind, reason, message
        super().__init__(f"{backend} cannot compile {kind}: {reason}" + (f": {message}" if message else ""))

    @property
    def unsupported(self) -> bool:
        return self.reason == "unsupported"


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A backend's compiled form of one spec; shareable between matchers.

    ``warnings`` lists constraints the engine accepted but does not enforce
    ("compiled but not enforced"), e.g. a JSON Schema ``not`` under xgrammar.
    """

    backend: str
    spec: ConstraintSpec
    handle: Any = field(repr=False)
    warnings: tuple[str, ...] = ()


class Matcher(ABC):
    """One request's grammar state."""

    @abstractmethod
    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``mask[row]`` (the backend's mask format)."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by ``token``; ``False`` (state unchanged) if the grammar rejects it."""

    @abstractmethod
    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens."""

    @abstractmethod
    def jump_forward(self) -> list[int]:
        """Tokens the grammar forces next, without accepting them (may be empty)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has accepted its end (EOS accepted)."""

    @abstractmethod
    def copy(self) -> Matcher:
        """A matcher at the same state, sharing the compiled grammar, not the state."""


class GrammarBackend(ABC):
    """One grammar engine bound to one vocabulary."""

    name: str
    mask_format: MaskFormat = MaskFormat.BITMASK

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab

    @abstractmethod
    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        """Compile ``spec``; raises :class:`CompileError`."""

    @abstractmethod
    def matcher(self, grammar: CompiledGrammar) -> Matcher:
        """A fresh matcher at the grammar's start."""

    def allocate_mask(self, batch: int) -> torch.Tensor:
        """A mask of ``batch`` rows in this backend's format, everything allowed."""
        if self.mask_format is MaskFormat.BOOL:
            return torch.ones((batch, self.vocab.size), dtype=torch.bool)
        return torch.full((batch, (self.vocab.size + 31) // 32), -1, dtype=torch.int32)

    def options_key(self) -> str:
        """Options that change compiled output; part of the compile-cache key."""
        return f"{self.name}:{self.vocab.name}"
