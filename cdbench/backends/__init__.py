"""Grammar engines behind one interface, offline vocabularies and the backend registry.

>>> from cdbench.backends import ConstraintSpec, create_backend
>>> backend = create_backend("xgrammar", "cl100k")
>>> grammar = backend.compile(ConstraintSpec("choice", ["yes", "no"]))
>>> matcher = backend.matcher(grammar)
>>> mask = backend.allocate_mask(1)
>>> matcher.fill_mask(mask, 0)
"""

from cdbench.backends.base import (
    CompiledGrammar,
    CompileError,
    ConstraintSpec,
    GrammarBackend,
    MaskFormat,
    Matcher,
)
from cdbench.backends.cache import (
    AsyncCompiler,
    CacheStats,
    CompileCache,
    CompileTimeout,
)
from cdbench.backends.registry import (
    available_backends,
    create_backend,
    register_backend,
)
from cdbench.backends.vocab import Vocabulary, available_vocabs, load_vocab

__all__ = [
    "AsyncCompiler",
    "CacheStats",
    "CompileCache",
    "CompileTimeout",
    "CompileError",
    "CompiledGrammar",
    "ConstraintSpec",
    "GrammarBackend",
    "MaskFormat",
    "Matcher",
    "Vocabulary",
    "available_backends",
    "available_vocabs",
    "create_backend",
    "load_vocab",
    "register_backend",
]
