"""Fill the spec-cost store from corpora, without a run (``cdbench measure-specs``).

``model`` mode measures a spec the first time a run needs it
(:func:`~cdbench.harness.costs.spec_costs.measure_specs`: a warmed engine
without the earlier specs' cached work, as an engine meets a new spec) and
keeps it in the spec-cost store (:mod:`~cdbench.harness.costs.spec_store`).
The spec-cost predictor must predict what that measurement gives, so it is
fitted on the store's entries (``cdbench fit-predictor``), and
the store must first hold every spec of the corpora it is fitted on. This
module puts them there: it loads the corpus items, skips those the store
already holds for this host, builds each remaining item's oracle texts as
``cdbench profile`` does (:func:`cdbench.profile.sources.oracle_instances`:
validated, tokenized, EOS last, seeded) and measures them, one backend after
another. Each entry is labelled with its item's id, so its corpus can be read
back for held-out splits (:func:`~cdbench.harness.costs.spec_profile.corpus_of`).

Example
-------
>>> fill_store(["regex_from_json_schemas"], ["xgrammar"], "qwen3.6", ".cache/spec_costs",  # doctest: +SKIP
...            limit=20)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cdbench.backends.registry import UnknownBackendError, available_backends
from cdbench.harness.costs.host import HostInfo, this_host
from cdbench.harness.costs.spec_costs import SpecCostSettings, SpecToMeasure, measure_specs
from cdbench.harness.costs.spec_store import SpecCostStore, backend_version, spec_digest
from cdbench.profile import sources

Progress = Callable[[str, float], None]
"""Told a stage's description and the fraction of it done (as :func:`measure_specs` tells its own)."""


@dataclass(frozen=True)
class BackendFill:
    """What filling the store did for one backend.

    ``specs``: the corpora's distinct specs (by store digest); ``held``: those
    the store already held for this host (not measured again); ``statuses``:
    how the measured ones ended (``ok``, ``error``, ``timeout``, ...);
    ``impossible``: why measuring could not start here (``None``: it could).
    """

    backend: str
    version: str
    specs: int
    held: int
    statuses: dict[str, int]
    wall_s: float
    impossible: str | None = None

    @property
    def measured(self) -> int:
        return sum(self.statuses.values())


@dataclass(frozen=True)
class FillReport:
    """What :func:`fill_store` did: the items read, the corpus lines skipped, the items without an oracle
    text (label → reason: measured compile-only), each backend's :class:`BackendFill`, and the host."""

    items: int
    skipped_lines: list[str]
    without_texts: dict[str, str]
    backends: list[BackendFill]
    host: HostInfo


def _held_here(store: SpecCostStore, digest: str, host: HostInfo) -> bool:
    return any(e.host.id == host.id for e in store.entries(digest))


def fill_store(
    corpora: Sequence[str],
    backends: Sequence[str],
    vocab: str,
    store: str | Path,
    *,
    limit: int | None = None,
    instances: int = 2,
    seed: int = 0,
    workers: int = 1,
    compile_timeout_s: float = 60.0,
    progress: Progress | None = None,
) -> FillReport:
    """Measure every spec of ``corpora`` (the first ``limit`` items of each) that ``store`` lacks for this host.

    Each spec walks up to ``instances`` oracle texts (seeded by ``seed``; a
    spec without one is compiled only). Specs are measured as model mode
    measures them, with no backend options, so a run meets these entries.
    Raises :class:`~cdbench.workloads.corpora.UnknownCorpusError`,
    :class:`~cdbench.backends.registry.UnknownBackendError` or
    :class:`~cdbench.backends.vocab.UnknownVocabularyError` for names nothing
    is known by, before anything is measured.
    """
    from cdbench.backends.vocab import load_vocab
    from cdbench.workloads.instances import PoolCache

    unknown = [b for b in backends if b not in available_backends()]
    if unknown:
        raise UnknownBackendError(f"unknown backend {', '.join(map(repr, unknown))}; available: "
                                  f"{', '.join(available_backends())}")
    loaded_vocab = load_vocab(vocab)
    items: list[sources.SourceItem] = []
    skipped: list[str] = []
    for corpus in corpora:
        found, lines = sources.load_items(corpus, limit)
        items.extend(found)
        skipped.extend(lines)
    root = SpecCostStore(store)
    host = this_host(root.root)
    settings = SpecCostSettings(spec_store=str(root.root), measure_workers=workers,
                                measure_timeout_s=compile_timeout_s)

    # Per backend, the corpora's distinct specs (an item of a content measured is its first item) and
    # those this host still lacks; oracle texts are built once for the union, since they do not depend on
    # the backend and are the slow part of a rerun that has little left to measure.
    plans: dict[str, tuple[str, dict[str, sources.SourceItem], dict[str, sources.SourceItem]]] = {}
    for backend in backends:
        version = backend_version(backend)
        distinct: dict[str, sources.SourceItem] = {}
        for item in items:
            distinct.setdefault(spec_digest(backend, version, vocab, {}, item.spec), item)
        missing = {d: item for d, item in distinct.items() if not _held_here(root, d, host)}
        plans[backend] = (version, distinct, missing)
    wanted = list({id(item): item for _, _, missing in plans.values() for item in missing.values()}.values())
    texts: dict[int, tuple[tuple[int, ...], ...]] = {}
    without: dict[str, str] = {}
    cache = PoolCache()
    for i, item in enumerate(wanted):
        if progress is not None:
            progress(f"oracle texts ({len(wanted)} specs)", i / len(wanted))
        found, reason = sources.oracle_instances(item, loaded_vocab, instances, seed, cache)
        texts[id(item)] = tuple(tokens for _, tokens in found)
        if not found and instances:
            without[item.item_id] = reason

    fills = []
    for backend, (version, distinct, missing) in plans.items():
        start = time.perf_counter()
        impossible = None
        if missing:
            to_measure = [SpecToMeasure(item.item_id, item.spec, texts[id(item)]) for item in missing.values()]
            impossible = measure_specs(to_measure, backend, {}, vocab, settings, progress).impossible
        statuses = Counter(e.status for d in missing for e in root.entries(d) if e.host.id == host.id)
        fills.append(BackendFill(backend, version, len(distinct), len(distinct) - len(missing),
                                 dict(statuses.most_common()), time.perf_counter() - start, impossible))
    return FillReport(len(items), skipped, without, fills, host)
