"""Small pure-Python choice backends for the ``cdbench profile`` tests, registered on import.

Loaded as a plugin (``--plugin tests/profile/profile_backends.py``) so the
profile's worker processes register them too:

- ``toy``: a correct choice matcher;
- ``toy_lenient``: accepts every token (so invalid instances get through);
- ``toy_strict``: refuses any token containing the byte ``b`` (valid ones fail);
- ``toy_masky``: accepts tokens containing the byte ``b`` but leaves them out
  of the mask (the mask and ``accept`` disagree);
- ``toy_endless``: accepts EOS but never terminates;
- ``toy_warns``: a correct matcher whose compiled grammar carries a
  "compiled but not enforced" warning;
- ``toy_crashy``: aborts the process when compiling an option starting with
  ``CRASH`` and hangs when one starts with ``HANG`` (``HANG pidfile=PATH``
  first writes the hanging process's pid to ``PATH``); with ``WALKCRASH`` /
  ``WALKHANG`` it does so in the first mask fill instead; ``HOG <MB>`` makes the
  compile allocate that many megabytes, ``WALKHOG <MB>`` each mask fill.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from cdbench.backends.base import (
    CompiledGrammar,
    CompileError,
    ConstraintSpec,
    GrammarBackend,
    Matcher,
)
from cdbench.backends.registry import register_backend
from cdbench.backends.vocab import Vocabulary


def _hog(megabytes: str) -> None:
    """Allocate ``megabytes`` MB of private memory (counted by a worker's memory cap; left untouched, so
    without a cap it costs the machine nothing) and let it go."""
    np.zeros(int(megabytes) * 1_000_000, dtype=np.uint8)


class ToyMatcher(Matcher):
    def __init__(self, backend: ToyChoiceBackend, options: tuple[bytes, ...]) -> None:
        self.backend, self.options = backend, options
        self.prefix = b""
        self.history: list[bytes] = []
        self.terminated = False

    def _live(self, text: bytes) -> bool:
        return any(option.startswith(text) for option in self.options)

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        if self.backend.behaviour == "crashy":
            if any(b"WALKCRASH" in option for option in self.options):
                os.abort()
            if any(b"WALKHANG" in option for option in self.options):
                time.sleep(3600)
            for option in self.options:
                if option.startswith(b"WALKHOG "):
                    _hog(option.decode()[len("WALKHOG "):])
        words = mask.numpy()[row].view(np.uint32)
        words[:] = 0
        allowed = []
        for option in self.options:
            if option.startswith(self.prefix):
                rest = option[len(self.prefix) :]
                allowed += [self.backend.ids[rest[:n]] for n in range(1, len(rest) + 1) if rest[:n] in self.backend.ids]
                if not rest:
                    allowed.append(self.backend.eos)
        if self.backend.behaviour == "masky":
            allowed = [t for t in allowed if t == self.backend.eos or b"b" not in self.backend.vocab.token_bytes[t]]
        for token in allowed:
            words[token >> 5] |= np.uint32(1 << (token & 31))

    def accept(self, token: int) -> bool:
        behaviour = self.backend.behaviour
        if self.terminated:
            return False
        if token == self.backend.eos:
            if behaviour == "lenient" or self.prefix in self.options:
                self.terminated = behaviour != "endless"
                self.history.append(b"")
                return True
            return False
        piece = self.backend.vocab.token_bytes[token]
        if behaviour == "strict" and b"b" in piece:
            return False
        if behaviour != "lenient" and not self._live(self.prefix + piece):
            return False
        self.prefix += piece
        self.history.append(piece)
        return True

    @property
    def history_length(self) -> int:
        return len(self.history)

    def rollback(self, k: int) -> None:
        for _ in range(k):
            piece = self.history.pop()
            if piece:
                self.prefix = self.prefix[: len(self.prefix) - len(piece)]
            else:
                self.terminated = False

    def jump_forward(self) -> list[int]:
        return []

    def is_terminated(self) -> bool:
        return self.terminated

    def copy(self) -> Matcher:
        other = ToyMatcher(self.backend, self.options)
        other.prefix, other.history, other.terminated = self.prefix, list(self.history), self.terminated
        return other


class ToyChoiceBackend(GrammarBackend):
    def __init__(self, vocab: Vocabulary, behaviour: str = "correct") -> None:
        super().__init__(vocab)
        self.name = f"toy_{behaviour}"
        self.behaviour = behaviour
        self.eos = vocab.eos_token_ids[0]
        forbidden = vocab.forbidden_token_ids
        self.ids = {b: i for i, b in enumerate(vocab.token_bytes) if b and i not in forbidden}

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        if spec.kind != "choice":
            raise CompileError(self.name, spec.kind, "unsupported", "toy backends only do choice")
        if not spec.spec:
            raise CompileError(self.name, spec.kind, "invalid", "empty choice list")
        if self.behaviour == "crashy":
            if any(option.startswith("CRASH") for option in spec.spec):
                os.abort()
            for option in spec.spec:
                if option.startswith("HANG"):
                    _, _, pidfile = option.partition(" pidfile=")
                    if pidfile:
                        Path(pidfile + ".tmp").write_text(str(os.getpid()))
                        os.replace(pidfile + ".tmp", pidfile)  # whole or absent for the reader
                    time.sleep(3600)
            for option in spec.spec:
                if option.startswith("HOG "):
                    _hog(option[len("HOG "):])
        warnings = ("toy: option order not enforced",) if self.behaviour == "warns" else ()
        return CompiledGrammar(self.name, spec, tuple(o.encode() for o in spec.spec), warnings)

    def matcher(self, grammar: CompiledGrammar) -> Matcher:
        return ToyMatcher(self, grammar.handle)


for _behaviour in ("correct", "lenient", "strict", "masky", "endless", "warns", "crashy"):
    register_backend(
        "toy" if _behaviour == "correct" else f"toy_{_behaviour}",
        lambda vocab, _b=_behaviour, **options: ToyChoiceBackend(vocab, _b, **options),
    )
