"""Distributions of a run's table drawn from its row groups: the values are binned, never held.

A run of millions of requests has tens of millions of step rows; its report reads them a slice of a row
group at a time (:meth:`~cdbench.results.run_folder.SavedRun.chunks`) in two passes over the columns it needs: the
range first, then counts over :data:`FINE_BINS` bins of it (log-spaced where the values spread over
decades). The histograms draw those bins merged by :data:`MERGE`; quantiles and CDFs come from the fine
bins, exact up to one fine bin (the value interpolated inside it).

>>> values = np.random.default_rng(0).lognormal(size=10_000)
>>> hist = Binned.of(lambda: iter([(values[:4_000], None), (values[4_000:], None)]), log=True)
>>> hist.n, bool(abs(hist.quantile(0.5) / np.quantile(values, 0.5) - 1) < hist.relative_width)
(10000, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

MERGE = 80
"""Fine bins to a drawn bar (a histogram of 50 bars)."""
FINE_BINS = 50 * MERGE
"""Bins a distribution is counted in."""

Values = Iterator[tuple[np.ndarray, np.ndarray | None]]
"""Chunks of values and their weights (``None``: one each)."""


@dataclass(frozen=True)
class Binned:
    """Counts (weights summed) of a quantity over bins spanning its range.

    ``edges`` has one more entry than ``counts``; ``log``: the bins are log-spaced (values ≤ 0 left out);
    ``n``: the values counted; ``point``: all values (nearly) equal, one bin around them.
    """

    edges: np.ndarray
    counts: np.ndarray
    n: int
    log: bool
    point: bool = False

    @classmethod
    def of(cls, values: Callable[[], Values], log: bool | None, spread: float = 100.0) -> Binned | None:
        """Bin the values ``values()`` yields (called twice); ``None`` when there are none.

        ``log``: log-spaced bins when the positive values spread over more than a factor ``spread``
        (``None``: decided by that; ``False``: never); NaNs are dropped.
        """
        lo = lo_pos = math.inf
        hi = hi_pos = -math.inf
        for chunk, _ in values():
            chunk = chunk[~np.isnan(chunk)]
            if not len(chunk):
                continue
            lo, hi = min(lo, float(chunk.min())), max(hi, float(chunk.max()))
            positive = chunk[chunk > 0]
            if len(positive):
                lo_pos, hi_pos = min(lo_pos, float(positive.min())), max(hi_pos, float(positive.max()))
        if lo > hi:
            return None
        use_log = log is not False and hi_pos > spread * lo_pos
        point = not use_log and hi - lo <= 1e-9 * max(abs(lo), abs(hi))
        if point:  # one bar around the value (near-equal values would give empty bins)
            centre = (lo + hi) / 2
            half = abs(centre) * 0.05 or 0.5
            edges = np.array([centre - half, centre + half])
        elif use_log:
            edges = np.geomspace(lo_pos, hi_pos, FINE_BINS + 1)
        else:
            edges = np.linspace(lo, hi, FINE_BINS + 1)
        counts = np.zeros(len(edges) - 1)
        n = 0
        for chunk, weights in values():
            keep = ~np.isnan(chunk) & ((chunk > 0) if use_log else True)
            chunk = chunk[keep]
            # the last edge closes its bin (as numpy.histogram's does)
            where = np.clip(np.searchsorted(edges, chunk, side="right") - 1, 0, len(counts) - 1)
            counts += np.bincount(where, None if weights is None else weights[keep], minlength=len(counts))
            n += len(chunk)
        return cls(edges, counts, n, use_log, point)

    @property
    def relative_width(self) -> float:
        """A fine bin's width relative to the values in it (log bins) or to the range's top (linear)."""
        if self.log:
            return float(self.edges[1] / self.edges[0] - 1)
        return float((self.edges[-1] - self.edges[0]) / max(abs(self.edges[-1]), abs(self.edges[0])) / len(self.counts))

    def bars(self) -> tuple[np.ndarray, np.ndarray]:
        """The histogram's bars: (edges, counts), fine bins merged by :data:`MERGE`."""
        if self.point:
            return self.edges, self.counts
        return self.edges[::MERGE], self.counts.reshape(-1, MERGE).sum(axis=1)

    def cdf(self) -> tuple[np.ndarray, np.ndarray]:
        """(x, share of the weight at or below x) at the bins' edges."""
        cum = np.concatenate([[0.0], np.cumsum(self.counts)])
        return self.edges, cum / cum[-1] if cum[-1] else cum

    def quantile(self, q: float) -> float:
        """The ``q`` (0..1) quantile of the counted weight, interpolated inside its bin."""
        if self.point:
            return float(self.edges.mean())
        cum = np.cumsum(self.counts)
        target = q * cum[-1]
        i = min(int(np.searchsorted(cum, target)), len(cum) - 1)
        before = cum[i - 1] if i else 0.0
        inside = (target - before) / self.counts[i] if self.counts[i] else 0.0
        a, b = self.edges[i], self.edges[i + 1]
        return float(a * (b / a) ** inside if self.log else a + (b - a) * inside)
