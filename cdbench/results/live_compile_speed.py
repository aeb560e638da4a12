"""A live (or hybrid) run's compile speed against a spec-cost store's, for pricing a model run at the speed
its host compiled at: ``costs.spec_host_scale=live-run:<ref>``.

A store's run-order sequence (:class:`~cdbench.harness.costs.spec_store.SequenceEntry`) is measured on its
host at one time; the same host compiles the same sequence 10-20 % faster or slower minutes later, the same
for every spec (``reports/fidelity/live_vs_model.md``, "The store's sequence against live, one run after
another"). A run that compiled a workload's specs in its own process measured them at the speed of its own
time: each spec's compile there (its in-situ profile's ``compile_by_spec``) over the store's run-order
sequence of the same workload gives a :class:`~cdbench.harness.costs.spec_probe.SpecHostScale` of the shape a
probe gives (:mod:`cdbench.harness.costs.spec_probe`), so a model run of that store prices its compiles at
the run's speed: by size (``costs.spec_probe_compile`` ``auto`` or ``by_size``: each compile by the ratio at
its stored seconds) or by the median ratio (``median``). Fills, accepts and rollbacks are priced as the store
measured them: the run's host is taken to be the store's (lent hosts of one CPU model and core count share a
host id).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from cdbench.harness.costs.grammar_profile import GrammarProfile
from cdbench.harness.costs.host import this_host
from cdbench.harness.costs.spec_costs import run_order
from cdbench.harness.costs.spec_probe import (
    MIN_PROBE_SPECS,
    ProbedSpec,
    ProbeScale,
    SpecHostScale,
    compile_curve,
)
from cdbench.harness.costs.spec_store import backend_version, sequence_digest
from cdbench.results.errors import ResultsError
from cdbench.results.live_loop_costs import LIVE_RUN_PREFIX
from cdbench.results.run_folder import GRAMMAR_PROFILE_FILE, WORKLOAD_TRACE_FILE

if TYPE_CHECKING:
    from cdbench.harness.costs.spec_costs import SpecCostSettings


def live_compile_scale(ref: str, settings: SpecCostSettings, backend: str, vocab: str,
                       options: Mapping[str, Any] | None = None, by_size: bool = True) -> SpecHostScale:
    """The compile scale of the live or hybrid run ``ref`` (a run folder or ``PACK::RUN``) against the run-order
    sequence that ``settings``' store holds for the same workload's specs (of ``settings.host``; ``this``: this
    machine's entry, else the store's only one), compiled by ``backend`` on ``vocab``; each compile by its size
    (``by_size``) or by the median. :class:`ResultsError` naming ``ref`` and the reason when the run, its
    profile or trace, or the store's sequence cannot give one."""
    from cdbench.results.pack import open_run
    from cdbench.workloads.trace import TraceError, loads_trace

    run = open_run(ref)
    mode = run.config.get("mode")
    if mode not in ("live", "hybrid"):
        raise ResultsError(f"{ref} is a {mode} run: it compiled no spec itself (a live or hybrid run's compiles "
                           "give a compile speed)")
    raw_profile, raw_trace = run.read_file(GRAMMAR_PROFILE_FILE), run.read_file(WORKLOAD_TRACE_FILE)
    if raw_profile is None or raw_trace is None:
        missing = GRAMMAR_PROFILE_FILE if raw_profile is None else WORKLOAD_TRACE_FILE
        raise ResultsError(f"{ref} kept no {missing}: its compiles cannot be matched to the store's")
    try:
        profile = GrammarProfile.model_validate_json(raw_profile)
        requests = loads_trace(raw_trace).workload.requests
    except (ValidationError, TraceError) as err:
        raise ResultsError(f"{ref}: its {GRAMMAR_PROFILE_FILE} or {WORKLOAD_TRACE_FILE} does not read: "
                           f"{str(err).splitlines()[0]}") from None
    version = backend_version(backend)
    if (profile.backend, profile.vocab) != (backend, vocab) or profile.engine_version not in (None, version):
        raise ResultsError(f"{ref} compiled with {profile.backend} {profile.engine_version or '?'} on "
                           f"{profile.vocab}; this run prices {backend} {version} on {vocab}")
    ordered = run_order(requests, backend, vocab, options)
    store = settings.store()
    digest = sequence_digest(backend, version, vocab, options or {}, [o.spec for o in ordered])
    entries = store.sequences(digest)
    host = this_host(store.root).id if settings.host == "this" else settings.host
    entry = next((e for e in entries if e.host.id == host), None)
    if entry is None and settings.host == "this" and entries:  # another host's: only where it is the one
        if len(entries) > 1:
            raise ResultsError(f"{store.root} holds {ref}'s run-order sequence from hosts "
                               f"{', '.join(e.host.id for e in entries)}, none this machine's: name one (costs.host)")
        entry = entries[0]
    if entry is None:
        raise ResultsError(f"{store.root} holds no run-order sequence of {ref}'s {len(ordered)} specs "
                           f"({backend} {version} on {vocab}, sequence {digest}"
                           + ("" if settings.host == "this" else f", host {settings.host}")
                           + "); a model run of that workload measures one (costs.spec_costs=measure)")
    specs = [ProbedSpec(digest=o.digest, label=o.label, there_s=there, here_s=profile.compile_by_spec[o.label])
             for o, there in zip(ordered, entry.compile_s, strict=True)
             if there and profile.compile_by_spec.get(o.label)]
    if len(specs) < MIN_PROBE_SPECS:
        raise ResultsError(f"{ref} compiled {len(specs)} of the sequence's {len(ordered)} specs that the store "
                           f"timed too; a compile speed needs {MIN_PROBE_SPECS}")
    scale = ProbeScale.of([s.here_s / s.there_s for s in specs])
    curve = compile_curve(specs) if by_size else []  # (every compile of the run is one in run order)
    return SpecHostScale(source=f"{LIVE_RUN_PREFIX}{ref}", backend=backend, backend_version=version, vocab=vocab,
                         measured_on=entry.host, host=entry.host, compile=scale, there={}, compile_by_size=curve,
                         compile_order=scale, order_by_size=curve, sequences=[digest])


__all__ = ["live_compile_scale"]
