"""Measured grammar-engine costs of one backend, and a seeded sampler for ``model`` mode.

A :class:`GrammarProfile` summarises, per constraint kind, what a backend cost
on a corpus: compile times (and which specs failed, and how), the time of each
per-token mask fill, accept and rollback, and how often the grammar forced the
next tokens (jump-forward). ``cdbench profile`` writes one with
:meth:`GrammarProfile.from_measurements`; ``model`` mode draws costs from it
with :meth:`GrammarProfile.sampler`, an array at a time.

A profile is stored as JSON (``.json``, what a ``hybrid`` run writes) or as a
compressed Parquet file (``.parquet``, the shipped profiles and ``cdbench
profile``'s): one row per spec and per walked instance, each decoded the
first time a run asks for it (:class:`LazySections`), so a run reads the few
hundred specs it prices rather than the thousands a covering profile holds.

Each time distribution is an empirical quantile function
(:class:`Distribution`): every sample when there are few, otherwise quantiles
on a grid that is refined towards the top so that p99, p99.9 and the maximum
survive (per-token mask times are heavy-tailed, and the tail is what holds a
batch up). Sampling is inverse-CDF with linear interpolation between stored
points.

Examples
--------
>>> import numpy as np
>>> walk = WalkMeasurement("s1", "regex", fill_s=np.full(5, 2e-5), accept_s=np.full(5, 1e-6))
>>> profile = GrammarProfile.from_measurements(
...     "mybackend", "cl100k", [CompileMeasurement("s1", "regex", "ok", 0.003)], [walk])
>>> sampler = profile.sampler(seed=0)
>>> sampler.fill_s(3, "regex")
array([2.e-05, 2.e-05, 2.e-05])
>>> sampler.compile_s(["s1", "unseen"], ["regex", "regex"])
array([0.003, 0.003])
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_serializer,
    model_validator,
)

from cdbench.backends.base import CONSTRAINT_KINDS
from cdbench.harness.costs.spec_profile import (
    InstanceProfile,
    SpecProfile,
    group_samples,
    instance_sections,
    kind_pools,
    spec_sections,
)

if TYPE_CHECKING:
    import pyarrow as pa

PROFILE_DIR = Path(__file__).with_name("profiles")
PROFILE_SUFFIXES = (".parquet", ".json")  # a profile file's formats; a shipped profile is the first
CompileStatus = Literal["ok", "unsupported", "error", "timeout", "crash", "oom"]
COMPILE_STATUSES: tuple[str, ...] = ("ok", "unsupported", "error", "timeout", "crash", "oom")
QUANTILE_BUCKETS = 1 << 10
"""Equal buckets of [0, 1) that :meth:`Distribution.quantile_of_uniform` looks draws up in."""
EXACT_SAMPLES = 512  # up to this many samples are stored as they are
_BODY_POINTS = 513
_TAIL_POINTS = 48
_SIG_DIGITS = 5
_REPORTED_TAIL = np.array([0.99, 0.999, 0.9999])  # kept exactly: the percentiles reports quote


class ProfileError(ValueError):
    """A profile file or measurement that cannot be used; the message names the file or item."""


def _round(values: np.ndarray) -> list[float]:
    # Rounding is monotone, so a sorted array stays sorted; it keeps the files small.
    # Only for durations: probabilities such as 1 - 1e-6 need every digit.
    return [float(f"{v:.{_SIG_DIGITS}g}") for v in values]


class Distribution(BaseModel):
    """An empirical distribution of durations in seconds.

    ``values[i]`` is the ``probs[i]`` quantile; both are non-decreasing, with
    ``probs`` from 0 to 1. ``count`` is how many samples it was built from (0:
    no data). The summary fields are exact over all samples; ``hist_*`` is a
    log-spaced histogram (10 bins per decade) for plots.
    """

    model_config = ConfigDict(extra="forbid")
    count: int = Field(ge=0)
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    p999: float = 0.0
    max: float = 0.0
    probs: list[float] = []
    values: list[float] = []
    hist_edges: list[float] = []
    hist_counts: list[int] = []
    _points: tuple[np.ndarray, np.ndarray] | None = PrivateAttr(None)
    _buckets: tuple[np.ndarray, ...] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _well_formed(self) -> Distribution:
        if len(self.probs) != len(self.values):
            raise ValueError(f"probs has {len(self.probs)} points but values has {len(self.values)}")
        if self.count and len(self.values) < 2:
            raise ValueError("a non-empty distribution needs at least 2 quantile points")
        if self.values:
            p, v = np.asarray(self.probs), np.asarray(self.values)
            if p[0] != 0.0 or p[-1] != 1.0 or np.any(np.diff(p) < 0):
                raise ValueError("probs must rise from 0 to 1")
            if v[0] < 0 or np.any(np.diff(v) < 0) or not np.all(np.isfinite(v)):
                raise ValueError("values must be finite, >= 0 and non-decreasing")
        if len(self.hist_counts) != max(len(self.hist_edges) - 1, 0):
            raise ValueError("hist_counts needs one entry per pair of hist_edges")
        return self

    @classmethod
    def from_samples(cls, samples: Iterable[float] | np.ndarray) -> Distribution:
        """Summarise ``samples`` (seconds, finite, >= 0)."""
        x = np.sort(np.asarray(samples, dtype=np.float64).ravel())
        n = len(x)
        if n == 0:
            return cls(count=0)
        if not np.all(np.isfinite(x)) or x[0] < 0:
            raise ProfileError("durations must be finite and >= 0")
        if n <= EXACT_SAMPLES:
            probs = np.linspace(0.0, 1.0, n) if n > 1 else np.array([0.0, 1.0])
            values = x if n > 1 else np.array([x[0], x[0]])
        else:
            tail = 1.0 - np.logspace(-2, -math.log10(n), _TAIL_POINTS)
            probs = np.unique(np.concatenate([np.linspace(0.0, 1.0, _BODY_POINTS), tail, _REPORTED_TAIL]))
            values = np.quantile(x, probs)
        q50, q90, q99, q999 = np.quantile(x, [0.5, 0.9, 0.99, 0.999])
        positive = x[x > 0]
        edges, counts = [], []
        if len(positive):
            lo, hi = math.floor(math.log10(positive[0]) * 10), math.ceil(math.log10(positive[-1]) * 10)
            edges_arr = 10.0 ** (np.arange(lo, max(hi, lo + 1) + 1) / 10.0)
            counts = np.histogram(positive, bins=edges_arr)[0].tolist()
            edges = _round(edges_arr)
        return cls(count=n, mean=float(x.mean()), p50=float(q50), p90=float(q90), p99=float(q99),
                   p999=float(q999), max=float(x[-1]), probs=probs.tolist(), values=_round(values),
                   hist_edges=edges, hist_counts=counts)

    @classmethod
    def constant(cls, value: float) -> Distribution:
        """Always ``value`` (e.g. the zero costs of the ``none`` backend)."""
        return cls.from_samples([value])

    def quantile(self, q):
        """The ``q`` quantile(s) of the stored quantile function."""
        if not self.count:
            raise ProfileError("quantile of an empty distribution")
        return np.interp(q, *self._arrays())

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._points is None:  # as arrays once: model mode draws a cost spec's pools from them as it arrives
            self._points = (np.asarray(self.probs, np.float64), np.asarray(self.values, np.float64))
        return self._points

    def quantile_of_uniform(self, u: np.ndarray) -> np.ndarray:
        """:meth:`quantile` of uniform draws ``u`` in [0, 1) (``Generator.random``): the same values, bit for
        bit, found without a binary search per draw.

        ``numpy.interp`` searches the quantile points for each draw, and on random draws most of its time
        goes to mispredicted branches (model mode draws a few thousand values per cost spec as requests
        arrive). Here :data:`QUANTILE_BUCKETS` equal buckets of [0, 1) each know the last point at or
        below their start and the next point, so a draw's point is one of the two (one comparison, and one
        gather each of the slope, point and value tables laid out two entries a bucket); the few draws at
        or past the first bucket holding more than one point (the dense tail) are searched. The
        interpolation is then ``numpy.interp``'s own arithmetic: ``slope * (u - x[j]) + y[j]``, with its
        slopes.

        >>> d = Distribution.from_samples(np.random.default_rng(0).lognormal(size=10_000))
        >>> u = np.random.default_rng(1).random(4096)
        >>> bool((d.quantile_of_uniform(u) == d.quantile(u)).all())
        True
        """
        if not self.count:
            raise ProfileError("quantile of an empty distribution")
        if self._buckets is None:
            x, y = self._arrays()
            starts = np.arange(QUANTILE_BUCKETS + 1) / QUANTILE_BUCKETS  # (exact: a power of two)
            last = np.searchsorted(x, starts[:-1], "right") - 1  # each bucket's last point at or below its start
            inside = np.searchsorted(x, starts[1:], "left") - 1 - last  # points inside each bucket, after its start
            with np.errstate(divide="ignore", invalid="ignore"):
                slopes = np.append((y[1:] - y[:-1]) / (x[1:] - x[:-1]), 0.0)
            dense = np.flatnonzero(inside > 1)
            # bucket b's points at 2b and 2b + 1 (past the last point: never taken, its next point is inf)
            two = np.minimum(np.stack((last, last + 1), axis=1).ravel(), len(x) - 1)
            self._buckets = (np.append(x, np.inf)[last + 1], slopes[two], x[two], y[two], slopes,
                             float(starts[dense[0]]) if len(dense) else 2.0)
        next_x, slope, x_at, y_at, slopes, dense_from = self._buckets
        k = (u * QUANTILE_BUCKETS).astype(np.intp)
        below = next_x.take(k) <= u  # the draw is past the bucket's next point
        k += k
        k += below
        out = u - x_at.take(k)
        out *= slope.take(k)
        out += y_at.take(k)
        tail = np.flatnonzero(u >= dense_from)  # (most of a few thousand draws have some there)
        if len(tail):
            x, y = self._arrays()
            u_tail = u[tail]
            j = np.searchsorted(x, u_tail, "right") - 1
            out[tail] = slopes[j] * (u_tail - x[j]) + y[j]
        return out


class KindProfile(BaseModel):
    """A backend's costs on one constraint kind (or on all kinds pooled).

    ``statuses`` counts compile outcomes (``ok``, ``unsupported``, ``error``,
    ``timeout``, ``crash``, ``oom``). ``compile_s`` covers successful compiles only.
    ``fill_s`` holds one sample per decoding step (the first fill after each
    accepted token), ``accept_s`` one per accepted token, ``rollback_s`` one
    per rollback call. ``jump_forward_fraction`` is the fraction of steps at
    which the grammar forced at least one token, ``jump_forward_mean_tokens``
    the mean number forced at those steps. Profiles with per-spec sections also
    keep ``fill_residual``, each fill over its spec's mean at its position bin
    (the spread left once spec and position are known), and ``fill_curve``, the
    kind's pooled mean fill per position bin over ``fill_s.mean``
    (:mod:`~cdbench.harness.costs.spec_profile`). ``draft_tried``/``draft_valid``
    and ``think_accept_s`` pool the kind's specs' own
    (:class:`~cdbench.harness.costs.spec_profile.SpecProfile`), for specs that
    did not measure them.
    """

    model_config = ConfigDict(extra="forbid")
    statuses: dict[CompileStatus, int] = {}
    compile_s: Distribution = Distribution(count=0)
    fill_s: Distribution = Distribution(count=0)
    accept_s: Distribution = Distribution(count=0)
    rollback_s: Distribution = Distribution(count=0)
    jump_forward_fraction: float = Field(default=0.0, ge=0, le=1)
    jump_forward_mean_tokens: float = Field(default=0.0, ge=0)
    fill_residual: Distribution = Distribution(count=0)
    fill_curve: list[float] = []
    draft_tried: list[int] = []
    draft_valid: list[int] = []
    think_accept_s: float | None = Field(default=None, ge=0)

    @property
    def items(self) -> int:
        return sum(self.statuses.values())

    def rate(self, status: CompileStatus) -> float:
        """Fraction of compiles that ended in ``status`` (0 when nothing was compiled)."""
        return self.statuses.get(status, 0) / self.items if self.items else 0.0

    @property
    def failure_rate(self) -> float:
        return 1.0 - self.rate("ok") if self.items else 0.0


@dataclass(frozen=True)
class CompileMeasurement:
    """One cold compile of one spec: its outcome and, for ``ok``, its time in seconds."""

    spec_id: str
    kind: str
    status: CompileStatus
    seconds: float | None = None
    key: str | None = None  # the compile-cache key text (default ``kind:spec_id``)


@dataclass(frozen=True)
class WalkMeasurement:
    """Per-token times of walking one instance of a compiled spec, in seconds.

    ``fill_s`` and ``forced_tokens`` (jump-forward tokens available; 0 = none)
    have one entry per step; ``accept_s`` one per accepted token;
    ``rollback_s`` one per rollback call. ``positions`` is the answer position
    of each fill (default 0, 1, 2, ...); ``key`` the spec's compile-cache key
    text (default ``kind:spec_id``); ``rejected_at`` the answer position whose
    token the grammar refused, ending the walk (``None``: none was).
    ``drafts_past``/``valid_past``: per step with drafts, how many were proposed
    past those the target accepted, and how many of these the grammar took
    (its valid prefix, past the accepted ones). ``random_walk``: the walk drew
    its tokens from the masks (no oracle), and ``ended_at`` is the answer
    length at which its grammar terminated it (``None``: it ran to its cap).
    ``think_tokens``/``think_s``: thinking-phase tokens the matcher accepted
    and the seconds they took (the ``reasoner`` backend). ``instance``: the
    walked text's :func:`~cdbench.harness.costs.spec_profile.instance_key`
    (``None``: not known, as for a random walk).
    """

    spec_id: str
    kind: str
    fill_s: np.ndarray
    accept_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    rollback_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    forced_tokens: np.ndarray | None = None
    positions: np.ndarray | None = None
    key: str | None = None
    rejected_at: int | None = None
    drafts_past: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    valid_past: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    random_walk: bool = False
    ended_at: int | None = None
    think_tokens: int = 0
    think_s: float = 0.0
    instance: str | None = None


class ParallelFillProfile(BaseModel):
    """How a run's fills went on the engine's parallel fill pool.

    Over ``steps`` steps whose fills ran on ``threads`` threads in tasks of
    ``chunk`` rows, ``wall_s`` is the pool's measured wall time and
    ``makespan_s`` what the same rows' own fill times (each its thread's CPU
    time) give when the threads run side by side
    (:func:`~cdbench.harness.step_time.parallel_makespan`). :attr:`factor` is
    how far the real pool fell short of that (the GIL, caches and cores the
    threads share, the pool's own overhead): ``model`` mode scales its
    makespans by it.

    >>> ParallelFillProfile(steps=2, threads=8, chunk=16, wall_s=3e-3, makespan_s=1e-3).factor
    3.0
    """

    model_config = ConfigDict(extra="forbid")
    steps: int = Field(ge=1)
    threads: int = Field(ge=1)
    chunk: int = Field(ge=1)
    wall_s: float = Field(gt=0)
    makespan_s: float = Field(gt=0)

    @property
    def factor(self) -> float:
        return self.wall_s / self.makespan_s


Section = TypeVar("Section", SpecProfile, InstanceProfile)


def _first_error(exc: ValidationError) -> str:
    """``field 'a.b': message`` of the first thing wrong."""
    first = exc.errors()[0]
    return f"field {'.'.join(str(p) for p in first['loc']) or '<root>'!r}: {first['msg']}"


class LazySections(Mapping[str, Section], Generic[Section]):
    """A profile file's specs (or instances) by key, each decoded from its row the first time it is read.

    ``labels`` gives each spec's kind and corpus without decoding it (what a
    run draws stand-in specs from). ``updated`` is a copy with some sections
    added or replaced (decoded already); the copies share what was decoded.

    >>> import pyarrow as pa
    >>> specs = LazySections(SpecProfile, "f.parquet", ["k1"], pa.array(['{"kind": "regex", "fills": 3}']),
    ...                      ["regex"], [None])
    >>> specs["k1"].fills, "k2" in specs, len(specs.updated({"k2": SpecProfile(kind="choice")}))
    (3, False, 2)
    """

    def __init__(self, model: type[Section], path: str | Path, keys: Sequence[str], bodies: pa.StringArray,
                 kinds: Sequence[str | None], corpora: Sequence[str | None]) -> None:
        self._model, self._path, self._bodies = model, path, bodies
        self._rows = {k: i for i, k in enumerate(keys)}
        self._kinds, self._corpora = kinds, corpora
        self._decoded: dict[str, Section] = {}
        self._extra: dict[str, Section] = {}

    def __getitem__(self, key: str) -> Section:
        found = self._extra.get(key)
        if found is None:
            found = self._decoded.get(key)
        if found is None:
            row = self._rows[key]
            try:
                found = self._model.model_validate_json(self._bodies[row].as_py())
            except ValidationError as exc:
                raise ProfileError(f"{self._path}: invalid {self._model.__name__} {key!r}, "
                                   f"{_first_error(exc)}") from exc
            self._decoded[key] = found
        return found

    def __contains__(self, key: object) -> bool:
        return key in self._extra or key in self._rows

    def __iter__(self) -> Iterator[str]:
        yield from self._rows
        yield from (k for k in self._extra if k not in self._rows)

    def __len__(self) -> int:
        return len(self._rows) + sum(k not in self._rows for k in self._extra)

    def labels(self) -> list[tuple[str, str | None, str | None]]:
        """``(key, kind, corpus)`` of every section, the file's from its columns (nothing decoded)."""
        own = [(k, self._kinds[i], self._corpora[i]) for k, i in self._rows.items() if k not in self._extra]
        return own + [(k, getattr(v, "kind", None), getattr(v, "corpus", None)) for k, v in self._extra.items()]

    def updated(self, extra: Mapping[str, Section]) -> LazySections[Section]:
        """A copy with ``extra``'s sections added, or in place of the file's."""
        copy = LazySections.__new__(LazySections)
        copy.__dict__.update(self.__dict__)
        copy._extra = {**self._extra, **extra}
        return copy


def with_sections(base: Mapping[str, Section], extra: Mapping[str, Section]) -> Mapping[str, Section]:
    """``base`` with ``extra`` added or replacing its sections, decoding nothing more of a profile file."""
    return base.updated(extra) if isinstance(base, LazySections) else {**base, **extra}


_COLUMNS = ("section", "key", "kind", "corpus", "body")
"""A profile file's columns: ``section`` is ``header`` (one row: every field but the specs and instances,
as JSON), ``spec`` or ``instance``; ``kind``/``corpus`` label a spec's row; ``body`` is the row's JSON."""


def _write_parquet(profile: GrammarProfile, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: list[tuple[str, str, str | None, str | None, str]] = [
        ("header", "", None, None, profile.model_dump_json(exclude={"specs", "instances"}))]
    rows += [("spec", k, s.kind, s.corpus, s.model_dump_json()) for k, s in profile.specs.items()]
    rows += [("instance", k, None, None, i.model_dump_json()) for k, i in profile.instances.items()]
    table = pa.table({name: [r[j] for r in rows] for j, name in enumerate(_COLUMNS)},
                     schema=pa.schema([(name, pa.string()) for name in _COLUMNS]))
    pq.write_table(table, path, compression="zstd", compression_level=19)


def _read_parquet(path: Path) -> GrammarProfile:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path).read()  # not pq.read_table: it imports pyarrow.dataset (a quarter second)
    except (OSError, pa.ArrowException) as exc:
        raise ProfileError(f"{path}: cannot read grammar profile: {exc}") from exc
    missing = [c for c in _COLUMNS if c not in table.column_names]
    if missing:
        raise ProfileError(f"{path}: not a grammar profile file (no column {', '.join(missing)})")
    section, keys, kinds, corpora = (table[c].to_pylist() for c in _COLUMNS[:4])
    bodies = table["body"].combine_chunks()
    if section.count("header") != 1:
        raise ProfileError(f"{path}: not a grammar profile file (it needs one header row, has "
                           f"{section.count('header')})")
    try:
        header = GrammarProfile.model_validate_json(bodies[section.index("header")].as_py())
    except ValidationError as exc:
        raise ProfileError(f"{path}: invalid grammar profile {_first_error(exc)}") from exc

    def rows(name: str, model: type[Section]) -> LazySections[Section]:
        at = [i for i, s in enumerate(section) if s == name]
        return LazySections(model, path, [keys[i] for i in at], bodies.take(pa.array(at, pa.int64())),
                            [kinds[i] for i in at], [corpora[i] for i in at])

    return header.model_copy(update={"specs": rows("spec", SpecProfile),
                                     "instances": rows("instance", InstanceProfile)})


class GrammarProfile(BaseModel):
    """Costs of one grammar backend on one vocabulary, measured on a corpus.

    ``kinds`` maps each profiled constraint kind to its :class:`KindProfile`;
    ``overall`` pools all kinds (used for a kind that was not measured).
    ``compile_by_spec`` holds the measured compile seconds of each spec id
    that compiled; ``failed_specs`` the status of each that did not.
    ``specs`` (format 2) holds each measured spec's own costs
    (:class:`~cdbench.harness.costs.spec_profile.SpecProfile`), keyed by
    :func:`~cdbench.harness.costs.spec_profile.spec_key_hash`; a format-1 file
    has none, and ``model`` mode then draws per kind. ``instances`` holds each
    walked instance's fills by position
    (:class:`~cdbench.harness.costs.spec_profile.InstanceProfile`), keyed by
    :func:`~cdbench.harness.costs.spec_profile.instance_key`: a request
    walking a text the profile walked replays that text's fills.
    ``parallel_fill`` (an in-situ profile whose run used the engine's fill
    pool) says how the pool's wall time compared with its rows' fills.
    ``engine_version``: the version of the engine measured (``None``: not
    recorded). ``spec_contents`` maps a key of ``specs`` to
    :func:`~cdbench.workloads.instances.spec_hash` of the spec it measured (a
    generator copy's original), so that a run finds a measured spec by its
    content whatever id its corpus gives it (:mod:`~cdbench.harness.costs.spec_costs`).
    A profile read from a ``.parquet`` file holds its ``specs`` and
    ``instances`` as :class:`LazySections`, decoded as they are read.
    ``copies`` (a run's priced profile, never saved): corpus item key text → the key of ``specs`` that
    prices each of the item's unique copies under the copy's own name, where the run priced them by the
    item's content once (:func:`~cdbench.harness.costs.spec_costs.price_specs`) instead of one entry a copy.
    """

    model_config = ConfigDict(extra="forbid")
    format_version: Literal[1, 2] = 2
    backend: str
    vocab: str
    source: str = Field(default="", description="how it was measured: command, date, versions")
    kinds: dict[str, KindProfile]
    overall: KindProfile
    compile_by_spec: dict[str, float] = {}
    failed_specs: dict[str, CompileStatus] = {}
    specs: dict[str, SpecProfile] = {}
    instances: dict[str, InstanceProfile] = {}
    parallel_fill: ParallelFillProfile | None = None
    engine_version: str | None = None
    spec_contents: dict[str, str] = {}
    copies: dict[str, str] = Field(default_factory=dict, exclude=True)

    @field_serializer("specs", "instances", mode="wrap")
    def _decoded(self, sections, handler):
        return handler(dict(sections.items()) if isinstance(sections, LazySections) else sections)

    @model_validator(mode="after")
    def _known_kinds(self) -> GrammarProfile:
        unknown = set(self.kinds) - set(CONSTRAINT_KINDS)
        if unknown:
            raise ValueError(f"unknown constraint kinds {sorted(unknown)}; known: {', '.join(CONSTRAINT_KINDS)}")
        return self

    @classmethod
    def from_measurements(
        cls,
        backend: str,
        vocab: str,
        compiles: Iterable[CompileMeasurement],
        walks: Iterable[WalkMeasurement],
        source: str = "",
        parallel_fill: ParallelFillProfile | None = None,
    ) -> GrammarProfile:
        """Build a profile from raw measurements (what ``cdbench profile`` calls).

        A measurement that cannot be right (unknown kind or status, an ``ok``
        compile without a time, negative or non-finite durations, mismatched
        array lengths) raises :class:`ProfileError` naming its spec id.
        A spec compiled several times keeps the median of its times. Each
        spec's own costs go to ``specs``, keyed by the hash of its ``key``.
        """
        compiles, walks = list(compiles), list(walks)
        statuses: dict[str, dict[str, int]] = {}
        compile_times: dict[str, list[float]] = {}
        by_spec: dict[str, list[float]] = {}
        failed: dict[str, str] = {}
        for m in compiles:
            _check_kind(m.spec_id, m.kind)
            if m.status not in COMPILE_STATUSES:
                raise ProfileError(f"spec {m.spec_id!r}: unknown compile status {m.status!r}; "
                                   f"known: {', '.join(COMPILE_STATUSES)}")
            counts = statuses.setdefault(m.kind, {})
            counts[m.status] = counts.get(m.status, 0) + 1
            if m.status == "ok":
                if m.seconds is None or not math.isfinite(m.seconds) or m.seconds < 0:
                    raise ProfileError(f"spec {m.spec_id!r}: an ok compile needs a time >= 0, got {m.seconds!r}")
                compile_times.setdefault(m.kind, []).append(m.seconds)
                by_spec.setdefault(m.spec_id, []).append(m.seconds)
            else:
                failed[m.spec_id] = m.status

        samples: dict[str, dict[str, list[np.ndarray]]] = {}
        for w in walks:
            _check_kind(w.spec_id, w.kind)
            arrays = {name: np.asarray(getattr(w, name), dtype=np.float64).ravel()
                      for name in ("fill_s", "accept_s", "rollback_s")}
            for name, arr in arrays.items():
                if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                    raise ProfileError(f"spec {w.spec_id!r}: {name} has negative or non-finite durations")
            forced = (np.zeros(len(arrays["fill_s"]), dtype=np.int64) if w.forced_tokens is None
                      else np.asarray(w.forced_tokens, dtype=np.int64).ravel())
            if len(forced) != len(arrays["fill_s"]):
                raise ProfileError(f"spec {w.spec_id!r}: forced_tokens has {len(forced)} entries, "
                                   f"fill_s has {len(arrays['fill_s'])}")
            if np.any(forced < 0):
                raise ProfileError(f"spec {w.spec_id!r}: forced_tokens must be >= 0")
            if w.positions is not None and (len(w.positions) != len(arrays["fill_s"]) or np.any(w.positions < 0)):
                raise ProfileError(f"spec {w.spec_id!r}: positions needs one answer position >= 0 per fill")
            past, valid = np.asarray(w.drafts_past), np.asarray(w.valid_past)
            if len(past) != len(valid) or np.any(valid < 0) or np.any(valid > past):
                raise ProfileError(f"spec {w.spec_id!r}: valid_past needs one count per drafts_past, 0..drafts_past")
            per_kind = samples.setdefault(w.kind, {})
            for name, arr in (*arrays.items(), ("forced_tokens", forced)):
                per_kind.setdefault(name, []).append(arr)

        def kind_profile(kinds: Sequence[str]) -> KindProfile:
            merged_status: dict[str, int] = {}
            for k in kinds:
                for s, c in statuses.get(k, {}).items():
                    merged_status[s] = merged_status.get(s, 0) + c

            def cat(name: str) -> np.ndarray:
                parts = [a for k in kinds for a in samples.get(k, {}).get(name, [])]
                return np.concatenate(parts) if parts else np.zeros(0)

            forced = cat("forced_tokens")
            jumping = forced[forced > 0]
            return KindProfile(
                statuses={s: merged_status[s] for s in COMPILE_STATUSES if s in merged_status},
                compile_s=Distribution.from_samples([t for k in kinds for t in compile_times.get(k, [])]),
                fill_s=Distribution.from_samples(cat("fill_s")),
                accept_s=Distribution.from_samples(cat("accept_s")),
                rollback_s=Distribution.from_samples(cat("rollback_s")),
                jump_forward_fraction=float(len(jumping) / len(forced)) if len(forced) else 0.0,
                jump_forward_mean_tokens=float(jumping.mean()) if len(jumping) else 0.0,
            )

        measured = [k for k in CONSTRAINT_KINDS if k in statuses or k in samples]
        specs, shapes = spec_sections(group_samples(walks, compiles))
        kinds = {k: kind_profile([k]) for k in measured}
        for k, shape in shapes.items():
            kinds[k] = kinds[k].model_copy(update={"fill_residual": Distribution.from_samples(shape.residual),
                                                   "fill_curve": shape.curve})
        for k, pooled in kind_pools(specs.values()).items():
            kinds[k] = kinds[k].model_copy(update=pooled)
        return cls(
            backend=backend, vocab=vocab, source=source, specs=specs, instances=instance_sections(walks), kinds=kinds,
            overall=kind_profile(measured),
            compile_by_spec={s: float(np.median(t)) for s, t in sorted(by_spec.items())},
            failed_specs={s: failed[s] for s in sorted(failed) if s not in by_spec},
            parallel_fill=parallel_fill,
        )

    @classmethod
    def zero(cls, backend: str, vocab: str, source: str = "no grammar work: every cost is 0") -> GrammarProfile:
        """A profile whose every cost is zero and that never fails (the ``none`` backend)."""
        zero = KindProfile(compile_s=Distribution.constant(0.0), fill_s=Distribution.constant(0.0),
                           accept_s=Distribution.constant(0.0), rollback_s=Distribution.constant(0.0))
        return cls(backend=backend, vocab=vocab, source=source, kinds={}, overall=zero)

    @classmethod
    def load(cls, path: str | Path) -> GrammarProfile:
        """Read a profile file (``.parquet``, its sections decoded as they are read; else JSON); a bad
        file raises :class:`ProfileError` naming the file and the field."""
        path = Path(path)
        if path.suffix == ".parquet":
            return _read_parquet(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ProfileError(f"{path}: cannot read grammar profile: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not JSON: {exc}") from exc
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ProfileError(f"{path}: invalid grammar profile {_first_error(exc)}") from exc

    def save(self, path: str | Path) -> None:
        """Write the profile: compressed Parquet for a ``.parquet`` path, else indented JSON."""
        path = Path(path)
        if path.suffix == ".parquet":
            _write_parquet(self, path)
        else:
            path.write_text(self.model_dump_json(indent=1) + "\n", encoding="utf-8")

    @classmethod
    def builtin(cls, backend: str) -> GrammarProfile:
        """The default profile shipped for ``backend`` (``profiles/<backend>.parquet``)."""
        path = shipped_profiles().get(backend)
        if path is None:
            raise ProfileError(f"no default grammar profile for backend {backend!r}; "
                               f"known: {', '.join(shipped_profiles())}")
        return cls.load(path)

    def spec_labels(self) -> list[tuple[str, str | None, str | None]]:
        """``(key, kind, corpus)`` of every spec in ``specs``; a profile file's are read without decoding."""
        if isinstance(self.specs, LazySections):
            return self.specs.labels()
        return [(k, s.kind, s.corpus) for k, s in self.specs.items()]

    def mismatch(self, backend: str, vocab: str, version: str) -> str | None:
        """How this profile differs from a run of ``backend`` (engine ``version``) on ``vocab``, in one line
        naming both sides (``measured with ...; the run uses ...``); ``None`` when it describes such a run.
        A profile without a recorded engine version matches any; the ``none`` backend's costs (all zero)
        match any vocabulary."""
        ours = f"{self.backend}{f' {self.engine_version}' if self.engine_version else ''} on {self.vocab}"
        theirs = f"{backend}{f' {version}' if self.engine_version else ''} on {vocab}"
        differs = self.backend != backend or self.engine_version not in (None, version) \
            or (self.vocab != vocab and self.backend != "none")
        return f"measured with {ours}; the run uses {theirs}" if differs else None

    def kind(self, kind: str) -> KindProfile:
        """The profile of ``kind``, or the pooled one when ``kind`` was not measured."""
        return self.kinds.get(kind, self.overall)

    def sampler(self, seed: int) -> ProfileSampler:
        """A seeded sampler of this profile's costs."""
        return ProfileSampler(self, seed)


def shipped_profiles() -> dict[str, Path]:
    """Backend name → its shipped default profile file."""
    return {p.stem: p for p in sorted(PROFILE_DIR.glob(f"*{PROFILE_SUFFIXES[0]}"))}


def is_profile_file(name: str) -> bool:
    """Whether ``costs.grammar_profile = name`` names a profile file (else a backend's shipped profile)."""
    return Path(name).suffix in PROFILE_SUFFIXES


def _check_kind(spec_id: str, kind: str) -> None:
    if kind not in CONSTRAINT_KINDS:
        raise ProfileError(f"spec {spec_id!r}: unknown constraint kind {kind!r}; known: {', '.join(CONSTRAINT_KINDS)}")


# Sampling grid shared by all kinds: 4096 equal steps up to p99.9, then 20 steps
# per decade of 1 - p up to p99.999999, then the maximum. Its regular shape lets
# a draw find its interval arithmetically instead of by binary search.
_BODY_TOP, _BODY_STEPS, _TAIL_STEPS, _TAIL_DECADES = 1.0 - 1e-3, 4096, 100, 5.0
_GRID = np.concatenate([
    np.linspace(0.0, _BODY_TOP, _BODY_STEPS + 1),
    1.0 - 10.0 ** -(3.0 + _TAIL_DECADES * np.arange(1, _TAIL_STEPS + 1) / _TAIL_STEPS),
    [1.0],
])
_INV_STEP = 1.0 / np.diff(_GRID)


def _grid_interval(u: np.ndarray) -> np.ndarray:
    """Index ``j`` of the grid interval holding each ``u`` in [0, 1)."""
    j = (u * (_BODY_STEPS / _BODY_TOP)).astype(np.int64)
    in_tail = u > _BODY_TOP
    if in_tail.any():  # rare (0.1 % of draws): only they pay for the logarithm
        t = u[in_tail]
        pos = _BODY_STEPS + (-np.log10(1.0 - t) - 3.0) * (_TAIL_STEPS / _TAIL_DECADES)
        j[in_tail] = np.minimum(pos.astype(np.int64), len(_GRID) - 2)
    return j


KIND_CODES: dict[str, int] = {k: i for i, k in enumerate(CONSTRAINT_KINDS)}


@dataclass(frozen=True)
class _SingleKind:
    """``n`` draws that all share one kind code."""

    code: int
    n: int

    def __len__(self) -> int:
        return self.n


class ProfileSampler:
    """Draws a profile's costs as numpy arrays, reproducibly from ``seed``.

    Kinds are given as a count plus one kind name (``fill_s(256, "json_schema")``)
    or as an array with one kind per draw, either names or integer codes
    (:data:`KIND_CODES`, the order of ``CONSTRAINT_KINDS``; codes are faster).
    A kind the profile did not measure draws from the pooled distribution, and
    so does code ``-1`` (also what a count without a kind name means).

    Compile outcomes are a property of the spec: a spec id the profile measured
    gets its measured time and status; an unmeasured one gets a draw that
    depends only on the seed and the id, so the same spec costs the same
    every time it is compiled in a run. ``None`` ids draw afresh.
    """

    _METRICS = ("compile_s", "fill_s", "accept_s", "rollback_s")

    def __init__(self, profile: GrammarProfile, seed: int) -> None:
        self.profile, self.seed = profile, seed
        self.rng = np.random.default_rng(seed)
        # One row per kind code, then the pooled profile last, so code -1 means "pooled".
        kinds = [profile.kind(k) for k in CONSTRAINT_KINDS] + [profile.overall]
        self._kinds = kinds
        self._tables: dict[str, np.ndarray] = {}
        self._failure = np.array([kp.failure_rate for kp in kinds])
        self._failure_mix = [self._status_mix(kp) for kp in kinds]
        self._jf_fraction = np.array([kp.jump_forward_fraction for kp in kinds])
        self._jf_mean = np.array([max(kp.jump_forward_mean_tokens, 1.0) for kp in kinds])
        self._spec_cache: dict[tuple[str, str], float] = {}

    def _table(self, metric: str) -> np.ndarray:
        """Each kind's quantile function of ``metric`` on the shared grid (pooled where unmeasured)."""
        rows = []
        for kp in self._kinds:
            dist = getattr(kp, metric)
            if not dist.count:
                dist = getattr(self.profile.overall, metric)
            if not dist.count:
                raise ProfileError(f"profile {self.profile.backend}/{self.profile.vocab} has no {metric} measurements")
            rows.append(np.interp(_GRID, dist.probs, dist.values))
        return np.vstack(rows)

    @staticmethod
    def _status_mix(kp: KindProfile) -> tuple[list[str], np.ndarray]:
        failures = [s for s in COMPILE_STATUSES[1:] if kp.statuses.get(s)]
        weights = np.array([kp.statuses[s] for s in failures], dtype=np.float64)
        return failures, np.cumsum(weights) / weights.sum() if failures else weights

    def _codes(self, kinds, kind: str | None) -> np.ndarray:
        if np.ndim(kinds) == 0:
            n = int(kinds)
            if kind is not None and kind not in KIND_CODES:
                raise ProfileError(f"unknown constraint kind {kind!r}; known: {', '.join(CONSTRAINT_KINDS)}")
            return _SingleKind(KIND_CODES[kind] if kind else -1, n)
        arr = np.asarray(kinds)
        if arr.dtype.kind in "iu":
            if arr.size and arr.min() < -1:  # codes above the last kind raise IndexError when drawn
                raise ProfileError(f"kind codes must be in -1..{len(CONSTRAINT_KINDS) - 1}")
            return arr
        try:
            return np.array([KIND_CODES[k] for k in arr.tolist()], dtype=np.int64)
        except KeyError as exc:
            raise ProfileError(f"unknown constraint kind {exc.args[0]!r}; known: {', '.join(CONSTRAINT_KINDS)}") from None

    def _draw(self, metric: str, codes: np.ndarray | _SingleKind, u: np.ndarray | None = None) -> np.ndarray:
        if u is None:
            u = self.rng.random(len(codes))
        j = _grid_interval(u)
        w = (u - _GRID[j]) * _INV_STEP[j]
        table = self._tables.get(metric)
        if table is None:
            table = self._tables[metric] = self._table(metric)
        if isinstance(codes, _SingleKind):
            row = table[codes.code]
            lo, hi = row[j], row[j + 1]
        else:
            lo, hi = table[codes, j], table[codes, j + 1]
        return lo + (hi - lo) * w

    def fill_s(self, kinds, kind: str | None = None) -> np.ndarray:
        """Seconds of one mask fill per draw."""
        return self._draw("fill_s", self._codes(kinds, kind))

    def accept_s(self, kinds, kind: str | None = None) -> np.ndarray:
        """Seconds of one token accept per draw."""
        return self._draw("accept_s", self._codes(kinds, kind))

    def rollback_s(self, kinds, kind: str | None = None) -> np.ndarray:
        """Seconds of one rollback call per draw."""
        return self._draw("rollback_s", self._codes(kinds, kind))

    def jump_forward(self, kinds, kind: str | None = None) -> np.ndarray:
        """Forced tokens available per draw (0: none): Bernoulli availability, geometric length."""
        codes = self._codes(kinds, kind)
        index = codes.code if isinstance(codes, _SingleKind) else codes
        available = self.rng.random(len(codes)) < self._jf_fraction[index]
        return np.where(available, self.rng.geometric(1.0 / self._jf_mean[index], size=len(codes)), 0)

    def _spec_uniform(self, spec_id: str, purpose: str) -> float:
        key = (spec_id, purpose)
        u = self._spec_cache.get(key)
        if u is None:
            digest = hashlib.blake2b(f"{self.seed}\0{purpose}\0{spec_id}".encode(), digest_size=8).digest()
            u = self._spec_cache[key] = int.from_bytes(digest, "little") / 2.0**64
        return u

    def _spec_uniforms(self, spec_ids: Sequence[str | None], purpose: str) -> np.ndarray:
        fresh = self.rng.random(len(spec_ids))
        return np.array([fresh[i] if s is None else self._spec_uniform(s, purpose) for i, s in enumerate(spec_ids)])

    def _spec_codes(self, spec_ids: Sequence[str | None], kinds) -> np.ndarray:
        codes = self._codes(kinds, None)
        if isinstance(codes, _SingleKind) or len(codes) != len(spec_ids):
            raise ValueError(f"need one kind per spec id: {len(spec_ids)} spec ids, kinds {kinds!r}")
        return codes

    def compile_s(self, spec_ids: Sequence[str | None], kinds) -> np.ndarray:
        """Compile seconds per spec: measured where known, else drawn (stable per spec id).

        Failed compiles also get a time from the kind's successful-compile
        distribution (the profile does not record time to failure).
        """
        codes = self._spec_codes(spec_ids, kinds)
        out = self._draw("compile_s", codes, self._spec_uniforms(spec_ids, "compile"))
        measured = self.profile.compile_by_spec
        for i, s in enumerate(spec_ids):
            if s is not None and s in measured:
                out[i] = measured[s]
        return out

    def compile_status(self, spec_ids: Sequence[str | None], kinds) -> np.ndarray:
        """Compile outcome per spec (``"ok"`` or a failure status): measured where known, else drawn."""
        codes = self._spec_codes(spec_ids, kinds)
        u = self._spec_uniforms(spec_ids, "status")
        return np.array([self._status_one(s, int(c), float(x)) for s, c, x in zip(spec_ids, codes, u, strict=True)],
                        dtype=object)

    def compile_one(self, spec_id: str | None, kind: str) -> tuple[float, str]:
        """One spec's compile seconds and outcome, as :meth:`compile_s` and :meth:`compile_status` give them.

        The scalar form, for callers that compile one spec at a time (no arrays to build).
        """
        code = KIND_CODES.get(kind)
        if code is None:
            raise ProfileError(f"unknown constraint kind {kind!r}; known: {', '.join(CONSTRAINT_KINDS)}")
        if spec_id is None:
            u_time, u_status = self.rng.random(2).tolist()
        else:
            u_time, u_status = self._spec_uniform(spec_id, "compile"), self._spec_uniform(spec_id, "status")
        seconds = self.profile.compile_by_spec.get(spec_id) if spec_id is not None else None
        if seconds is None:
            seconds = self._quantile_one("compile_s", code, u_time)
        return seconds, self._status_one(spec_id, code, u_status)

    def _quantile_one(self, metric: str, code: int, u: float) -> float:
        table = self._tables.get(metric)
        if table is None:
            table = self._tables[metric] = self._table(metric)
        if u <= _BODY_TOP:
            j = int(u * (_BODY_STEPS / _BODY_TOP))
        else:
            j = min(int(_BODY_STEPS + (-math.log10(1.0 - u) - 3.0) * (_TAIL_STEPS / _TAIL_DECADES)), len(_GRID) - 2)
        row = table[code]
        lo, hi = float(row[j]), float(row[j + 1])
        return lo + (hi - lo) * (u - float(_GRID[j])) * float(_INV_STEP[j])

    def _status_one(self, spec_id: str | None, code: int, u: float) -> str:
        if spec_id is not None:
            if spec_id in self.profile.compile_by_spec:
                return "ok"
            if spec_id in self.profile.failed_specs:
                return self.profile.failed_specs[spec_id]
        rate = float(self._failure[code])
        if u >= rate:
            return "ok"
        names, cum = self._failure_mix[code]
        return names[min(int(np.searchsorted(cum, u / rate, side="right")), len(names) - 1)]
