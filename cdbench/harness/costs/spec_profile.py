"""Per-spec grammar costs: what one spec cost, by answer position.

A grammar's cost is a property of its spec: a slow schema is slow at every
token of every request that uses it, and its first fills (a fresh matcher,
cold caches) cost more than later ones. A :class:`SpecProfile` keeps, for one
spec, its compile time and outcome, a fill-cost scale (the mean fill) with a
position curve (the mean fill in each position bin, relative to the scale),
its residual spread, its rare outlier fills apart (with how often they
came), and its accept and rollback times. :func:`spec_sections`
builds them from raw walks, together with each kind's *residual* distribution
(every fill divided by its spec's curve at its position: the token-to-token
spread left once the spec and position are known) and each kind's pooled
curve. Means rather than medians: a step's cost is a sum of fills, so the mean
fill at each position is what must be kept; and a spiky spec (a few fills
hundreds of times its typical one) divided by its median would scale those
spikes onto every position of the curve.

Specs are keyed by :func:`spec_key_hash` of their compile-cache key text (the
scheduler's :class:`~cdbench.harness.executors.base.SpecKeys` text:
``kind:spec_id`` where the spec has an id, else its canonical text).

Below the spec, the instance: what a spec's fill costs at a position depends
on the text being walked (an Earley grammar can fill in microseconds on one
instance of a grammar and in tens of milliseconds on another), so each walked
instance also keeps its own fills by position (:class:`InstanceProfile`,
:func:`instance_sections`), keyed by :func:`instance_key` of its spec's base
key text and its tokens. Workload instance pools are fixed by their own seed,
so a profile's instances recur in runs at any workload seed.

>>> position_bins(np.array([0, 1, 2, 3, 4, 100, 10**6])).tolist()
[0, 1, 2, 2, 3, 7, 12]
>>> corpus_of("jsb/Github_easy/o27838#copy2"), corpus_of("plain")
('jsb/Github_easy', None)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

POSITION_BIN_STARTS: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
"""First answer position of each position bin: the first fill alone, then doubling widths, the last open."""
N_POSITION_BINS = len(POSITION_BIN_STARTS)
HEAD_POSITIONS = 4096
"""Answer positions a spec's curve also keeps one by one (:attr:`SpecProfile.fill_head`), in practice all of
them: fills differ by grammar state from token to token (a regex's literal against its character classes, a
slow stretch of an Earley grammar inside one rule), and a bin's mean with its in-bin spread drawn in another
order would move heavy fills to other positions, breaking up a slow stretch that ran back to back."""
RESIDUAL_VALUES = 64
"""Equal-weight values a spec's fill residual is kept as (its samples, or the means of as many equal slices)."""
MIN_SPREAD_FILLS = 4
"""Fills a cell (a head position, or a position bin past the head) needs for its residuals to describe a
spec's spread and its outliers to stand apart (fewer: the curve alone)."""
OUTLIER_FACTOR = 20.0
"""A fill above this many times the median fill of its cell (its answer position in the head, its position
bin past it) is an outlier, kept apart from the body."""
COPY_MARK = "#copy"  # the workload generator's suffix for a cache-distinct copy of a corpus item


def position_bins(positions: np.ndarray) -> np.ndarray:
    """The position bin of each answer position (0-based)."""
    p = np.asarray(positions, np.int64)
    return np.minimum(np.searchsorted(POSITION_BIN_STARTS, p, side="right") - 1, N_POSITION_BINS - 1)


def spec_key_hash(key_text: str) -> str:
    """The key of a spec in :attr:`GrammarProfile.specs`: a short hash of its compile-cache key text."""
    return hashlib.blake2b(key_text.encode(), digest_size=10).hexdigest()


def spec_key_text(kind: str, spec_id: str) -> str:
    """The compile-cache key text of a spec known by its id (as the scheduler numbers specs)."""
    return f"{kind}:{spec_id}"


def instance_key(base_text: str, tokens) -> str:
    """The key of one instance in :attr:`GrammarProfile.instances`: a short hash of its spec's
    :func:`base_key_text` and its tokens."""
    digest = hashlib.blake2b(base_text.encode(), digest_size=10)
    digest.update(np.asarray(tokens, np.int64).tobytes())
    return digest.hexdigest()


def base_key_text(key_text: str, kind: str, spec_id: str | None) -> str:
    """The key text an instance is known under: its corpus item's (a generator copy ``id#copyN``
    walks its item's instances), else the spec's own key text."""
    return key_text if spec_id is None else spec_key_text(kind, base_spec_id(spec_id))


def base_spec_id(spec_id: str) -> str:
    """The corpus item a spec id names (a generator copy ``id#copyN`` names ``id``)."""
    return spec_id.split(COPY_MARK, 1)[0]


def corpus_of(spec_id: str | None) -> str | None:
    """The corpus (or corpus subset) of a spec id: its prefix up to the last ``/`` (``None``: none)."""
    if spec_id is None or "/" not in spec_id:
        return None
    return base_spec_id(spec_id).rsplit("/", 1)[0]


class SpecProfile(BaseModel):
    """One spec's measured costs.

    ``status``/``compile_s``: its compile outcome and time (``None``: not
    compiled in the measurement). ``fills`` counts its fill samples;
    ``fill_scale_s`` is their mean and ``fill_curve[b]`` the mean of those in
    position bin ``b`` (outliers apart, below) (:data:`POSITION_BIN_STARTS`) over ``fill_scale_s`` (a
    bin without samples takes the nearest measured bin's value).
    ``fill_head[p]``: the mean of its fills at answer position ``p`` itself
    over ``fill_scale_s``, for its first :data:`HEAD_POSITIONS` positions up
    to the last it measured (a position without samples takes its bin's
    mean); where it has one, it is the curve there, in place of the bin's
    (empty: a profile written before heads were kept, bins alone).
    ``fill_residual``: its fills over its curve (the spec's own token-to-token
    spread, mean 1) as up to :data:`RESIDUAL_VALUES` equally likely values:
    the sorted samples, or the means of equal slices of them, so that drawing
    one uniformly keeps the mean (a quantile grid drawn by interpolation does
    not, with a few spikes in the tail). ``fill_outliers_s``: its rare fills
above :data:`OUTLIER_FACTOR` times their cell's median (a cell of
:data:`MIN_SPREAD_FILLS` or more), in seconds (up to :data:`RESIDUAL_VALUES`
equally likely values, as the residual), and ``fill_outlier_rate`` the
fraction of its fills they were; the curve and residual describe the other
fills (the body). A spike of hundreds of times the body folded into a bin
mean would scale every fill of that bin, and its residual every position;
kept apart, it is drawn as often as it was measured, at its own size (an
empty list: none measured, or a profile written before outliers were kept).
``accept_s``/``rollback_s``:
    median seconds per accept / rollback call (a median: in situ, accepts are
    timed per step, and one preempted step would make a mean speak for the
    whole spec). ``walks`` counts its walked instances (requests, in situ),
    ``rejected`` those whose token the grammar refused (the request aborted),
    at answer position ``rejected_at`` (the median over them).
    ``draft_tried[j]``/``draft_valid[j]``: of the drafts proposed past those
    the target accepted, the steps whose ``j``-th was offered to the grammar
    (the ones before it valid) and those where the grammar took it: the
    grammar builds mask rows for its valid prefix only, so the continuation
    rates ``draft_valid[j] / draft_tried[j]`` say how many rows a drafted
    step builds (empty: not measured; every draft then counts as valid).
    ``random_walks``: its walks that drew tokens from the masks (no oracle);
    ``walk_ends``: the answer lengths at which those whose grammar
    terminated ended, sorted (the others ran to their cap).
    ``think_accept_s``: seconds per thinking-phase token its matcher accepted
    (the ``reasoner`` backend; ``None``: not measured).
    """

    model_config = ConfigDict(extra="forbid")
    kind: str
    spec_id: str | None = None
    corpus: str | None = None
    status: str | None = None
    compile_s: float | None = Field(default=None, ge=0)
    fills: int = Field(default=0, ge=0)
    fill_scale_s: float = Field(default=0.0, ge=0)
    fill_curve: list[float] = []
    fill_head: list[float] = []
    fill_residual: list[float] = []
    fill_outliers_s: list[float] = []
    fill_outlier_rate: float = Field(default=0.0, ge=0, le=1)
    accept_s: float | None = Field(default=None, ge=0)
    rollback_s: float | None = Field(default=None, ge=0)
    walks: int = Field(default=0, ge=0)
    rejected: int = Field(default=0, ge=0)
    rejected_at: int | None = Field(default=None, ge=0)
    draft_tried: list[int] = []
    draft_valid: list[int] = []
    random_walks: int = Field(default=0, ge=0)
    walk_ends: list[int] = []
    think_accept_s: float | None = Field(default=None, ge=0)

    def fill_by_bin_s(self) -> np.ndarray:
        """Mean fill seconds per position bin (outliers apart)."""
        return self.fill_scale_s * np.asarray(self.fill_curve, np.float64)

    def fill_by_position_s(self, positions: np.ndarray, bins: np.ndarray | None = None) -> np.ndarray:
        """Mean fill seconds at each answer position (outliers apart): the head where it has the
        position, else the position's bin (``bins``: the positions' :func:`position_bins`, where the caller
        keeps them)."""
        p = np.asarray(positions, np.int64)
        out = self.fill_by_bin_s()[position_bins(p) if bins is None else bins]
        head = self.fill_scale_s * np.asarray(self.fill_head, np.float64)
        inside = p < len(head)
        out[inside] = head[p[inside]]
        return out


class InstanceProfile(BaseModel):
    """What walking one instance of a spec cost: ``fill_s[p]``, the mean fill seconds at answer position
    ``p`` over its ``walks`` (every fill, outliers included: each was measured at that position of that
    text), ``None`` where none was measured (a position a draft row covered). ``spec_id`` names the spec
    it was walked under. ``accept_s[p]``: the seconds of the accept of its token at ``p`` where the
    text's accepts were timed as a run walks them (in batch; empty: not timed so, its spec's accepts
    price it; left out of the file when empty, so profiles without them read and write as before)."""

    model_config = ConfigDict(extra="forbid")
    spec_id: str | None = None
    walks: int = Field(ge=1)
    fill_s: list[float | None]
    accept_s: list[float | None] = Field(default_factory=list, exclude_if=lambda v: not v)

    def fill_at(self, width: int) -> np.ndarray:
        """Its fills at positions ``0 .. width - 1`` (NaN where not measured)."""
        return _at(self.fill_s, width)

    def accept_at(self, width: int) -> np.ndarray:
        """Its accepts at positions ``0 .. width - 1`` (NaN where not measured)."""
        return _at(self.accept_s, width)


def _at(by_position: list[float | None], width: int) -> np.ndarray:
    out = np.full(width, np.nan)
    values = np.array(by_position[:width], np.float64)  # (None: NaN)
    out[:len(values)] = values
    return out


def walk_positions(walk) -> np.ndarray:
    """The answer position of each of a walk's fills (its ``positions``, else 0, 1, 2, ...)."""
    return np.arange(len(walk.fill_s)) if walk.positions is None else np.asarray(walk.positions, np.int64)


def instance_sections(walks: Iterable) -> dict[str, InstanceProfile]:
    """Each walked instance's fills by answer position, from ``walks``
    (:class:`~cdbench.harness.costs.grammar_profile.WalkMeasurement` with an ``instance`` key)."""
    grouped: dict[str, list] = {}
    for w in walks:
        if w.instance is not None:
            grouped.setdefault(w.instance, []).append(w)
    out = {}
    for key, ws in grouped.items():
        positions = [walk_positions(w) for w in ws]
        width = max((int(p.max()) + 1 for p in positions if len(p)), default=0)
        if not width:
            continue
        counts = sum(np.bincount(p, minlength=width) for p in positions)
        sums = sum(np.bincount(p, weights=np.asarray(w.fill_s, np.float64), minlength=width)
                   for p, w in zip(positions, ws))
        means = [_round(sums[i] / counts[i]) if counts[i] else None for i in range(width)]
        out[key] = InstanceProfile(spec_id=ws[0].spec_id, walks=len(ws), fill_s=means)
    return out


@dataclass(frozen=True)
class SpecSamples:
    """One spec's raw samples, gathered from its walks and compiles."""

    key_text: str
    kind: str
    spec_id: str | None
    fill_s: np.ndarray
    positions: np.ndarray
    accept_s: np.ndarray
    rollback_s: np.ndarray
    compile_s: float | None
    status: str | None
    walks: int = 0
    rejected_at: tuple[int, ...] = ()
    drafts_past: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    valid_past: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    random_walks: int = 0
    walk_ends: tuple[int, ...] = ()
    think_tokens: int = 0
    think_s: float = 0.0


@dataclass(frozen=True)
class KindShape:
    """A kind's fill noise around its specs' curves, and its pooled curve."""

    residual: np.ndarray  # fill / (spec's mean fill at that position bin)
    curve: list[float]  # pooled mean fill per position bin over the pooled mean


def _bin_means(fill_s: np.ndarray, bins: np.ndarray) -> np.ndarray:
    """Mean fill per position bin; a bin without samples takes the nearest measured bin's."""
    counts = np.bincount(bins, minlength=N_POSITION_BINS)
    sums = np.bincount(bins, weights=fill_s, minlength=N_POSITION_BINS)
    measured = np.flatnonzero(counts)
    nearest = measured[np.abs(np.arange(N_POSITION_BINS)[:, None] - measured[None, :]).argmin(axis=1)]
    return sums[nearest] / counts[nearest]


def _outliers(fill_s: np.ndarray, cells: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """Which fills are outliers: above OUTLIER_FACTOR times the median of their cell (a cell of
    MIN_SPREAD_FILLS or more fills, ``spread``; a smaller cell's median says too little)."""
    median = np.zeros(int(cells.max()) + 1)
    for c in np.unique(cells[spread]).tolist():
        median[c] = np.median(fill_s[cells == c])
    return spread & (median[cells] > 0) & (fill_s > OUTLIER_FACTOR * median[cells])


def _equal_slices(sorted_values: np.ndarray) -> np.ndarray:
    """The values themselves when few, else the means of RESIDUAL_VALUES equal slices (the overall mean kept)."""
    n = len(sorted_values)
    if n <= RESIDUAL_VALUES:
        return sorted_values
    edges = np.linspace(0.0, n, RESIDUAL_VALUES + 1)
    cum = np.concatenate(([0.0], np.cumsum(sorted_values)))
    # fractional slice edges: each slice holds n / RESIDUAL_VALUES samples' worth of mass
    at = np.interp(edges, np.arange(n + 1), cum)
    return np.diff(at) / np.diff(edges)


def draft_chain(drafts_past: np.ndarray, valid_past: np.ndarray) -> tuple[list[int], list[int]]:
    """``(tried, valid)`` per index ``j`` of the drafts past the accepted ones (see :class:`SpecProfile`).

    >>> draft_chain(np.array([3, 3, 1]), np.array([0, 2, 1]))
    ([3, 1, 1], [2, 1, 0])
    """
    past, valid = np.asarray(drafts_past, np.int64), np.asarray(valid_past, np.int64)
    if not len(past) or not past.max():
        return [], []
    j = np.arange(int(past.max()))[None, :]
    tried = ((j < past[:, None]) & (j <= valid[:, None])).sum(0)
    size = int(np.flatnonzero(tried)[-1]) + 1  # past the last draft the grammar was offered, nothing to say
    return tried[:size].tolist(), (j < valid[:, None]).sum(0)[:size].tolist()


def _add_chains(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return (np.pad(np.asarray(a, np.int64), (0, n - len(a))) + np.pad(np.asarray(b, np.int64), (0, n - len(b)))).tolist()


def kind_pools(specs: Iterable[SpecProfile]) -> dict[str, dict]:
    """Per kind, its specs' draft chains added up and their thinking accepts' mean (the
    :class:`~cdbench.harness.costs.grammar_profile.KindProfile` fields), where any spec measured them."""
    out: dict[str, dict] = {}
    think: dict[str, list[float]] = {}
    for s in specs:
        if s.draft_tried:
            pooled = out.setdefault(s.kind, {"draft_tried": [], "draft_valid": []})
            pooled["draft_tried"] = _add_chains(pooled["draft_tried"], s.draft_tried)
            pooled["draft_valid"] = _add_chains(pooled["draft_valid"], s.draft_valid)
        if s.think_accept_s is not None:
            think.setdefault(s.kind, []).append(s.think_accept_s)
    for kind, values in think.items():
        out.setdefault(kind, {})["think_accept_s"] = float(np.median(values))
    return out


def _round(x: float) -> float:
    return float(f"{x:.5g}")


def spec_sections(specs: Iterable[SpecSamples]) -> tuple[dict[str, SpecProfile], dict[str, KindShape]]:
    """Per-spec profiles (keyed by :func:`spec_key_hash`) and each kind's :class:`KindShape`."""
    out: dict[str, SpecProfile] = {}
    residuals: dict[str, list[np.ndarray]] = {}
    pooled: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for s in specs:
        curve: list[float] = []
        head: list[float] = []
        residual: list[float] = []
        outliers: list[float] = []
        outlier_rate = scale = 0.0
        if len(s.fill_s):
            bins = position_bins(s.positions)
            scale = float(np.mean(s.fill_s))
            # a fill's cell: its own position in the head, its bin past it. A cell of fewer than
            # MIN_SPREAD_FILLS fills is its own mean (residual 1, never an outlier): it says nothing of the
            # spread (a heavy fill measured once at a position may be the grammar's state there), and its
            # 1s would pull every position's draw towards its mean (above the median of skewed fills)
            head_n = min(HEAD_POSITIONS, int(s.positions.max()) + 1)
            at_head = s.positions < head_n
            cell = np.where(at_head, s.positions, head_n + bins)
            spread = np.bincount(cell)[cell] >= MIN_SPREAD_FILLS
            spike = _outliers(s.fill_s, cell, spread)
            body = ~spike
            by_bin = _bin_means(s.fill_s[body], bins[body])
            head_body = body & at_head
            counts = np.bincount(s.positions[head_body], minlength=head_n)
            sums = np.bincount(s.positions[head_body], weights=s.fill_s[head_body], minlength=head_n)
            by_head = np.where(counts > 0, sums / np.maximum(counts, 1),
                               by_bin[position_bins(np.arange(head_n))])
            level = np.where(at_head, by_head[np.minimum(s.positions, head_n - 1)], by_bin[bins])
            if scale > 0:
                curve = [_round(v / scale) for v in by_bin]
                head = [_round(v / scale) for v in by_head]
                with np.errstate(divide="ignore", invalid="ignore"):
                    r = s.fill_s / level
                r = np.where(level > 0, r, 1.0)
            else:  # a spec that filled for free (a constant-cost measurement)
                curve = [1.0] * N_POSITION_BINS
                head = [1.0] * head_n
                r = np.ones(len(s.fill_s))
            kept = body & spread if (body & spread).any() else body
            # the kind's residual keeps the outliers (relative to the body): its pooled draws carry their mass
            residuals.setdefault(s.kind, []).append(r[kept | spike])
            residual = [_round(v) for v in _equal_slices(np.sort(r[kept]))]
            if spike.any():
                outliers = [_round(v) for v in _equal_slices(np.sort(s.fill_s[spike]))]
                outlier_rate = float(spike.sum() / len(s.fill_s))
            pooled.setdefault(s.kind, []).append((s.fill_s, bins))
        tried, valid = draft_chain(s.drafts_past, s.valid_past)
        out[spec_key_hash(s.key_text)] = SpecProfile(
            kind=s.kind, spec_id=s.spec_id, corpus=corpus_of(s.spec_id), status=s.status, compile_s=s.compile_s,
            fills=len(s.fill_s), fill_scale_s=scale, fill_curve=curve, fill_head=head, fill_residual=residual,
            fill_outliers_s=outliers, fill_outlier_rate=outlier_rate,
            accept_s=float(np.median(s.accept_s)) if len(s.accept_s) else None,
            rollback_s=float(np.median(s.rollback_s)) if len(s.rollback_s) else None, walks=s.walks,
            rejected=len(s.rejected_at), rejected_at=int(np.median(s.rejected_at)) if s.rejected_at else None,
            draft_tried=tried, draft_valid=valid, random_walks=s.random_walks, walk_ends=sorted(s.walk_ends),
            think_accept_s=_round(s.think_s / s.think_tokens) if s.think_tokens else None)
    shapes = {}
    for kind, parts in pooled.items():
        fills = np.concatenate([f for f, _ in parts])
        bins = np.concatenate([b for _, b in parts])
        scale = float(np.mean(fills))
        curve = [_round(v / scale) if scale > 0 else 1.0 for v in _bin_means(fills, bins)]
        shapes[kind] = KindShape(np.concatenate(residuals[kind]), curve)
    return out, shapes


def group_samples(walks: Sequence, compiles: Sequence) -> list[SpecSamples]:
    """Each spec's samples from ``walks`` and ``compiles``
    (:class:`~cdbench.harness.costs.grammar_profile.WalkMeasurement` /
    :class:`~cdbench.harness.costs.grammar_profile.CompileMeasurement`), keyed by
    their ``key`` (default ``kind:spec_id``). A spec compiled several times keeps
    its median ok time (its first failure when none succeeded)."""
    order: dict[str, tuple[str, str | None]] = {}
    walked: dict[str, list] = {}
    compiled: dict[str, list] = {}
    for w in walks:
        key = w.key or spec_key_text(w.kind, w.spec_id)
        order.setdefault(key, (w.kind, w.spec_id))
        walked.setdefault(key, []).append(w)
    for c in compiles:
        key = c.key or spec_key_text(c.kind, c.spec_id)
        order.setdefault(key, (c.kind, c.spec_id))
        compiled.setdefault(key, []).append(c)
    out = []
    for key, (kind, spec_id) in order.items():
        ws = walked.get(key, [])

        def cat(name: str, ws=ws) -> np.ndarray:
            parts = [np.asarray(getattr(w, name), np.float64).ravel() for w in ws]
            return np.concatenate(parts) if parts else np.zeros(0)

        positions = [walk_positions(w) for w in ws]
        cs = compiled.get(key, [])
        ok = [c.seconds for c in cs if c.status == "ok"]
        failed = [c for c in cs if c.status != "ok"]
        status = "ok" if ok else (failed[0].status if failed else None)
        seconds = float(np.median(ok)) if ok else (failed[0].seconds if failed else None)
        out.append(SpecSamples(key, kind, spec_id, cat("fill_s"),
                               np.concatenate(positions) if positions else np.zeros(0, np.int64),
                               cat("accept_s"), cat("rollback_s"), seconds, status, len(ws),
                               tuple(w.rejected_at for w in ws if w.rejected_at is not None),
                               cat("drafts_past").astype(np.int64), cat("valid_past").astype(np.int64),
                               sum(w.random_walk for w in ws),
                               tuple(w.ended_at for w in ws if w.random_walk and w.ended_at is not None),
                               sum(w.think_tokens for w in ws), sum(w.think_s for w in ws)))
    return out
