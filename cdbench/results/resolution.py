"""How finely a run's requests resolve its latency figures: a request bootstrap.

A p99 TTFT of 150 requests is their second-longest TTFT: another draw of 150 requests from the same
workload could have put it anywhere among the five longest, so a model run 15 % off such a figure may
be as right as the run it is judged against. For each per-request latency figure (median, p90 and p99
of TTFT, TPOT and E2EL, as :func:`cdbench.harness.metrics.summarize` computes them) this gives its 95 %
interval over resamples of the run's completed requests drawn with replacement, relative to the
figure itself. A fidelity judgement (:mod:`cdbench.reports.fidelity`) shows it beside each error and
names an error beyond its bar but inside this interval *unresolved*: the run is too short to judge it.

Gaps between tokens (ITL) have no interval here: they are not kept by request, and the gaps of one step
move together, so resampling them one by one would understate their spread.

Examples
--------
>>> import pandas as pd
>>> rows = pd.DataFrame({"issued_s": [0.0] * 4, "first_token_s": [0.1, 0.2, 0.3, 0.4],
...                      "finish_s": [1.0, 1.2, 1.4, 1.6], "output_tokens": [10] * 4, "abort_reason": [""] * 4})
>>> band = request_resolution(rows, resamples=200)["p99_ttft_ms"]
>>> band.samples, band.value, band.low_pct <= 0.0 <= band.high_pct
(4, 397.0, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from cdbench.harness.windows import latencies

STATISTICS: tuple[tuple[str, float], ...] = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))
LATENCIES: tuple[str, ...] = ("ttft", "tpot", "e2el")
RESOLVED_FIGURES: tuple[str, ...] = tuple(f"{stat}_{lat}_ms" for lat in LATENCIES for stat, _ in STATISTICS)
"""The ``summary.json`` figures a request bootstrap resolves."""

RESAMPLES = 1000
LEVEL = 0.95
_CHUNK_VALUES = 1 << 22  # resampled values held at once (32 MiB of float64)


@dataclass(frozen=True, slots=True)
class Resolution:
    """One figure's interval over resamples of the run's requests."""

    figure: str
    value: float  # the figure as the run's summary computes it, ms
    low_pct: float  # the interval's ends relative to ``value``, percent (low <= 0 <= high)
    high_pct: float
    samples: int  # the requests it is computed over (a TPOT needs two output tokens)

    def holds(self, error_pct: float) -> bool:
        """Whether a relative error (percent) lies inside the interval."""
        return self.low_pct <= error_pct <= self.high_pct

    def requests_to_resolve(self, error_pct: float, bar_pct: float) -> int | None:
        """About how many requests the run would need for the interval's side toward ``error_pct`` to shrink
        within ``bar_pct`` (the interval taken to narrow as one over the root of the requests); ``None`` when it
        already is."""
        side = self.high_pct if error_pct >= 0 else -self.low_pct
        if side <= bar_pct or bar_pct <= 0:
            return None
        return math.ceil(self.samples * (side / bar_pct) ** 2)


def request_resolution(requests: pd.DataFrame, resamples: int = RESAMPLES, level: float = LEVEL,
                       seed: int = 0) -> dict[str, Resolution]:
    """Each figure of :data:`RESOLVED_FIGURES` with its ``level`` interval over ``resamples`` resamples of the
    completed requests (``abort_reason`` empty) of ``requests`` (a run's ``requests.parquet`` frame); the same
    ``seed`` draws the same resamples. A latency with fewer than two values has no entry."""
    done = requests[requests["abort_reason"] == ""]
    rng = np.random.default_rng(seed)
    tails = (100.0 * (1.0 - level) / 2.0, 100.0 * (1.0 + level) / 2.0)
    out: dict[str, Resolution] = {}
    for name, seconds in zip(("ttft", "e2el", "tpot"), latencies(done)):
        values = seconds[~np.isnan(seconds)] * 1e3
        n = len(values)
        if n < 2:
            continue
        quantiles = [q for _, q in STATISTICS]
        figures = np.percentile(values, quantiles)
        drawn = np.empty((resamples, len(quantiles)))
        chunk = max(1, _CHUNK_VALUES // n)
        for at in range(0, resamples, chunk):
            rows = min(chunk, resamples - at)
            drawn[at:at + rows] = np.percentile(values[rng.integers(0, n, (rows, n))], quantiles, axis=1).T
        for (stat, _), figure, column in zip(STATISTICS, figures, drawn.T):
            low, high = np.percentile(column, tails)
            scale = 100.0 / abs(figure) if figure else 0.0
            out[f"{stat}_{name}_ms"] = Resolution(f"{stat}_{name}_ms", float(figure), float(min(low - figure, 0.0)
                                                  * scale), float(max(high - figure, 0.0) * scale), n)
    return out
