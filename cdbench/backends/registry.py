"""Name → backend factory, like SGLang's GRAMMAR_BACKEND_REGISTRY.

Built-in backends are imported lazily so that using one engine never imports
the others. Users add their own with :func:`register_backend`.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from cdbench.backends.base import GrammarBackend
from cdbench.backends.vocab import Vocabulary, load_vocab

BackendFactory = Callable[..., GrammarBackend]

_BUILTIN: dict[str, str] = {
    "xgrammar": "cdbench.backends.xgrammar:XGrammarBackend",
    "llguidance": "cdbench.backends.llguidance:LLGuidanceBackend",
    "outlines": "cdbench.backends.outlines:OutlinesBackend",
    "none": "cdbench.backends.none:NoneBackend",
    "reasoner": "cdbench.backends.reasoner:ReasonerBackend",
}
_REGISTERED: dict[str, BackendFactory] = {}
_LOCK = threading.Lock()


class UnknownBackendError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``create_backend(name, vocab, **options)`` call ``factory(vocab, **options)``."""
    with _LOCK:
        _REGISTERED[name] = factory


def available_backends() -> list[str]:
    return sorted(set(_BUILTIN) | set(_REGISTERED))


def _factory(name: str) -> BackendFactory:
    with _LOCK:
        if name in _REGISTERED:
            return _REGISTERED[name]
    if name not in _BUILTIN:
        raise UnknownBackendError(
            f"unknown backend {name!r}; available: {', '.join(available_backends())}"
        )
    module, attr = _BUILTIN[name].split(":")
    return getattr(importlib.import_module(module), attr)


def create_backend(name: str, vocab: Vocabulary | str, **options: Any) -> GrammarBackend:
    """Build backend ``name`` for ``vocab`` (a :class:`Vocabulary` or its name)."""
    if isinstance(vocab, str):
        vocab = load_vocab(vocab)
    return _factory(name)(vocab, **options)


def shares_compile_work(name: str) -> bool:
    """Whether backend ``name``'s compiles reuse earlier compiles' work
    (:attr:`GrammarBackend.shares_compile_work`), known without building it; ``False`` for a factory that
    is not a backend class."""
    factory = _factory(name)
    return isinstance(factory, type) and issubclass(factory, GrammarBackend) and factory.shares_compile_work
