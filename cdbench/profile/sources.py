"""Where ``cdbench profile``'s items and instances come from: :mod:`cdbench.workloads`.

Corpus items (:func:`cdbench.workloads.corpora.load_corpus`) and their oracle
instances (validated, tokenized, EOS last, cached on disk by
:class:`cdbench.workloads.instances.PoolCache`) come from the workloads
package; this module only shapes them into what the profile runner needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import Vocabulary
from cdbench.workloads.corpora import load_corpus
from cdbench.workloads.instances import InstanceFailure, PoolCache


@dataclass(frozen=True)
class SourceItem:
    """One corpus item to profile: the corpus (file stem) it came from, its id and spec."""

    corpus: str
    item_id: str
    spec: ConstraintSpec


def load_items(corpus: str, limit: int | None) -> tuple[list[SourceItem], list[str]]:
    """The first ``limit`` items of ``corpus`` (a name or a JSONL path) and the lines skipped."""
    loaded = load_corpus(corpus, limit=limit)
    name = Path(str(corpus)).stem
    items = [SourceItem(name, item.id, item.to_spec()) for item in loaded.items]
    return items, [str(line) for line in loaded.skipped]


def oracle_instances(
    item: SourceItem, vocab: Vocabulary, n: int, seed: int, cache: PoolCache
) -> tuple[list[tuple[str, tuple[int, ...]]], str]:
    """Up to ``n`` valid ``(text, tokens)`` of ``item``, or ``([], reason)`` when none exists."""
    if n == 0:
        return [], ""
    try:
        pool = cache.get(item.item_id, item.spec, vocab, size=n, seed=seed)
    except InstanceFailure as failure:
        return [], failure.reason
    return list(zip(pool.texts, pool.tokens, strict=True)), ""
