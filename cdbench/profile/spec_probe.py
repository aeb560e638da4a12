"""Measure a spec-cost probe (``cdbench host --probe-specs``): a host's stored specs compiled again here.

What a probe is, which specs it takes and how a run prices with it: :mod:`cdbench.harness.costs.spec_probe`.
This module measures one, with model mode's own measuring code
(:func:`~cdbench.harness.costs.spec_costs.measure_specs`), as :mod:`.fill_store` fills a store.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from cdbench.harness.costs.spec_costs import (
    SpecCostSettings,
    SpecToMeasure,
    measure_sequence,
    measure_specs,
    run_order,
)
from cdbench.harness.costs.spec_probe import (
    MIN_PROBE_SPECS,
    PROBE_SPECS,
    TEXTS_PER_SPEC,
    ProbedSequence,
    ProbedSpec,
    ProbedWalk,
    ProbeScale,
    SpecProbe,
    SpecProbeError,
    choose_specs,
    entry_spec,
    host_entries,
)
from cdbench.harness.costs.spec_profile import instance_key
from cdbench.harness.costs.spec_store import (
    SpecCostEntry,
    SpecCostStore,
    backend_version,
    instance_base,
    sequence_digest,
    spec_digest,
)
from cdbench.workloads.generator import original_of_copy


def stored_texts(entries: Sequence[SpecCostEntry], requests: Sequence) -> dict[str, list[tuple[int, ...]]]:
    """Per entry digest, up to :data:`TEXTS_PER_SPEC` of ``requests``' answers that the entry walked (its
    instances are keyed by their tokens, so a trace of the run that measured it supplies them)."""
    wanted = {e.digest: e for e in entries}
    versions = {(e.backend, e.backend_version, e.vocab) for e in entries}
    out: dict[str, list[tuple[int, ...]]] = {}
    digests: dict[str, str] = {}
    for r in requests:
        if r.spec is None or not r.output_tokens:
            continue
        canonical = r.spec.canonical()
        if canonical not in digests:
            original = original_of_copy(r.spec)
            digests[canonical] = next((d for d in (spec_digest(b, v, vo, {}, original) for b, v, vo in versions)
                                       if d in wanted), "")
        digest = digests[canonical]
        texts = out.setdefault(digest, []) if digest else None
        tokens = tuple(r.output_tokens)
        if texts is not None and len(texts) < TEXTS_PER_SPEC and tokens not in texts \
                and instance_key(instance_base(digest), tokens) in wanted[digest].instances:
            texts.append(tokens)
    return {d: t for d, t in out.items() if t}


def _walk_sums(there: Sequence[float | None], here: Sequence[float | None]) -> tuple[int, float, float]:
    both = [(a, b) for a, b in zip(there, here, strict=False) if a is not None and b is not None]
    return len(both), sum(a for a, _ in both), sum(b for _, b in both)


def probe_sequence(store: SpecCostStore, host_id: str, backend: str, vocab: str, requests: Sequence,
                   settings: SpecCostSettings, progress: Callable[[str, float], None] | None = None
                   ) -> ProbedSequence:
    """Compile the run order of ``requests`` (a trace) here as the store compiled it on ``host_id``
    (:func:`~cdbench.harness.costs.spec_costs.measure_sequence`, ``settings.measure_repeats`` times, into
    ``settings``' store); :class:`SpecProbeError` when ``store`` holds no such sequence of that host."""
    ordered = run_order(requests, backend, vocab)
    digest = sequence_digest(backend, backend_version(backend), vocab, {}, [o.spec for o in ordered])
    there = next((e for e in store.sequences(digest) if e.host.id == host_id), None)
    if there is None:
        raise SpecProbeError(f"{store.root}: no run-order sequence of host {host_id} for the trace's {len(ordered)} "
                             f"specs ({backend} {backend_version(backend)} on {vocab}, sequence {digest}); a model "
                             "run of that trace on that host measures one")
    here = measure_sequence([o.spec for o in ordered], backend, {}, vocab, settings, progress)
    return ProbedSequence(digest=digest, specs=[
        ProbedSpec(digest=o.digest, label=o.label, there_s=a, here_s=b if a is not None else None)
        for o, a, b in zip(ordered, there.compile_s, here.compile_s, strict=True) if a is not None])


def probe_specs(store: SpecCostStore, host_id: str, backend: str, vocab: str, requests: Sequence = (),
                n: int = PROBE_SPECS, workers: int | None = None, timeout_s: float = 60.0,
                progress: Callable[[str, float], None] | None = None,
                sequences: Sequence[Sequence] = ()) -> SpecProbe:
    """Compile :func:`choose_specs` of ``host_id``'s entries in ``store`` here, walk the stored texts of
    them that ``requests`` (a trace of the run that measured them) holds, compile each of ``sequences``
    (traces) in run order (:func:`probe_sequence`), and return the probe
    (:class:`~cdbench.harness.costs.spec_probe.SpecProbe`).

    Measured with :func:`~cdbench.harness.costs.spec_costs.measure_specs` into a scratch store, so ``store`` is left as it was."""
    entries = host_entries(store, host_id, backend, vocab)
    if len(entries) < MIN_PROBE_SPECS:
        raise SpecProbeError(f"{store.root}: {len(entries)} compiled specs of host {host_id} for {backend} "
                             f"{backend_version(backend)} on {vocab} without backend options; a probe needs "
                             f"{MIN_PROBE_SPECS}")
    chosen = choose_specs(entries, n)
    texts = stored_texts(chosen, requests)
    with tempfile.TemporaryDirectory(prefix="cdbench-spec-probe-") as scratch:
        settings = SpecCostSettings(spec_store=scratch, measure_workers=workers, measure_timeout_s=timeout_s)
        outcome = measure_specs([SpecToMeasure(e.label, entry_spec(e), tuple(texts.get(e.digest, ()))) for e in chosen],
                                backend, {}, vocab, settings, progress)
        if outcome.impossible is not None:
            raise SpecProbeError(f"cannot measure {backend} here: {outcome.impossible[:300]}")
        here = {e.digest: next(iter(SpecCostStore(scratch).entries(e.digest)), None) for e in chosen}
        probed = [probe_sequence(store, host_id, backend, vocab, trace, settings, progress) for trace in sequences]
    specs, walks = [], []
    for e in chosen:
        mine = here[e.digest]
        ok = mine is not None and mine.status == "ok" and mine.costs.compile_s
        specs.append(ProbedSpec(digest=e.digest, label=e.label, there_s=e.costs.compile_s,
                                here_s=mine.costs.compile_s if ok else None))
        for tokens in texts.get(e.digest, []) if ok else []:
            key = instance_key(instance_base(e.digest), tokens)
            if key in mine.instances:
                positions, there_s, here_s = _walk_sums(e.instances[key].fill_s, mine.instances[key].fill_s)
                if positions and there_s > 0 and here_s > 0:
                    walks.append(ProbedWalk(digest=e.digest, instance=key, positions=positions, there_s=there_s,
                                            here_s=here_s))
    compiled = [s.here_s / s.there_s for s in specs if s.here_s is not None]
    if len(compiled) < MIN_PROBE_SPECS:
        raise SpecProbeError(f"{store.root}: {len(compiled)} of the {len(specs)} probed specs of host {host_id} "
                             f"compiled here; a probe needs {MIN_PROBE_SPECS}")
    fill = ProbeScale.of([w.here_s / w.there_s for w in walks]) if len(walks) >= MIN_PROBE_SPECS else None
    host = next(e.host for e in here.values() if e is not None)  # this host, as the scratch store recorded it
    in_order = [s.here_s / s.there_s for sequence in probed for s in sequence.specs if s.here_s is not None]
    if probed and len(in_order) < MIN_PROBE_SPECS:
        raise SpecProbeError(f"{store.root}: {len(in_order)} specs of the probed sequences compiled on both hosts; "
                             f"a probe needs {MIN_PROBE_SPECS}")
    return SpecProbe(store=str(store.root), backend=backend, backend_version=backend_version(backend), vocab=vocab,
                     measured_on=chosen[0].host, host=host, specs=specs, walks=walks,
                     compile=ProbeScale.of(compiled), fill=fill,
                     compile_total=sum(s.here_s for s in specs if s.here_s is not None)
                     / sum(s.there_s for s in specs if s.here_s is not None),
                     sequences=probed, compile_order=ProbeScale.of(in_order) if probed else None,
                     measured=f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}, {outcome.measured} specs in "
                              f"{outcome.wall_s:.1f} s")


__all__ = ["probe_sequence", "probe_specs", "stored_texts"]
