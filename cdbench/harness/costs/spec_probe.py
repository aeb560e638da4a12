"""How fast this host compiles and walks grammars against the host that measured a spec-cost store: a probe.

The host benchmark (:mod:`.host`) carries a median single-threaded compile between hosts, but not a
large multi-threaded one: on a lent GPU host of the same CPU model as the store's host, the saturated
Github_hard specs compiled 21 % slower than the store's times while the benchmark score said 32 % faster
(``reports/spec_costs/out_of_sample.md``). A probe measures the scale instead of inferring it: it takes a
small fixed set of one host's stored specs spanning their compile times (:func:`choose_specs`), measures
them here exactly as the store measured them (:func:`cdbench.profile.spec_probe.probe_specs`, with
:func:`~.spec_costs.measure_specs`: the same workers, a warmed engine per spec, the same walk), and keeps
per spec the two compile times and per walked text the two fill sums. The scale is the median of the
ratios (here over there), its spread the half-width of their interquartile range, as a forward probe's
(:mod:`.forward_speed`).

``costs.spec_host_scale: probe:<file>`` then prices a run for the probe's host: specs the store measured
on the probed host take the probe's compile scale for their compiles and its fill scale for their fills,
accepts and rollbacks, in place of the score ratio (:class:`SpecHostScale`, resolved when the run's
configuration is checked, so its ``config.yaml`` reruns without the file).

A compile's ratio depends on its size where the hosts differ in cores: xgrammar spreads a large grammar's
compile over the cores and a small one's not, so on a GPU host's 16 cores compiles the store priced under
0.2 s on 4 cores ran 1.17x as long and those above 0.7x. ``costs.spec_probe_compile: by_size`` scales a
compile by the probe's ratio at its stored seconds (:func:`compile_curve`: each probed spec's ratio
smoothed with its neighbours', interpolated in log seconds, flat beyond the probed range). It carries the
probe's conditions exactly, which is only right where the probe's compiles ran as the target's will: a
probe compiling one spec at a time on a whole host prices a run's large compiles too short
(``reports/spec_costs/out_of_sample.md``), so without run-order sequences (below) the default, ``auto``,
takes the one median ratio.

A store prices xgrammar's compiles in run order (a :class:`~.spec_store.SequenceEntry`: the run's specs
compiled one after another on one engine, which reuses work between them), and a spec compiled in a
sequence does not scale between hosts as it does alone: on an H100 host's 16 cores, live runs compiled
in the store's run order as fast as its 4 cores for small specs and 0.6x for large ones, where the same
specs compiled alone took 0.75x and 0.32x (``reports/spec_costs/out_of_sample.md``, "A probe in run
order"). A probe given traces with ``order`` therefore also compiles each trace's sequence here as the
store did (:class:`ProbedSequence`), and a run's compiles in run order take that sequence's scale
(:meth:`SpecHostScale.order_factor`): by size (the curve through every sequenced spec; ``auto``'s choice
for such a probe), else its median.

>>> [round(q, 3) for q in _quantiles(4)]
[0.125, 0.375, 0.625, 0.875]
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cdbench._files import read_probe_file
from cdbench.backends.base import ConstraintSpec
from cdbench.harness.costs.host import HostInfo
from cdbench.harness.costs.spec_store import (
    SpecCostEntry,
    SpecCostStore,
    backend_version,
    spec_digest,
)

PROBE_PREFIX = "probe:"
PROBE_SPECS = 12
"""Specs a probe compiles by default: one at the middle of each of 12 equal slices of the stored compile times."""
MIN_PROBE_SPECS = 4
"""Fewest specs (and walked texts, for a fill scale) a probe's scale is taken from."""
TEXTS_PER_SPEC = 2
"""Stored texts of one chosen spec walked again (the first ones the trace holds)."""


class SpecProbeError(ValueError):
    """A probe that cannot be measured, read or applied (the message names the store or file and the reason)."""


class ProbeScale(BaseModel):
    """Here over there: the median of the ratios, half their interquartile range, and how many there were."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    scale: float = Field(gt=0)
    spread: float = Field(ge=0)
    count: int = Field(ge=1)

    @classmethod
    def of(cls, ratios: Sequence[float]) -> ProbeScale:
        q1, median, q3 = np.percentile(np.asarray(ratios, float), [25, 50, 75])
        return cls(scale=float(median), spread=float(q3 - q1) / 2.0, count=len(ratios))

    def describe(self, what: str) -> str:
        return f"× {self.scale:.3f} (±{self.spread:.3f}, {self.count} {what})"


class ProbedSpec(BaseModel):
    """One chosen spec: its store digest and label, its stored compile seconds there and its compile here."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    digest: str
    label: str
    there_s: float
    here_s: float | None = Field(description="None: its compile failed here")


class ProbedWalk(BaseModel):
    """One stored text of a chosen spec walked again: the sums of its fills there and here over the positions
    both timed."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    digest: str
    instance: str
    positions: int
    there_s: float
    here_s: float


class ProbedSequence(BaseModel):
    """A stored run-order sequence compiled again here: its store digest and each spec's seconds there and
    here (:class:`ProbedSpec`, in the run's order; a spec that failed on either host has ``here_s`` ``None``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    digest: str
    specs: list[ProbedSpec]


class SpecProbe(BaseModel):
    """A probe's file (``cdbench host --probe-specs``): the store's host, this host, what was timed, the scales."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format_version: Literal[1] = 1
    store: str = Field(description="the store probed (as given)")
    backend: str
    backend_version: str
    vocab: str
    measured_on: HostInfo = Field(description="the host whose stored specs were compiled again here")
    host: HostInfo = Field(description="the host the probe ran on: the host it prices for")
    specs: list[ProbedSpec]
    walks: list[ProbedWalk] = []
    compile: ProbeScale
    fill: ProbeScale | None = Field(None, description="None: no stored text was walked (no trace given, or none "
                                    "of its texts matched); fills then scale by the score ratio")
    compile_total: float = Field(gt=0, description="the compiled specs' seconds here over there, summed: the "
                                 "slow specs' ratio, beside the median's typical one")
    sequences: list[ProbedSequence] = Field([], description="stored run-order sequences compiled again here")
    compile_order: ProbeScale | None = Field(None, description="the sequences' specs' ratios; None: no sequence")
    measured: str


class SpecHostScale(BaseModel):
    """``costs.spec_host_scale`` resolved from a probe: what a run needs of it, with its source."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str = Field(description="probe:<file>")
    backend: str
    backend_version: str
    vocab: str
    measured_on: HostInfo
    host: HostInfo
    compile: ProbeScale
    fill: ProbeScale | None = None
    there: dict[str, float] = Field(description="the probed specs' stored compile seconds by digest (checked "
                                    "against the run's store: a probe of another store is refused)")
    compile_by_size: list[tuple[float, float]] = Field(
        [], description="(stored compile seconds, ratio) points a compile's factor is interpolated through "
        "(compile_curve); empty: every compile takes the median `compile.scale`")
    compile_order: ProbeScale | None = Field(None, description="compiles in run order: the probed sequences' "
                                             "scale; None: they take the compile factor")
    order_by_size: list[tuple[float, float]] = Field(
        [], description="(stored seconds in run order, ratio) points of the sequences' specs (compile_curve); "
        "empty: the median `compile_order.scale`")
    sequences: list[str] = Field([], description="the probed sequences' digests (checked against the run's store)")

    def compile_factor(self, there_s: float | None) -> float:
        """The factor of a compile that took ``there_s`` seconds on the probed host: the curve's value there
        (its end values beyond the probed range), else the median."""
        return _at_size(self.compile_by_size, there_s, self.compile.scale)

    def order_factor(self, there_s: float | None) -> float:
        """The factor of a compile in run order that took ``there_s`` seconds in the probed host's sequence:
        the probed sequences' curve or median, else :meth:`compile_factor`."""
        if self.compile_order is None:
            return self.compile_factor(there_s)
        return _at_size(self.order_by_size, there_s, self.compile_order.scale)

    def fill_scale(self) -> float:
        """The fills' factor: the probe's, else the hosts' score ratio."""
        return self.fill.scale if self.fill is not None else self.measured_on.score / self.host.score

    def describe(self) -> str:
        """One line: what is scaled by what, and where the scale came from."""
        fill = self.fill.describe("texts") if self.fill is not None else \
            f"× {self.fill_scale():.3f} (the score ratio: the probe walked no text)"
        compile_ = self.compile.describe("specs")
        if self.compile_by_size:
            compile_ = f"by size, {_span(self.compile_by_size)} (median {compile_})"
        order = ""
        if self.compile_order is not None:
            order = f", in run order {self.compile_order.describe('sequenced specs')}"
            if self.order_by_size:
                order += f" by size ({_span(self.order_by_size)})"
        return (f"specs measured on {self.measured_on.id} priced for {self.host.id} ({self.host.name}) by "
                f"{self.source}: compile {compile_}{order}, fill {fill}")

    def check(self, backend: str, version: str, vocab: str, store: SpecCostStore) -> None:
        """:class:`SpecProbeError` naming the probe when it probed another backend, engine version or
        vocabulary than the run's, or specs ``store`` does not hold as it measured them."""
        if (self.backend, self.backend_version, self.vocab) != (backend, version, vocab):
            raise SpecProbeError(f"{self.source} probed {self.backend} {self.backend_version} on {self.vocab}; this "
                                 f"run prices {backend} {version} on {vocab}")
        for digest, there in self.there.items():
            entry = next((e for e in store.entries(digest) if e.host.id == self.measured_on.id), None)
            if entry is None or entry.costs.compile_s != there:
                what = "holds no entry" if entry is None else f"holds {entry.costs.compile_s} s, not {there} s,"
                raise SpecProbeError(f"{self.source} probed another store: {store.root} {what} for spec {digest} "
                                     f"of host {self.measured_on.id}")
        for digest in self.sequences:
            if not any(e.host.id == self.measured_on.id for e in store.sequences(digest)):
                raise SpecProbeError(f"{self.source} probed another store: {store.root} holds no run-order sequence "
                                     f"{digest} of host {self.measured_on.id}")


def _at_size(curve: Sequence[tuple[float, float]], there_s: float | None, median: float) -> float:
    """``curve``'s ratio at ``there_s`` stored seconds, interpolated in log seconds (its end values beyond it);
    ``median`` without a curve or a stored time."""
    if not curve or there_s is None or there_s <= 0:
        return median
    x, y = zip(*curve, strict=True)
    return float(np.interp(math.log(there_s), np.log(x), y))


def _span(curve: Sequence[tuple[float, float]]) -> str:
    """A curve's ends: its ratio at its shortest and at its longest stored compile."""
    (lo_s, lo), (hi_s, hi) = curve[0], curve[-1]
    return f"× {lo:.3f} at {lo_s * 1e3:.3g} ms to × {hi:.3f} at {hi_s:.3g} s"


def _quantiles(n: int) -> list[float]:
    return [(i + 0.5) / n for i in range(n)]


def host_entries(store: SpecCostStore, host_id: str, backend: str, vocab: str) -> list[SpecCostEntry]:
    """``host_id``'s compiled specs in ``store`` for ``backend`` (at the version installed here, with no
    backend options) and ``vocab``: those a probe can compile again as they were, by digest."""
    version = backend_version(backend)
    out = []
    for path in sorted(store.root.glob(f"*/*/{host_id}.json")) if store.root.is_dir() else ():
        entry = store.entries(path.parent.name)
        entry = next(e for e in entry if e.host.id == host_id)
        if (entry.backend, entry.backend_version, entry.vocab) != (backend, version, vocab) \
                or entry.status != "ok" or not entry.costs.compile_s or not entry.spec:
            continue
        if spec_digest(backend, version, vocab, {}, entry_spec(entry)) == entry.digest:  # measured without options
            out.append(entry)
    return out


def entry_spec(entry: SpecCostEntry) -> ConstraintSpec:
    """The spec a store entry measured, from its canonical text."""
    data = json.loads(entry.spec)
    return ConstraintSpec(data["kind"], data["spec"], data.get("options", {}))


def choose_specs(entries: Sequence[SpecCostEntry], n: int = PROBE_SPECS) -> list[SpecCostEntry]:
    """``n`` of ``entries`` spanning their compile times: ordered by (compile seconds, digest), the one at
    the middle of each of ``n`` equal slices (fewer where entries are fewer). Deterministic for a store."""
    ranked = sorted(entries, key=lambda e: (e.costs.compile_s, e.digest))
    if len(ranked) <= n:
        return ranked
    picks = dict.fromkeys(min(len(ranked) - 1, math.floor(q * len(ranked))) for q in _quantiles(n))
    return [ranked[i] for i in picks]


def compile_curve(specs: Sequence[ProbedSpec]) -> list[tuple[float, float]]:
    """(stored seconds, ratio) through the probed specs that compiled on both hosts, ordered by stored
    seconds, each ratio the median of its own and its two neighbours' (one odd spec does not bend the
    curve); empty with fewer than :data:`MIN_PROBE_SPECS` of them.

    >>> specs = [ProbedSpec(digest=str(i), label="", there_s=t, here_s=t * r)
    ...          for i, (t, r) in enumerate([(0.01, 1.2), (0.1, 1.1), (1.0, 2.0), (10.0, 0.7)])]
    >>> [(t, round(r, 2)) for t, r in compile_curve(specs)]
    [(0.01, 1.15), (0.1, 1.2), (1.0, 1.1), (10.0, 1.35)]
    """
    points = sorted((s.there_s, s.here_s / s.there_s) for s in specs if s.here_s is not None and s.there_s > 0)
    if len(points) < MIN_PROBE_SPECS:
        return []
    ratios = [r for _, r in points]
    return [(t, float(np.median(ratios[max(0, i - 1):i + 2]))) for i, (t, _) in enumerate(points)]


def read_probe(path: str | Path, by_size: bool | None = None) -> SpecHostScale:
    """The scale a probe file holds, its source naming the file, its compiles scaled by size (``by_size``)
    or by the median (``None``: by size where the probe compiled run-order sequences, whose conditions are
    a run's); :class:`SpecProbeError` naming the file and the reason when it is no probe."""
    path = Path(path)
    source = f"{PROBE_PREFIX}{path}"
    probe = read_probe_file(path, SpecProbe, source, "spec-cost probe", SpecProbeError)
    if by_size is None:
        by_size = bool(probe.sequences)
    sequenced = [s for sequence in probe.sequences for s in sequence.specs]
    return SpecHostScale(source=source, backend=probe.backend, backend_version=probe.backend_version,
                         vocab=probe.vocab, measured_on=probe.measured_on, host=probe.host, compile=probe.compile,
                         fill=probe.fill, there={s.digest: s.there_s for s in probe.specs},
                         compile_by_size=compile_curve(probe.specs) if by_size else [],
                         compile_order=probe.compile_order,
                         order_by_size=compile_curve(sequenced) if by_size and probe.compile_order else [],
                         sequences=[s.digest for s in probe.sequences])


__all__ = ["MIN_PROBE_SPECS", "PROBE_PREFIX", "PROBE_SPECS", "TEXTS_PER_SPEC", "ProbeScale", "ProbedSequence",
           "ProbedSpec", "ProbedWalk", "SpecHostScale", "SpecProbe", "SpecProbeError", "choose_specs", "compile_curve",
           "entry_spec", "host_entries", "read_probe"]
