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
        """A stable text form: equal specs give equal text (the compile-cache key).

        The spec keeps its key order: the order of a schema's ``properties``
        is the order engines generate them in, so two schemas that differ only
        there are different grammars. Options are sorted (their order means
        nothing); JSON text and the same value as a dict give the same form.
        """
        spec = self.spec
        if self.kind in ("json_schema", "structural_tag") and isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError:
                pass  # malformed text stays as written; compile reports it
        return json.dumps(
            {"kind": self.kind, "spec": spec, "options": dict(sorted(self.options.items()))},
            separators=(",", ":"),
            ensure_ascii=False,
        )

    def __hash__(self) -> int:
        return hash(self.canonical())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConstraintSpec) and self.canonical() == other.canonical()


class CompileError(Exception):
    """A spec a backend cannot compile.

    ``reason`` is ``unsupported`` for features the engine does not have,
    ``invalid`` for a malformed spec, or ``timeout`` for a compile that took
    too long (:class:`~cdbench.backends.cache.CompileTimeout`); ``message`` is
    the engine's own words.
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
    ("compiled but not enforced"), e.g. a JSON Schema ``not`` under xgrammar,
    and the lines the engine itself logged while compiling (captured from
    stderr by :mod:`cdbench.backends.engine_log`).
    """

    backend: str
    spec: ConstraintSpec
    handle: Any = field(repr=False)
    warnings: tuple[str, ...] = ()


class Matcher(ABC):
    """One request's grammar state.

    Every method either does what it says or raises leaving the state as it
    was, so a refused call never corrupts a matcher.
    """

    @abstractmethod
    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``mask[row]`` (the backend's mask format).

        ``mask`` is a contiguous CPU tensor as ``allocate_mask`` makes
        (``TypeError`` or ``ValueError`` otherwise) and is not resized in
        place while in use (see :class:`MaskChecks`); a ``row`` outside it
        raises ``IndexError``.
        """

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by ``token``; ``False`` (state unchanged) if the grammar rejects it.

        An id outside the vocabulary (negative, or ``>= vocab.size``) is rejected too.
        """

    @property
    @abstractmethod
    def history_length(self) -> int:
        """Tokens accepted so far (EOS included); ``rollback`` can undo at most this many."""

    @abstractmethod
    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens.

        ``ValueError`` (state unchanged) when ``k`` is negative or more than
        the matcher can undo.
        """

    @abstractmethod
    def jump_forward(self) -> list[int]:
        """Tokens the grammar forces next, without accepting them (may be empty)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has accepted its end (EOS accepted)."""

    @abstractmethod
    def copy(self) -> Matcher:
        """A matcher at the same state, sharing the compiled grammar, not the state."""


def check_mask(mask: object, mask_format: MaskFormat, vocab_size: int, backend: str) -> tuple[int, int]:
    """``(data pointer, rows)`` of ``mask`` once it is known to be safe to fill.

    Matchers write rows straight into the tensor's memory, so a mask must be a
    contiguous CPU tensor of ``mask_format``'s dtype and row width whose storage
    holds all of it. Raises ``TypeError`` or ``ValueError`` naming what is wrong.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{backend} fill_mask: the mask must be a torch.Tensor, not {type(mask).__name__}")
    bitmask = mask_format is MaskFormat.BITMASK
    dtype, width = (torch.int32, (vocab_size + 31) // 32) if bitmask else (torch.bool, vocab_size)
    problems = []
    if mask.dtype != dtype:
        problems.append(f"dtype {mask.dtype}")
    if mask.device.type != "cpu":
        problems.append(f"device {mask.device}")
    if mask.dim() != 2 or mask.shape[1] != width:
        problems.append(f"shape {list(mask.shape)}")
    elif not mask.is_contiguous():
        problems.append(f"strides {list(mask.stride())} (not contiguous)")
    elif mask.untyped_storage().nbytes() < (mask.storage_offset() + mask.numel()) * mask.element_size():
        problems.append("a storage smaller than its shape")
    if problems:
        raise ValueError(f"{backend} fill_mask: the mask must be a contiguous CPU {dtype} tensor of shape "
                         f"[batch, {width}] ({mask_format.value} format), not one with {', '.join(problems)}")
    return mask.data_ptr(), mask.shape[0]


class MaskChecks:
    """The last mask a backend's matchers checked, shared by all of them.

    A server fills one batch mask for every request, so a full
    :func:`check_mask` runs once per tensor: ``check`` of the last mask checked
    is an identity test. Matchers that write rows through a raw pointer keep
    the result of their own last ``check`` too (and with it a reference to that
    mask), so their per-token fill costs one identity test against it. ``last``
    is ``(mask, data pointer, rows)``, replaced whole, so one read is
    consistent even with matchers on several threads.

    The check is per tensor, so a mask must not be resized in place
    (``resize_``, ``set_``) while matchers use it: allocate a new one.
    """

    __slots__ = ("last", "_format", "_vocab_size", "_backend")

    def __init__(self, mask_format: MaskFormat, vocab_size: int, backend: str) -> None:
        self.last: tuple[torch.Tensor | None, int, int] = (None, 0, 0)
        self._format, self._vocab_size, self._backend = mask_format, vocab_size, backend

    def check(self, mask: object) -> tuple[torch.Tensor, int, int]:
        """``(mask, data pointer, rows)`` of ``mask``, checked by :func:`check_mask` unless it is the last one."""
        checked = self.last
        if mask is not checked[0]:
            base, rows = check_mask(mask, self._format, self._vocab_size, self._backend)
            self.last = checked = (mask, base, rows)  # type: ignore[assignment]
        return checked  # type: ignore[return-value]


def check_rollback(k: int, accepted: int) -> None:
    """Raise ``ValueError`` unless ``rollback(k)`` stays within the ``accepted`` tokens."""
    if not 0 <= k <= accepted:
        raise ValueError(f"cannot roll back {k} tokens: {accepted} accepted")


def row_error(backend: str, row: object, rows: int) -> IndexError:
    """The error for a ``fill_mask`` row that is not one of the mask's ``rows``."""
    return IndexError(f"{backend} fill_mask: row {row!r} is not a row of a mask with {rows} rows")


class GrammarBackend(ABC):
    """One grammar engine bound to one vocabulary.

    ``shares_compile_work``: the engine keeps work of earlier compiles that later grammars reuse (so a
    spec's compile time depends on what was compiled before it, not only on the spec).
    """

    name: str
    mask_format: MaskFormat = MaskFormat.BITMASK
    shares_compile_work: bool = False

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

    def clear_engine_cache(self) -> None:
        """Forget what the engine kept from earlier compiles (nothing, unless the engine shares work
        between grammars): a compile measured after it costs what it costs the engine the first time."""
