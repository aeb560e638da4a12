"""Price every spec of a ``model`` run from a measurement: found, measured on demand, or predicted.

Before a ``model`` run, each distinct spec of its workload is looked up, in this order:

1. the run's grammar profile (the shipped one, or ``costs.grammar_profile``), by the spec's
   content (:attr:`GrammarProfile.spec_contents`) where its backend, vocabulary and engine version
   are the run's, or by the spec's key where the user named the profile;
2. the spec-cost store (:mod:`~cdbench.harness.costs.spec_store`): the target host's entry, else
   another host's, scaled by the ratio of the hosts' benchmark scores
   (:func:`~cdbench.harness.costs.host.time_scale`), or by a probe's measured scales where
   ``costs.spec_host_scale`` names one for that host (:mod:`~cdbench.harness.costs.spec_probe`);
3. what is still missing is measured now (``costs.spec_costs: measure``, the default): compiled once
   and its walked texts timed in isolated worker processes
   (:class:`~cdbench.backends.measure_pool.WorkerPool`, as ``cdbench profile`` does), stored, and
   used; or predicted from the spec's features (``predict``, or where measuring is impossible here:
   the backend is not installed), with the predictor's held-out error; or refused (``strict``).

An engine that reuses work between compiles (xgrammar caches the token masks of rules that schemas
share) compiles a spec faster after related ones, so a spec's compile time alone overstates what a run
pays for it on a corpus of related schemas. For such a backend the run's specs are also compiled one
after another, in the order the run first meets them, on one fresh engine (:func:`measure_sequence`,
stored by the sequence's content), and each spec's compile takes that time.

A spec that no layer prices takes a whole measured spec of its kind (the per-kind fallback); that
only happens when neither measuring nor a predictor is available, and it is counted, like every
other source, in the run's :class:`SpecCoverage` (``summary.json``, the console, the report).

A measurement that fails is kept as the engine would meet it: a compile error, crash, timeout or
out-of-memory aborts the spec's requests (as a compile error does in the engines), and the spec is
listed in :attr:`SpecCoverage.failed`: once per content (a corpus item's cache-distinct copies are one
entry with their count), so the listing is bounded by the corpus, not by the run's length.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime, timezone
from typing import Any, Literal, NamedTuple

import numpy as np
import pandas as pd
from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.registry import shares_compile_work
from cdbench.harness.costs.grammar_profile import (
    CompileMeasurement,
    Distribution,
    GrammarProfile,
    KindProfile,
    WalkMeasurement,
    with_sections,
)
from cdbench.harness.costs.host import CoreShare, HostInfo, load_host, others_share_now, this_host, time_scale
from cdbench.harness.costs.spec_probe import PROBE_PREFIX, SpecHostScale, SpecProbeError
from cdbench.harness.costs.spec_profile import (
    COPY_MARK,
    N_POSITION_BINS,
    InstanceProfile,
    SpecProfile,
    base_key_text,
    base_spec_id,
    instance_key,
    spec_key_hash,
    spec_key_text,
)
from cdbench.harness.costs.spec_store import (
    BatchFillEntry,
    SequenceEntry,
    SpecCostEntry,
    SpecCostStore,
    backend_version,
    batch_digest,
    instance_base,
    sequence_digest,
    spec_digest,
)
from cdbench.workloads.generator import original_of_copy
from cdbench.workloads.instances import spec_hash

SpecCostsMode = Literal["measure", "predict", "strict"]
SpecSource = Literal["measured_here", "measured_elsewhere", "profile", "predicted", "kind_fallback"]
SPEC_SOURCES: tuple[str, ...] = ("measured_here", "measured_elsewhere", "profile", "predicted", "kind_fallback")
SOURCE_NAMES = {
    "measured_here": "measured on the target host",
    "measured_elsewhere": "measured on another host, scaled",
    "profile": "from the grammar profile",
    "predicted": "predicted from the spec",
    "kind_fallback": "guessed per kind",
}
MAX_WALKED_TEXTS = 8
"""Texts of one spec walked when it is measured (the run's first ones); its other texts take the
spec's measured curve."""
MEASURE_ROLLBACK_EVERY = 4  # as `cdbench profile`: every 4th accepted token is rolled back (timed)


class SpecCostsError(ValueError):
    """A ``model`` run whose specs cannot be priced as asked (``strict`` with unmeasured specs)."""


class SpecCostSettings(BaseModel):
    """How ``model`` mode prices the specs of a run (part of ``costs``).

    ``spec_costs``: ``measure`` (default) measures every spec the store and
    profile lack; ``predict`` never measures and predicts them; ``strict``
    refuses a run with one. ``host``: the host to price for, ``this`` (this
    machine) or a recorded host's id (``cdbench host`` lists them).
    ``spec_store``: the store's folder (default: ``spec_costs`` in the cache
    folder). ``measure_workers``: worker processes measuring at once (default:
    half the CPUs this process may use, so that measurements do not crowd each other).
    ``measure_timeout_s``: a compile still running after this is killed and
    the spec recorded as ``timeout``. ``measure_repeats``: times a run's
    compile sequence is measured (each spec's median counts: one compile of a
    multi-threaded engine on a shared host varies by a third from run to run).
    ``measure_batch_rows``: how many of the run's texts a batch walk advances
    together (:func:`measure_batch_fills`; ``None``: price every fill from the
    spec's walk alone). ``measure_accept_gap_s``: seconds a batch walk's step
    sleeps between its fills and its accepts, as an engine's loop waits for the
    step's forward there (0, the default: none). ``measure_batch_compiles``: a batch
    walk compiles the run's specs ``before`` it walks (the default), or ``between``
    its steps, each where the run meets it, so that later fills meet the caches
    the compiles leave (``reports/spec_costs/out_of_sample.md``). ``spec_host_scale``: ``probe:<file>``
    (``cdbench host --probe-specs``) prices the run for the probe's host, the specs
    measured on the probed host scaled by the probe's compile and fill scales instead of
    the score ratio; ``live-run:<ref>`` prices its compiles at the speed a live or hybrid run of the same
    workload compiled them against the store's run-order sequence
    (:mod:`cdbench.results.live_compile_speed`); either is resolved into a :class:`~.spec_probe.SpecHostScale`
    when the run's configuration is checked; ``None`` (default): the score ratio. ``spec_probe_compile``:
    ``median`` scales every compile by the probe's median ratio, ``by_size`` each compile by
    the probe's ratio at its stored seconds; ``auto`` (default) by size where the probe compiled
    run-order sequences (measured as the run's compiles are), else by the median.
    ``measure_contended``: a store entry of this host measured while other work shared its cores
    (:attr:`~.spec_store._StoreEntry.contended`) is measured again where the cores are freer now
    (``remeasure``, the default, in ``measure`` mode), or priced as it is (``keep``: a given store
    then always gives the same run).
    """

    model_config = ConfigDict(extra="forbid")
    spec_costs: SpecCostsMode = "measure"
    host: str = "this"
    spec_store: str | None = None
    measure_workers: int | None = Field(None, ge=1)
    measure_timeout_s: float = Field(60.0, gt=0)
    measure_repeats: int = Field(3, ge=1)
    measure_batch_rows: int | None = Field(16, ge=1)
    measure_accept_gap_s: float = Field(0.0, ge=0)
    measure_batch_compiles: Literal["before", "between"] = "before"
    spec_host_scale: SpecHostScale | str | None = None
    spec_probe_compile: Literal["auto", "median", "by_size"] = "auto"
    measure_contended: Literal["remeasure", "keep"] = "remeasure"

    @field_validator("spec_host_scale")
    @classmethod
    def _probe_source(cls, value: SpecHostScale | str | None) -> SpecHostScale | str | None:
        if isinstance(value, str) and not any(value.startswith(prefix) and value.removeprefix(prefix)
                                              for prefix in (PROBE_PREFIX, "live-run:")):
            raise ValueError("expected 'probe:<file>' (written by cdbench host --probe-specs) or "
                             "'live-run:<run folder or PACK::RUN>' (a live or hybrid run of the workload)")
        return value

    def host_scale(self) -> SpecHostScale | None:
        """``spec_host_scale`` resolved; a ``probe:`` or ``live-run:`` source must have been read
        (:func:`cdbench.results.run_config.validate_run_config` does) before."""
        if isinstance(self.spec_host_scale, str):
            raise ValueError(f"costs.spec_host_scale {self.spec_host_scale!r} is read when the run's configuration "
                             "is checked (validate_run_config); it was not")
        return self.spec_host_scale

    def store(self) -> SpecCostStore:
        from cdbench._env import cache_dir

        return SpecCostStore(self.spec_store if self.spec_store is not None else cache_dir() / "spec_costs")


class FailedSpec(BaseModel):
    """A spec content whose measurement failed, as :attr:`SpecCoverage.failed` lists it: the label of the
    run's first key with it (a copy ``id#copyN`` named by its item ``id``), how many of the run's spec keys
    have it (an item's copies: one each), and why (status and reason)."""

    model_config = ConfigDict(extra="forbid")
    label: str
    copies: int
    reason: str

    def describe(self) -> str:
        return f"{self.label}: {self.reason}" + (f" ({self.copies:,} copies)" if self.copies > 1 else "")


class _FailedSpecs:
    """The run's failed spec keys gathered by content and reason as they are met (a run of a million
    requests has about 10,000 failed copies of a few dozen items): its entries are bounded by the corpus."""

    def __init__(self) -> None:
        self.by_content: dict[tuple[str, str], list] = {}  # (content, reason) -> [first order, label, copies]

    def add(self, order: int, content: str, label: str, reason: str, copies: int = 1) -> None:
        entry = self.by_content.get((content, reason))
        if entry is None:
            self.by_content[(content, reason)] = [order, label, copies]
            return
        entry[2] += copies
        if order < entry[0]:  # the two pricing paths meet an item's keys out of order: the first one names it
            entry[0], entry[1] = order, label

    def merge(self, other: _FailedSpecs) -> None:
        for (content, reason), (order, label, copies) in other.by_content.items():
            self.add(order, content, label, reason, copies)

    def listed(self) -> list[FailedSpec]:
        """One entry a content and reason, in the order the run first meets them."""
        entries = sorted((order, label, copies, reason) for (_, reason), (order, label, copies)
                         in self.by_content.items())
        return [FailedSpec(label=label, copies=copies, reason=reason) for _, label, copies, reason in entries]


class SpecCoverage(BaseModel):
    """Where a ``model`` run's spec prices came from (``summary.json``'s ``spec_costs``).

    ``specs``/``requests``: how many distinct specs, and structured requests,
    each source priced (:data:`SPEC_SOURCES`). ``measured_now``: specs
    measured for this run, in ``measure_wall_s`` seconds. ``contended``: specs
    priced by measurements taken while other work shared their host's cores
    (:data:`~.spec_store.CONTENDED_PACE`); ``remeasured``: this host's contended
    measurements (specs, a compile sequence, a batch walk) taken again for this
    run because its cores were freer now. ``busy_host``: specs priced by measurements taken while the
    host's other CPUs were mostly busy (:data:`~.spec_store.BUSY_HOST_SHARE`), which their pace cannot
    show and no run measures again. ``failed``: specs
    whose measurement failed, one entry a content (:class:`FailedSpec`: its label, its copies in the run,
    status and reason); their requests abort.
    ``predictor_error``: per kind, the predictor's held-out median relative
    error of compile time and mean fill (only when specs were predicted).
    ``host_scales``: per other host, the factor its times were scaled by (the score ratio);
    ``host_probe``: the probe that scaled one host's times instead (``costs.spec_host_scale``).
    ``compile_order``: for an engine that reuses work between compiles
    (:attr:`~cdbench.backends.base.GrammarBackend.shares_compile_work`), whether
    compile times are each spec's alone or the run's specs compiled one after
    another in the order the run meets them (stored, or measured for this run).
    ``profile_mismatch``: how the run's grammar profile differs from the run
    (backend, engine version, vocabulary), where ``costs.allow_mismatched_profile``
    had it used anyway.
    ``fill_order``: whether the run's texts' fills are each walked alone or
    walked in batch as the run's steps interleave them (stored, or measured now);
    ``accept_order`` the same for their accepts (a batch walk stored before
    accepts were timed in it holds fills alone).
    """

    model_config = ConfigDict(extra="forbid")
    mode: SpecCostsMode
    target_host: str
    specs: dict[str, int]
    requests: dict[str, int]
    measured_now: int = 0
    measure_wall_s: float = 0.0
    contended: int = 0
    remeasured: int = 0
    busy_host: int = 0
    failed: list[FailedSpec] = []
    predictor_error: dict[str, dict[str, float]] = {}
    host_scales: dict[str, float] = {}
    host_probe: str | None = None
    compile_order: Literal["alone", "run order", "run order, measured now"] = "alone"
    fill_order: str = "alone"
    accept_order: str = "alone"
    notes: list[str] = []
    profile_mismatch: str | None = None

    @field_validator("failed", mode="before")
    @classmethod
    def _copies_listed_one_by_one(cls, value: Any) -> Any:
        """A summary saved before failed specs were listed by content (label: reason, one a copy) reads as
        one entry an item and reason."""
        if not isinstance(value, dict):
            return value
        gathered = _FailedSpecs()
        for order, (label, reason) in enumerate(value.items()):
            item = base_spec_id(label)
            gathered.add(order, item, item, reason)
        return gathered.listed()

    @property
    def failed_copies(self) -> int:
        """How many of the run's spec keys failed (every copy of a failed item)."""
        return sum(f.copies for f in self.failed)

    def request_share(self, source: str) -> float:
        total = sum(self.requests.values())
        return self.requests.get(source, 0) / total if total else 0.0

    def rows(self) -> list[tuple[str, int, int, float]]:
        """Per source (:data:`SPEC_SOURCES` order): its name, specs, requests and share of requests."""
        return [(SOURCE_NAMES[s], self.specs.get(s, 0), self.requests.get(s, 0), self.request_share(s))
                for s in SPEC_SOURCES]

    def lines(self) -> list[str]:
        """What a reader must know, one line each (the console prints them)."""
        total_specs, total_requests = sum(self.specs.values()), sum(self.requests.values())
        parts = [f"{SOURCE_NAMES[s]} {self.specs[s]} ({self.request_share(s):.0%} of requests)"
                 for s in SPEC_SOURCES if self.specs.get(s)]
        out = [f"spec costs ({self.mode}, host {self.target_host}): {total_specs} specs, "
               f"{total_requests} structured requests: " + "; ".join(parts)]
        if self.measured_now:
            out.append(f"measured {self.measured_now} specs now in {self.measure_wall_s:.1f} s")
        if self.remeasured:
            out.append(f"{self.remeasured} measurements taken again: measured while other work shared the host's "
                       "cores, which are freer now")
        if self.contended:
            out.append(f"warning: {self.contended} specs priced by measurements taken while other work shared the "
                       "host's cores (their threads waited for a CPU)")
        if self.busy_host:
            out.append(f"note: {self.busy_host} specs priced by measurements taken while the host's other CPUs "
                       "were mostly busy (such measurements ran up to a sixth slower)")
        if self.compile_order != "alone":
            out.append(f"compile times in the run's order ({self.compile_order}): the engine reuses work of "
                       "earlier compiles")
        if self.fill_order != "alone":
            out.append(f"fills walked in batch ({self.fill_order}): a grammar's fills interleaved with the "
                       "other rows' as the run's steps interleave them")
        if self.accept_order != "alone":
            out.append(f"accepts walked in batch ({self.accept_order}): each row's accept timed after the step's "
                       "fills, in the rows' order")
        for host, factor in self.host_scales.items():
            out.append(f"times measured on {host} scaled by {factor:.3f}")
        if self.host_probe:
            out.append(self.host_probe)
        if self.predictor_error:
            errors = ", ".join(f"{k} " + " ".join(f"{name} {value:.0%}" for name, value in e.items())
                               for k, e in sorted(self.predictor_error.items()))
            out.append(f"predicted specs: held-out median |error| {errors}")
        if self.specs.get("kind_fallback"):
            out.append(f"warning: {self.specs['kind_fallback']} specs were priced by a guess per kind "
                       "(nothing measured or predicted them)")
        if self.failed:
            shown = "; ".join(f.describe() for f in self.failed[:5])
            more = f" (and {len(self.failed) - 5} more)" if len(self.failed) > 5 else ""
            copies = self.failed_copies
            keys = f" ({copies:,} spec keys)" if copies != len(self.failed) else ""
            out.append(f"{len(self.failed)} specs{keys} failed to measure, their requests abort: {shown}{more}")
        if self.profile_mismatch:
            out.append(f"warning: {self.profile_mismatch} (costs.allow_mismatched_profile)")
        return out + self.notes


@dataclass(slots=True)
class _RunSpec:
    """One distinct spec of the run, and what prices it (slotted: a run of cache-distinct copies has one a
    request)."""

    key_text: str
    kind: str
    spec_id: str | None
    spec: ConstraintSpec
    original: ConstraintSpec
    digest: str
    texts: list[tuple[int, ...]]
    requests: int
    source: str = "kind_fallback"
    costs: SpecProfile | None = None
    instances: Mapping[str, InstanceProfile] | None = None
    base: str | None = None  # the base text its found instances are keyed under
    compile_scale: float = 1.0  # its measuring host's seconds to the target's: compiles
    fill_scale: float = 1.0  # and fills, accepts, rollbacks
    compile_in_order_s: float | None = None  # its compile after the run's earlier specs (target host seconds)
    batch_fills: dict[tuple[int, ...], list[float | None]] | None = None  # per text, its fills walked in batch
    batch_accepts: dict[tuple[int, ...], list[float | None]] | None = None  # per text, its accepts walked so
    message: str = ""  # why its measurement failed (the entry's message)
    order: int = 0  # its place among the run's keys
    contended: bool = False  # its store entry was measured while other work shared the host's cores
    busy_host: bool = False  # ... or while the host's other CPUs were mostly busy

    @property
    def label(self) -> str:
        return self.spec_id or self.key_text[:60]


Progress = Callable[[str, float], None]


def _scaled(costs: SpecProfile, compile_factor: float, factor: float) -> SpecProfile:
    """``costs`` with its compile × ``compile_factor`` and its fills, accepts and rollbacks × ``factor``."""
    if factor == 1.0 and compile_factor == 1.0:
        return costs

    def mul(x):
        return None if x is None else x * factor

    return costs.model_copy(update={
        "compile_s": None if costs.compile_s is None else costs.compile_s * compile_factor,
        "fill_scale_s": costs.fill_scale_s * factor,
        "fill_outliers_s": [v * factor for v in costs.fill_outliers_s], "accept_s": mul(costs.accept_s),
        "rollback_s": mul(costs.rollback_s), "think_accept_s": mul(costs.think_accept_s)})


def _scaled_instance(instance: InstanceProfile, factor: float) -> InstanceProfile:
    if factor == 1.0:
        return instance
    return instance.model_copy(update={"fill_s": [None if v is None else v * factor for v in instance.fill_s]})


RequestSource = Sequence | Callable[[], Iterable]
"""A run's requests: held, or built anew in order by each call."""


def _requests(source: RequestSource) -> Iterable:
    return source() if callable(source) else source


@dataclass(slots=True)
class _Copies:
    """The copies (``id#copyN``) of one corpus item in a run that does not hold its requests, priced once by
    the item's content in the profile (``key``: the profile's spec): how many (each a key of its own, made
    once), their requests, and the texts they walk."""

    item: str  # the item's key text: the run's instances of its copies are known under it
    key: str
    kind: str
    base: str  # the key text the profile's instances of it are known under
    content: str  # its original's content hash
    keys: int = 0
    requests: int = 0
    texts: set[tuple[int, ...]] = dataclass_field(default_factory=set)


class _SharedCopies:
    """Prices a streamed run's copies by their item's content in ``profile`` as the run's requests are read,
    without a spec record a copy (:func:`price_specs`); the failed ones are counted by content (``failed``).
    A copy of an item the profile did not measure is not shared."""

    def __init__(self, profile: GrammarProfile) -> None:
        self.profile = profile
        self.by_content: dict[str, str] = {}
        for key, content in profile.spec_contents.items():
            self.by_content.setdefault(content, key)
        self.items: dict[str, _Copies | None] = {}  # item key text -> its copies (None: not shared)
        self.failed = _FailedSpecs()

    def take(self, r, text: str, order: int) -> bool:
        """Whether copy ``r`` (key ``text``, the ``order``-th key of the run) is priced here."""
        if r.spec_id is None or COPY_MARK not in r.spec_id:
            return False
        item = spec_key_text(r.spec.kind, base_spec_id(r.spec_id))
        if item not in self.items:
            content = spec_hash(original_of_copy(r.spec))
            key = self.by_content.get(content)
            found = self.profile.specs[key] if key is not None and key in self.profile.specs else None
            # (a profiled spec without an id knows its instances by each copy's own key: priced copy by copy)
            self.items[item] = None if found is None or found.spec_id is None else _Copies(
                item, key, r.spec.kind, spec_key_text(found.kind, base_spec_id(found.spec_id)), content)
        copies = self.items[item]
        if copies is None:
            return False
        copies.keys += 1
        copies.requests += 1
        if r.output_tokens is not None:
            copies.texts.add(r.output_tokens)
        status = self.profile.specs[copies.key].status
        if status not in (None, "ok"):
            self.failed.add(order, copies.content, base_spec_id(r.spec_id), status)
        return True

    def groups(self) -> list[_Copies]:
        return [c for c in self.items.values() if c is not None and c.keys]


def _run_specs(requests: Iterable, backend: str, version: str, vocab: str, options: Mapping[str, Any],
               shared: _SharedCopies | None = None) -> list[_RunSpec]:
    """The run's distinct specs in order of first use (each with its ``order`` among the run's keys), those
    ``shared`` prices left out."""
    found: dict[str, _RunSpec] = {}
    # copies of one corpus item share its original and digest (one object each, not one a copy), keyed by
    # the original's canonical text, which decides both
    originals: dict[str, tuple[ConstraintSpec, str]] = {}
    order = 0
    for r in requests:
        if r.spec is None:
            continue
        text = f"{r.spec.kind}:{r.spec_id}" if r.spec_id is not None else r.spec.canonical()
        spec = found.get(text)
        if spec is None:
            order += 1
            if shared is not None and shared.take(r, text, order):
                continue
            original = original_of_copy(r.spec)
            canonical = original.canonical()
            shared_original = originals.get(canonical)
            if shared_original is None:
                shared_original = originals[canonical] = (original, spec_digest(backend, version, vocab, options,
                                                                                original))
            spec = found[text] = _RunSpec(text, r.spec.kind, r.spec_id, r.spec, *shared_original, [], 0, order=order)
        spec.requests += 1
        if r.output_tokens is not None and r.output_tokens not in spec.texts:
            spec.texts.append(r.output_tokens)
    return list(found.values())


class OrderedSpec(NamedTuple):
    """One spec of a run in its order: its label, its store digest and the spec the run compiles."""

    label: str
    digest: str
    spec: ConstraintSpec


def run_order(requests: Iterable, backend: str, vocab: str, options: Mapping[str, Any] | None = None
              ) -> list[OrderedSpec]:
    """The specs of ``requests`` in the order a run first meets them: the sequence whose compiles the store
    keeps in run order (:func:`~.spec_store.sequence_digest` of their specs keys them)."""
    return [OrderedSpec(s.label, s.digest, s.spec)
            for s in _run_specs(requests, backend, backend_version(backend), vocab, options or {})]


def _from_profile(profile: GrammarProfile, specs: list[_RunSpec], by_key: bool) -> None:
    """Price what ``profile`` measured: by content, and first by key when ``by_key`` (a profile the user
    named is trusted to describe the specs it names: a run's cache-distinct copy of a corpus item has
    the item's content but its own compile, which its key finds)."""
    by_content: dict[str, str] = {}
    for key, content in profile.spec_contents.items():
        by_content.setdefault(content, key)
    hashes: dict[str, str] = {}  # by digest: copies share their original's content hash
    bases: dict[str, str] = {}  # by profile key: copies priced by one item share its base text
    for s in specs:
        key = spec_key_hash(s.key_text) if by_key and spec_key_hash(s.key_text) in profile.specs else None
        if key is None:
            content = hashes.get(s.digest)
            if content is None:
                content = hashes[s.digest] = spec_hash(s.original)
            key = by_content.get(content)
        if key is None or key not in profile.specs:
            continue
        found = profile.specs[key]
        s.source, s.costs, s.instances = "profile", found, profile.instances
        if found.spec_id is None:
            s.base = s.key_text
        else:
            s.base = bases.get(key)
            if s.base is None:
                s.base = bases[key] = spec_key_text(found.kind, base_spec_id(found.spec_id))


def _host_scales(host: HostInfo, target: HostInfo, probe: SpecHostScale | None,
                 compile_s: float | None = None, in_order: bool = False) -> tuple[float, float] | None:
    """The (compile, fill) factors from ``host``'s seconds to ``target``'s: the probe's where it probed
    ``host`` (even one of ``target``'s id: lent hosts of one CPU model and core count share an id; its
    compile factor at ``compile_s`` stored seconds, those of a compile in run order where ``in_order``),
    else the score ratio; ``None`` where ``host`` is ``target`` and no probe scales it."""
    if probe is not None and host.id == probe.measured_on.id:
        factor = probe.order_factor(compile_s) if in_order else probe.compile_factor(compile_s)
        return factor, probe.fill_scale()
    if host.id == target.id:
        return None
    ratio = time_scale(host, target)
    return ratio, ratio


def _from_store(store: SpecCostStore, specs: list[_RunSpec], target: HostInfo, scales: dict[str, float],
                probe: SpecHostScale | None, remeasure: _Remeasure | None = None) -> None:
    """Price ``specs`` not priced yet by their store entries (the target host's, else the first other
    host's, scaled); one that ``remeasure`` wants measured again is left unpriced."""
    for s in specs:
        if s.source != "kind_fallback":
            continue
        entries = store.entries(s.digest)
        if not entries:
            continue
        entry = next((e for e in entries if e.host.id == target.id), entries[0])
        factors = _host_scales(entry.host, target, probe, entry.costs.compile_s)
        s.compile_scale, s.fill_scale = factors or (1.0, 1.0)
        if factors is not None and (probe is None or entry.host.id != probe.measured_on.id):
            scales[entry.host.name] = s.fill_scale
        s.source = "measured_here" if factors is None else "measured_elsewhere"
        s.costs, s.instances, s.base = entry.costs, entry.instances, instance_base(s.digest)
        s.message = entry.message if entry.status != "ok" else ""
        s.contended, s.busy_host = entry.contended, entry.beside_busy_host
        if remeasure is not None and remeasure.wanted(entry):
            s.source = "kind_fallback"  # measured again, then found again


QUIET_SHARE = 0.1
"""Cores are quiet enough to measure again where other work keeps under this share of them busy."""


class _Remeasure:
    """Which of this host's store entries a ``measure`` run takes again: those measured while other work
    shared the host's cores (:attr:`~.spec_store._StoreEntry.contended`), where the cores are quiet now:
    other work keeps under :data:`QUIET_SHARE` of them busy (:func:`~cdbench.harness.costs.host.others_share_now`,
    read once, when first asked). ``taken``: how many entries were asked for again (the copies of a spec
    share one)."""

    def __init__(self, here: HostInfo) -> None:
        self.here = here
        self._now: float | None = None
        self._taken: set[tuple[str, str]] = set()

    @property
    def taken(self) -> int:
        return len(self._taken)

    def wanted(self, entry: SpecCostEntry | SequenceEntry | BatchFillEntry) -> bool:
        if not entry.contended or entry.host.id != self.here.id:
            return False
        if self._now is None:
            self._now = others_share_now()
        if self._now is not None and self._now < QUIET_SHARE:
            self._taken.add((type(entry).__name__, entry.digest))
            return True
        return False


def _pace_note(what: str, entry: SequenceEntry | BatchFillEntry) -> list[str]:
    notes = [f"{what} measured while other work shared the host's cores (it ran at {1 / entry.pace:.0%} of a "
             "core; priced as measured)"] if entry.contended else []
    if entry.beside_busy_host:
        notes.append(f"{what} measured while {entry.host_busy:.0%} of the host's other CPUs were busy (priced "
                     "as measured)")
    return notes


@dataclass(frozen=True)
class _PoolSettings:
    """What the measuring worker pool reads (see :class:`~cdbench.backends.measure_pool.PoolSettings`)."""

    vocab: str
    backend_options: dict[str, dict[str, Any]]
    worker_memory: ByteSize
    workers: int
    compile_timeout_s: float
    walk_timeout_s: float
    plugins: tuple[str, ...] = ()
    rollback_every: int = MEASURE_ROLLBACK_EVERY


@dataclass(frozen=True)
class SpecToMeasure:
    """One spec to measure: its ``label`` (an id, for messages and held-out splits by corpus), the spec,
    and the token texts to walk (at most :data:`MAX_WALKED_TEXTS` are; none: compile only)."""

    label: str
    spec: ConstraintSpec
    texts: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class MeasureOutcome:
    """What :func:`measure_specs` did: specs measured and stored, wall seconds, and why measuring is
    impossible here (``None``: it was possible)."""

    measured: int
    wall_s: float
    impossible: str | None = None


def _entry(result, item: SpecToMeasure, digest: str, backend: str, version: str, vocab: str, host: HostInfo,
           timeout_s: float) -> SpecCostEntry:
    """A worker's :class:`~cdbench.backends.measure_worker.ItemResult` for ``item`` as a store entry."""
    measured = f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ}, model mode's on-demand measurement, " \
               f"{backend} {version}"
    kind, key = item.spec.kind, spec_key_text(item.spec.kind, item.label)
    common = dict(digest=digest, backend=backend, backend_version=version, vocab=vocab, kind=kind,
                  label=item.label, spec=item.spec.canonical(), host=host, measured=measured)
    if result.status != "ok":
        seconds = timeout_s if result.status == "timeout" else 0.0
        costs = SpecProfile(kind=kind, status=result.status, compile_s=seconds)
        return SpecCostEntry(**common, status=result.status, message=result.message, costs=costs)
    t = result.tokens
    index = np.asarray(t.instance, np.int64)
    base = instance_base(digest)
    refused = {i: position for i, position in result.refusals}
    walks = []
    for i, tokens in enumerate(item.texts[:MAX_WALKED_TEXTS]):
        at = np.flatnonzero(index == i)
        if not len(at):
            continue
        # a refused token ends the request, as the engines abort it; a text accepted to its end is not refused
        rejected_at = refused[i] if refused.get(i, len(tokens)) < len(tokens) else None
        rollback = np.array([t.rollback_us[j] for j in at if t.rollback_us[j] is not None], np.float64)
        walks.append(WalkMeasurement(
            item.label, kind, fill_s=np.asarray(t.fill_us, np.float64)[at] / 1e6,
            accept_s=np.asarray(t.accept_us, np.float64)[at] / 1e6, rollback_s=rollback / 1e6,
            forced_tokens=np.asarray(t.forced_tokens, np.int64)[at],
            positions=np.asarray(t.position, np.int64)[at], key=key, instance=instance_key(base, tokens),
            rejected_at=rejected_at))
    compiles = [CompileMeasurement(item.label, kind, "ok", (result.compile_ms or 0.0) / 1e3, key=key)]
    profile = GrammarProfile.from_measurements(backend, vocab, compiles, walks)
    costs = profile.specs[spec_key_hash(key)].model_copy(update={"spec_id": None, "corpus": None})
    return SpecCostEntry(**common, status="ok", message="; ".join(result.warnings)[:500], costs=costs,
                         instances=profile.instances)


def measure_specs(items: Sequence[SpecToMeasure], backend: str, options: Mapping[str, Any], vocab: str,
                  settings: SpecCostSettings, progress: Progress | None = None) -> MeasureOutcome:
    """Measure ``items`` with ``backend`` on this machine, in worker processes (each task on a warmed
    engine without the earlier tasks' cached work, as an engine meets a new spec), and store each entry
    as it comes, so an interrupted measurement keeps what it finished. Items of one content are measured
    once."""
    from cdbench.backends.measure_pool import WorkerPool, default_worker_memory
    from cdbench.backends.measure_worker import Instance, ProfileTask

    version = backend_version(backend)
    store = settings.store()
    host = this_host(store.root)
    workers = settings.measure_workers or max(1, len(os.sched_getaffinity(0)) // 2)
    pool_settings = _PoolSettings(
        vocab=vocab, backend_options={backend: dict(options)}, workers=workers,
        worker_memory=ByteSize(default_worker_memory(workers)),
        compile_timeout_s=settings.measure_timeout_s, walk_timeout_s=max(600.0, settings.measure_timeout_s))
    by_digest: dict[str, SpecToMeasure] = {}
    for item in items:
        by_digest.setdefault(spec_digest(backend, version, vocab, options, item.spec), item)
    jobs = [(backend, ProfileTask("spec-costs", digest, item.spec,
                                  tuple(Instance("", t) for t in item.texts[:MAX_WALKED_TEXTS])))
            for digest, item in by_digest.items()]
    start, done = time.perf_counter(), 0
    stage = f"measuring {len(jobs)} specs ({backend}, {workers} workers)"
    if progress is not None:
        progress(stage, 0.0)
    stored: list[str] = []
    timed: list[tuple[int, int, int]] = []
    with CoreShare() as share, WorkerPool(pool_settings, warm_up=True, pace=True) as pool:
        for result in pool.run(jobs):
            if result.message.startswith("backend construction failed"):
                return MeasureOutcome(done, time.perf_counter() - start, result.message)
            store.put(_entry(result, by_digest[result.item_id], result.item_id, backend, version, vocab, host,
                             settings.measure_timeout_s))
            stored.append(result.item_id)
            if result.sched_ns is not None:
                timed.append(result.sched_ns)
            done += 1
            if progress is not None:
                left = (time.perf_counter() - start) / done * (len(jobs) - done)
                progress(f"{stage}, about {left:.0f} s left", done / len(jobs))
    pace = _pace(share, timed)
    if pace is not None or share.host_busy is not None:  # known once the workers have ended: stored again
        for digest in stored:
            for entry in store.entries(digest):
                if entry.host.id == host.id:
                    store.put(entry.model_copy(update={"pace": pace, "host_busy": share.host_busy}))
    return MeasureOutcome(done, time.perf_counter() - start)


def _pace(share: CoreShare, timed: Sequence[tuple[int, int, int]]) -> float | None:
    """How contended the cores were over a measurement (:meth:`~.host.CoreShare.pace`) whose results' timed
    work ran and waited as ``timed`` says (each result's ``sched_ns``, summed)."""
    return share.pace(*(sum(column) for column in zip(*timed))) if timed else None


def measure_sequence(specs: Sequence[ConstraintSpec], backend: str, options: Mapping[str, Any], vocab: str,
                     settings: SpecCostSettings, progress: Progress | None = None) -> SequenceEntry:
    """Compile ``specs`` one after another on one fresh engine in one worker process, as a run's engine
    meets them, ``settings.measure_repeats`` times, and store each spec's median time
    (:class:`~cdbench.harness.costs.spec_store.SequenceEntry`). A spec whose compile fails in any repeat
    (or crashes, or times out: the worker is replaced, and with it what the engine kept) has ``None``."""
    from cdbench.backends.measure_pool import WorkerPool, default_worker_memory
    from cdbench.backends.measure_worker import ProfileTask

    version = backend_version(backend)
    store = settings.store()
    pool_settings = _PoolSettings(
        vocab=vocab, backend_options={backend: dict(options)}, workers=1,
        worker_memory=ByteSize(default_worker_memory(1)), compile_timeout_s=settings.measure_timeout_s, walk_timeout_s=max(600.0, settings.measure_timeout_s))
    repeats = settings.measure_repeats
    times = np.full((repeats, len(specs)), np.nan)
    stage = (f"compiling {len(specs)} specs in the run's order, {repeats} times ({backend} reuses work "
             "between compiles)")
    if progress is not None:
        progress(stage, 0.0)
    jobs = [(backend, ProfileTask("spec-sequence", str(i), spec)) for i, spec in enumerate(specs)]
    timed: list[tuple[int, int, int]] = []
    with CoreShare() as share:
        for repeat in range(repeats):
            with WorkerPool(pool_settings, pace=True) as pool:  # a fresh engine each time, as a run's engine starts
                for done, result in enumerate(pool.run(jobs), 1):
                    if result.status == "ok" and result.compile_ms is not None:
                        times[repeat, int(result.item_id)] = result.compile_ms / 1e3
                    if result.sched_ns is not None:
                        timed.append(result.sched_ns)
                    if progress is not None:
                        progress(stage, (repeat * len(specs) + done) / (repeats * len(specs)))
    failed = np.isnan(times).any(axis=0)
    median = np.median(np.where(np.isnan(times), 0.0, times), axis=0)
    host = this_host(store.root)
    entry = SequenceEntry(digest=sequence_digest(backend, version, vocab, options, specs), backend=backend,
                          backend_version=version, vocab=vocab, host=host,
                          pace=_pace(share, timed), host_busy=share.host_busy,
                          compile_s=[None if f else float(t) for f, t in zip(failed, median, strict=True)],
                          measured=f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ}")
    store.put_sequence(entry)
    return entry


def _in_run_order(specs: list[_RunSpec], backend: str, version: str, vocab: str, options: Mapping[str, Any],
                  settings: SpecCostSettings, store: SpecCostStore, target: HostInfo,
                  progress: Progress | None, probe: SpecHostScale | None = None,
                  remeasure: _Remeasure | None = None, notes: list[str] | None = None) -> str:
    """Give each spec the store measured alone its compile time after the run's earlier specs (stored,
    or measured now where ``measure``); returns how (:attr:`SpecCoverage.compile_order`). The sequence
    holds every spec of the run, since those a profile prices are compiled in the run too."""
    digest = sequence_digest(backend, version, vocab, options, [s.spec for s in specs])
    entries = store.sequences(digest)
    how = "run order"
    entry = next((e for e in entries if e.host.id == target.id), entries[0]) if entries else None
    if settings.spec_costs == "measure" and (entry is None or (remeasure is not None and remeasure.wanted(entry))):
        entry, how = measure_sequence([s.spec for s in specs], backend, options, vocab, settings, progress), \
            "run order, measured now"
    if entry is None:
        return "alone"
    if notes is not None:
        notes.extend(_pace_note("the run-order compile sequence", entry))
    for s, seconds in zip(specs, entry.compile_s, strict=True):
        if seconds is not None and s.source.startswith("measured") and s.costs is not None \
                and s.costs.status in (None, "ok"):
            s.compile_in_order_s = seconds * (_host_scales(entry.host, target, probe, seconds, in_order=True)
                                              or (1.0, 1.0))[0]
    return how


def _batch_walks(specs: list[_RunSpec], requests: RequestSource) -> list[tuple[int, tuple[int, ...]]]:
    """The run's distinct texts of measured specs as batch walks: (index in ``specs``, tokens), in the order
    the run first meets them. A text that several requests answer with is walked once: the walk prices
    texts, and its length stays bounded by the distinct texts however long the run."""
    if not any(s.source.startswith("measured") for s in specs):
        return []  # (the requests are not read again)
    index = {s.key_text: i for i, s in enumerate(specs)}
    walks: dict[tuple[int, tuple[int, ...]], None] = {}
    for r in sorted((r for r in _requests(requests) if r.spec is not None and r.output_tokens),
                    key=lambda r: (r.arrival_s, r.request_id)):
        i = index[f"{r.spec.kind}:{r.spec_id}" if r.spec_id is not None else r.spec.canonical()]
        if specs[i].source.startswith("measured") and specs[i].costs is not None \
                and specs[i].costs.status in (None, "ok"):
            walks[(i, tuple(r.output_tokens))] = None
    return list(walks)


def measure_batch_fills(specs: Sequence[ConstraintSpec], walks: Sequence[tuple[int, tuple[int, ...]]],
                        backend: str, options: Mapping[str, Any], vocab: str, settings: SpecCostSettings,
                        progress: Progress | None = None) -> BatchFillEntry:
    """Walk a run's texts in one worker as its batches walk them (``settings.measure_batch_rows`` at a
    time, ``settings.measure_repeats`` times) and store each walk's fills and accepts, each position's
    median (:class:`~cdbench.harness.costs.spec_store.BatchFillEntry`)."""
    from cdbench.backends.measure_pool import WorkerPool, default_worker_memory
    from cdbench.backends.measure_worker import BatchWalkTask

    version, store, width = backend_version(backend), settings.store(), settings.measure_batch_rows
    gap = settings.measure_accept_gap_s
    pool_settings = _PoolSettings(
        vocab=vocab, backend_options={backend: dict(options)}, workers=1,
        worker_memory=ByteSize(default_worker_memory(1)), compile_timeout_s=settings.measure_timeout_s,
        walk_timeout_s=max(600.0, settings.measure_timeout_s * len(specs)))
    if progress is not None:
        progress(f"walking the run's {len(walks)} texts {width} at a time, {settings.measure_repeats} times "
                 "(fills and accepts interleaved as in the run's steps)", 0.0)
    compiles = settings.measure_batch_compiles
    task = BatchWalkTask("spec-batch", "walks", tuple(specs), tuple(walks), width, settings.measure_repeats, gap_s=gap,
                         compiles=compiles)
    with CoreShare() as share, WorkerPool(pool_settings, pace=True) as pool:
        result = next(iter(pool.run([(backend, task)])))
    fill_s: list[list[float | None] | None] = [None] * len(walks)
    accept_s: list[list[float | None] | None] = [None] * len(walks)
    tokens = result.tokens
    if result.status == "ok" and tokens.fill_us:
        # a walk times positions 0, 1, ... up to where it ends, so each walk's medians by position are its lists
        medians = pd.DataFrame({"fill": tokens.fill_us, "accept": tokens.accept_us}).div(1e6).groupby(
            [tokens.instance, tokens.position]).median()
        for walk, by_position in medians.groupby(level=0):
            fill_s[walk], accept_s[walk] = by_position["fill"].tolist(), by_position["accept"].tolist()
    if progress is not None:
        progress("walked in batch", 1.0)
    host = this_host(store.root)
    entry = BatchFillEntry(
        digest=batch_digest(backend, version, vocab, options, specs, walks, width, gap, compiles), backend=backend,
        backend_version=version, vocab=vocab, host=host, width=width,
        pace=_pace(share, [result.sched_ns] if result.sched_ns is not None else []), host_busy=share.host_busy,
        fill_s=fill_s, accept_s=accept_s,
        measured=f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ}"
                 + ("" if result.status == "ok" else f", failed: {result.status}: {result.message[:200]}"))
    store.put_batch_fills(entry)
    return entry


def _in_batch(specs: list[_RunSpec], requests: RequestSource, backend: str, version: str, vocab: str,
              options: Mapping[str, Any], settings: SpecCostSettings, store: SpecCostStore, target: HostInfo,
              progress: Progress | None, probe: SpecHostScale | None = None, remeasure: _Remeasure | None = None,
              notes: list[str] | None = None) -> tuple[str, str]:
    """Give each measured spec's texts their fills and accepts walked in batch (stored, or measured now
    where ``measure``: none stored, or this host's walked while other work shared its cores and ``remeasure``
    wants it again); returns how (:attr:`SpecCoverage.fill_order`, :attr:`SpecCoverage.accept_order`).

    Fills come from the target host's entry, else the first other host's (by host id); accepts from the
    first entry that timed them, the target host's first. Where no entry timed accepts (entries of format
    1), ``measure`` walks the texts again here."""
    walks = _batch_walks(specs, requests)
    if not walks:
        return "alone", "alone"
    width = settings.measure_batch_rows
    run_specs = [s.spec for s in specs]
    gap, compiles = settings.measure_accept_gap_s, settings.measure_batch_compiles
    entries = store.batch_fills(batch_digest(backend, version, vocab, options, run_specs, walks, width, gap, compiles))
    new = None
    again = remeasure is not None and any(e.accept_s and remeasure.wanted(e) for e in entries if e.host.id == target.id)
    if (again or not any(e.accept_s for e in entries)) and settings.spec_costs == "measure":
        new = measure_batch_fills(run_specs, walks, backend, options, vocab, settings, progress)
        entries = sorted([e for e in entries if e.host.id != new.host.id] + [new], key=lambda e: e.host.id)
    if not entries:
        return "alone", "alone"
    fills_from = next((e for e in entries if e.host.id == target.id), entries[0])
    if notes is not None:
        notes.extend(_pace_note("the batch walk", fills_from))
    timed = [e for e in entries if e.accept_s]
    accepts_from = next((e for e in timed if e.host.id == target.id), timed[0]) if timed else None
    out = []
    for entry, seconds, field in ((fills_from, fills_from.fill_s, "batch_fills"),
                                  (accepts_from, accepts_from.accept_s if accepts_from else [], "batch_accepts")):
        walked = entry is not None and _attach(specs, walks, seconds, entry.host, target, field, probe)
        out.append("alone" if not walked else f"{width} at a time" + (f", accepts {gap * 1e3:g} ms after the fills"
                                                                     if gap and field == "batch_accepts" else "")
                   + (", specs compiled between its steps" if compiles == "between" else "")
                   + (", measured now" if entry is new else ""))
    return out[0], out[1]


def _attach(specs: list[_RunSpec], walks: Sequence[tuple[int, tuple[int, ...]]],
            timed: Sequence[list[float | None] | None], host: HostInfo, target: HostInfo, field: str,
            probe: SpecHostScale | None = None) -> int:
    """Set each walk's timed seconds (by position, scaled from ``host`` to ``target`` as fills are) on its
    spec's ``field``, keyed by its tokens; returns how many walks were timed."""
    scale = (_host_scales(host, target, probe) or (1.0, 1.0))[1]
    walked = 0
    for (i, tokens), seconds in zip(walks, timed, strict=True):
        if seconds:
            by_text = getattr(specs[i], field) or {}
            by_text[tokens] = [None if v is None else v * scale for v in seconds]
            setattr(specs[i], field, by_text)
            walked += 1
    return walked


def _predict(specs: list[_RunSpec], backend: str, vocab: str, base: GrammarProfile,
             errors: dict[str, dict[str, float]]) -> str | None:
    """Price ``specs`` by the shipped predictor of (backend, vocab); returns why some or all could not be
    (``None``: every one was); those keep the per-kind fallback."""
    from cdbench.harness.costs.spec_predictor import PredictorError, SpecCostPredictor

    try:
        predictor = SpecCostPredictor.builtin(backend, vocab)
    except PredictorError as exc:
        return str(exc)
    refused: dict[str, str] = {}
    for s in specs:
        try:
            guess = predictor.predict(s.original)
        except (PredictorError, ValueError) as exc:
            refused.setdefault(s.kind, str(exc))
            continue
        kp = base.kind(s.kind)
        residual = kp.fill_residual.quantile(np.linspace(0.5 / 64, 1 - 0.5 / 64, 64)) \
            if kp.fill_residual.count else np.ones(1)
        s.costs = SpecProfile(kind=s.kind, status="ok", compile_s=guess.compile_s, fills=1,
                              fill_scale_s=guess.fill_mean_s,
                              fill_curve=list(kp.fill_curve) if kp.fill_curve else [1.0] * N_POSITION_BINS,
                              fill_residual=[float(v) for v in residual / residual.mean()])
        s.source, s.instances = "predicted", None
        errors[s.kind] = {name: value for name, value in (("compile", guess.median_error_compile),
                                                           ("fill", guess.median_error_fill))
                          if np.isfinite(value)}
    return "; ".join(refused.values()) or None


def price_specs(base: GrammarProfile, backend: str, options: Mapping[str, Any], vocab: str,
                requests: RequestSource, settings: SpecCostSettings, named_profile: bool = False,
                progress: Progress | None = None) -> tuple[GrammarProfile, SpecCoverage]:
    """The grammar profile that prices ``requests`` spec by spec, and where each price came from.

    ``requests``: the run's requests, or a function building them anew in order each time it is called
    (a workload that does not hold them: read once, and again only for specs measured by batch walks).
    ``base`` is the run's profile (kind-level shapes, and the specs it
    measured); ``named_profile``: the user named it, so its specs are also
    found by key. Raises :class:`SpecCostsError` for ``strict`` with specs
    that nothing measured.
    """
    return _price_specs(base, backend, options, vocab, requests, settings, named_profile, progress, share=True)


def _price_specs(base: GrammarProfile, backend: str, options: Mapping[str, Any], vocab: str,
                 requests: RequestSource, settings: SpecCostSettings, named_profile: bool,
                 progress: Progress | None, share: bool) -> tuple[GrammarProfile, SpecCoverage]:
    version = backend_version(backend)
    by_content = base.backend == backend and base.vocab == vocab and base.engine_version in (None, version) \
        and not options
    # a run that does not hold its requests (each copy made once) prices its copies by their item, not one by one
    # (a profile the user named prices a copy by its own key where it has it: copy by copy)
    shared = _SharedCopies(base) if share and callable(requests) and by_content and not named_profile else None
    specs = _run_specs(_requests(requests), backend, version, vocab, options, shared)
    store = settings.store()
    probe = settings.host_scale()
    if probe is not None:
        if settings.host not in ("this", probe.host.id):
            raise SpecCostsError(f"costs.spec_host_scale {probe.source} prices for host {probe.host.id}; costs.host "
                                 f"names {settings.host} (leave it 'this' or set it to {probe.host.id})")
        try:
            probe.check(backend, version, vocab, store)
        except SpecProbeError as err:
            raise SpecCostsError(f"costs.spec_host_scale: {err}") from None
        target = probe.host
    else:
        target = this_host(store.root) if settings.host == "this" else load_host(store.root, settings.host)
    if by_content:
        _from_profile(base, specs, by_key=named_profile)
    elif named_profile:
        _from_profile(base, specs, by_key=True)
    scales: dict[str, float] = {}
    remeasure = _Remeasure(this_host(store.root)) \
        if settings.spec_costs == "measure" and settings.measure_contended == "remeasure" else None
    _from_store(store, specs, target, scales, probe, remeasure)
    missing = [s for s in specs if s.source == "kind_fallback"]
    coverage_notes: list[str] = []
    measured_now, wall = 0, 0.0
    errors: dict[str, dict[str, float]] = {}
    if missing and settings.spec_costs == "strict":
        unique = list({s.digest: s for s in reversed(missing)}.values())[::-1]  # copies share their item's
        more = f" and {len(unique) - 20} more" if len(unique) > 20 else ""
        listed = ", ".join(s.label for s in unique[:20]) + more
        raise SpecCostsError(f"costs.spec_costs is 'strict' and {len(unique)} specs ({len(missing)} of the run's "
                             f"{len(specs) + sum(c.keys for c in shared.groups()) if shared else len(specs)} spec keys) have no measurement for {backend} {version} on {vocab}: "
                             f"{listed}; measure them (costs.spec_costs=measure) or predict them "
                             "(costs.spec_costs=predict)")
    if missing and settings.spec_costs == "measure":
        if target.id != this_host(store.root).id or probe is not None:
            coverage_notes.append(f"{len(missing)} specs measured on this machine for host {target.name}, scaled")
        outcome = measure_specs([SpecToMeasure(s.label, s.original, tuple(s.texts)) for s in missing], backend,
                                options, vocab, settings, progress)
        measured_now, wall = outcome.measured, outcome.wall_s
        if outcome.impossible is not None:
            coverage_notes.append(f"cannot measure here ({outcome.impossible[:200]}); predicted instead")
        _from_store(store, specs, target, scales, probe)
        missing = [s for s in specs if s.source == "kind_fallback"]
    if missing:
        why = _predict(missing, backend, vocab, base, errors)
        if why is not None:
            coverage_notes.append(f"no predictor: {why}")
    groups = shared.groups() if shared is not None else []
    if groups and (any(s.source.startswith("measured") for s in specs) or any(
            c.kind not in base.kinds or not base.kinds[c.kind].fill_residual.count for c in groups)):
        # the run's order of compiles and its batch walks take every spec of the run, and a kind the
        # profile lacks is pooled from them all: priced spec by spec (what was measured now is stored)
        return _price_specs(base, backend, options, vocab, requests, settings, named_profile, progress, share=False)
    order = "alone"
    # a profile's compiles were timed in a run (in its order); only the store's were timed alone
    if any(s.source.startswith("measured") for s in specs) and settings.spec_costs != "predict" \
            and shares_compile_work(backend):
        order = _in_run_order(specs, backend, version, vocab, options, settings, store, target, progress, probe,
                              remeasure, coverage_notes)
    fill_order = accept_order = "alone"
    if settings.measure_batch_rows is not None and settings.spec_costs != "predict":
        fill_order, accept_order = _in_batch(specs, requests, backend, version, vocab, options, settings, store,
                                             target, progress, probe, remeasure, coverage_notes)
    failed = _failed(specs)
    if shared is not None:
        failed.merge(shared.failed)
    profile = _run_profile(base, specs, groups)
    spec_counts = {src: sum(s.source == src for s in specs) for src in SPEC_SOURCES}
    request_counts = {src: sum(s.requests for s in specs if s.source == src) for src in SPEC_SOURCES}
    spec_counts["profile"] += sum(c.keys for c in groups)
    request_counts["profile"] += sum(c.requests for c in groups)
    coverage = SpecCoverage(
        mode=settings.spec_costs, target_host=target.name, specs=spec_counts, requests=request_counts,
        measured_now=measured_now, measure_wall_s=wall, failed=failed.listed(), predictor_error=errors,
        host_scales=scales, host_probe=probe.describe() if probe is not None else None, compile_order=order,
        contended=sum(s.contended for s in specs if s.source.startswith("measured")),
        busy_host=sum(s.busy_host for s in specs if s.source.startswith("measured")),
        remeasured=remeasure.taken if remeasure is not None else 0,
        fill_order=fill_order, accept_order=accept_order,
        notes=coverage_notes)
    return profile, coverage


def _failed(specs: list[_RunSpec]) -> _FailedSpecs:
    """The specs whose measurement failed, by content (copies share their original, so its hash is taken
    once an item)."""
    failed, hashes = _FailedSpecs(), {}
    for s in specs:
        if s.costs is None or s.costs.status in (None, "ok"):
            continue
        content = hashes.get(s.digest)
        if content is None:
            content = hashes[s.digest] = spec_hash(s.original)
        label = base_spec_id(s.spec_id) if s.spec_id is not None else s.label
        failed.add(s.order, content, label, f"{s.costs.status}: {s.message[:160]}" if s.message else s.costs.status)
    return failed


def _run_profile(base: GrammarProfile, specs: list[_RunSpec], groups: list[_Copies]) -> GrammarProfile:
    """``base`` with each run spec's priced costs under the run's own keys: a spec's costs under
    its key text, each of its texts' measured fills under the run's instance key of the text; an item's
    copies priced together (``groups``) by the profile's spec (``copies``), their texts' fills as a spec's."""
    own_specs: dict[str, SpecProfile] = {}
    own_instances: dict[str, InstanceProfile] = {}
    for c in groups:
        for tokens in c.texts:
            found = base.instances.get(instance_key(c.base, tokens))
            if found is not None:
                own_instances[instance_key(c.item, tokens)] = found
    for s in specs:
        if s.costs is None:
            continue
        costs = _scaled(s.costs, s.compile_scale, s.fill_scale)
        if s.compile_in_order_s is not None:
            costs = costs.model_copy(update={"compile_s": s.compile_in_order_s})
        own_specs[spec_key_hash(s.key_text)] = costs
        if s.base is not None and (s.instances or s.batch_fills or s.batch_accepts):
            run_base = base_key_text(s.key_text, s.kind, s.spec_id)
            for tokens in s.texts:
                found = (s.instances or {}).get(instance_key(s.base, tokens))
                if found is not None:
                    found = _scaled_instance(found, s.fill_scale)
                batch = (s.batch_fills or {}).get(tokens)
                accepts = (s.batch_accepts or {}).get(tokens)
                if batch is not None or accepts is not None:
                    # walked in batch: its fills there, alone where the batch timed none; its accepts there
                    # (the spec's elsewhere)
                    alone = found.fill_s if found is not None else []
                    fills = alone if batch is None else [
                        b if b is not None else (alone[p] if p < len(alone) else None) for p, b in enumerate(batch)]
                    found = InstanceProfile(spec_id=s.spec_id, walks=1, fill_s=fills, accept_s=accepts or [])
                if found is not None:
                    own_instances[instance_key(run_base, tokens)] = found
    kinds = dict(base.kinds)
    for kind in sorted({s.kind for s in specs if s.costs is not None and s.costs.fill_residual}):
        if kind not in kinds or not kinds[kind].fill_residual.count:
            kinds[kind] = _kind_from_specs([own_specs[spec_key_hash(s.key_text)] for s in specs
                                            if s.kind == kind and s.costs is not None and s.costs.fill_residual])
    return base.model_copy(update={"specs": with_sections(base.specs, own_specs),
                                   "instances": with_sections(base.instances, own_instances), "kinds": kinds,
                                   "copies": {c.item: c.key for c in groups}})


def _kind_from_specs(specs: list[SpecProfile]) -> KindProfile:
    """A kind's shapes from its priced specs, for a kind the base profile did not measure: the kind's
    residual spread, fills, curve and accepts are its specs' own, pooled."""
    curves = np.array([s.fill_curve for s in specs if len(s.fill_curve) == N_POSITION_BINS])
    accepts = [s.accept_s for s in specs if s.accept_s is not None]
    rollbacks = [s.rollback_s for s in specs if s.rollback_s is not None]
    return KindProfile(
        statuses={"ok": len(specs)},
        compile_s=Distribution.from_samples([s.compile_s for s in specs if s.compile_s is not None]),
        fill_s=Distribution.from_samples([s.fill_scale_s for s in specs]),
        accept_s=Distribution.from_samples(accepts), rollback_s=Distribution.from_samples(rollbacks),
        fill_residual=Distribution.from_samples(np.concatenate([s.fill_residual for s in specs])),
        fill_curve=curves.mean(axis=0).tolist() if len(curves) else [])

