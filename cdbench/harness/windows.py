"""Time-windowed figures of a run: per minute (runs up to :data:`MINUTES_UP_TO_S` long) or per hour.

A long run's overall p99 hides when it was slow; a capacity question ("p99 TTFT and goodput per hour of
a day of traffic") needs the figures by window. Requests are counted in the window of their issue time
(``issued_s``), windows start at virtual time 0, and windows without a request are left out. Counts
add up to the run's (requests, completed, failed, good, output tokens); latencies are exact per window.

Rows are read in chunks (:meth:`WindowTally.add`) in the order a run writes them, which is issue
order, so only the open windows' latencies are held: memory is bounded by a window's requests.

>>> import pandas as pd
>>> rows = pd.DataFrame({"issued_s": [1.0, 2.0, 61.0], "first_token_s": [1.5, 2.1, 61.2],
...                      "finish_s": [2.0, 3.0, 62.0], "output_tokens": [3, 1, 5],
...                      "abort_reason": ["", "", ""]})
>>> tally = WindowTally(60.0)
>>> tally.add(rows)
>>> [(w.start_s, w.requests, w.output_tokens) for w in tally.result().windows]
[(0.0, 2, 4), (60.0, 1, 5)]
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict


class Objectives(Protocol):
    """Service-level objectives in ms (``None``: no limit), as :class:`cdbench.harness.metrics.SLO` holds them."""

    ttft_ms: float | None
    tpot_ms: float | None
    e2el_ms: float | None


MINUTES_UP_TO_S = 6 * 3600.0
"""Runs whose last issue is at most this far into virtual time get one-minute windows; longer ones one-hour."""

COLUMNS = ("issued_s", "first_token_s", "finish_s", "output_tokens", "abort_reason")
"""The request columns the windows read."""


def window_length(last_issue_s: float) -> float:
    """Seconds per window of a run whose last request was issued at ``last_issue_s``."""
    return 60.0 if not last_issue_s > MINUTES_UP_TO_S else 3600.0


class TimeWindow(BaseModel):
    """One window's requests (by issue time): counts, throughput and latency figures (ms; ``None``: no
    completed request). ``good``: completed requests within every SLO (``None`` without SLOs)."""

    model_config = ConfigDict(extra="forbid")

    start_s: float
    requests: int
    completed: int
    failed: int
    good: int | None
    output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    mean_ttft_ms: float | None
    p50_ttft_ms: float | None
    p99_ttft_ms: float | None
    p99_tpot_ms: float | None
    p99_e2el_ms: float | None


class TimeWindows(BaseModel):
    """The ``time_windows`` section of ``summary.json``: ``window_s`` seconds each, in time order."""

    model_config = ConfigDict(extra="forbid")

    window_s: float
    windows: list[TimeWindow]


def _ms(values: np.ndarray, q: float | None = None) -> float | None:
    v = values[~np.isnan(values)] * 1e3
    if not len(v):
        return None
    return float(v.mean()) if q is None else float(np.percentile(v, q))


class WindowTally:
    """Counts and latencies per window, from request rows handed over in issue order.

    Parameters
    ----------
    window_s : seconds per window (:func:`window_length`).
    slo_ms : (TTFT, TPOT, E2EL) limits in ms for ``good`` (``None`` each: no limit; all ``None`` and
        ``has_slo`` false: no ``good`` count).
    """

    def __init__(self, window_s: float, slo_ms: tuple[float | None, float | None, float | None] = (None, None, None),
                 has_slo: bool = False) -> None:
        self.window_s, self.slo_ms, self.has_slo = window_s, slo_ms, has_slo
        self._open: dict[int, list[pd.DataFrame]] = {}
        self._done: list[TimeWindow] = []

    def add(self, rows: pd.DataFrame) -> None:
        """Count ``rows`` (the :data:`COLUMNS` of requests, in issue order)."""
        rows = rows[rows["issued_s"].notna()]
        if rows.empty:
            return
        index = np.floor(rows["issued_s"].to_numpy() / self.window_s).astype(np.int64)
        for w, part in rows.groupby(index, sort=True):
            self._open.setdefault(int(w), []).append(part)
        first = int(index.min())
        for w in sorted(k for k in self._open if k < first):  # issue order: earlier windows are complete
            self._done.append(self._window(w, pd.concat(self._open.pop(w))))

    def result(self) -> TimeWindows:
        """Every window counted so far, the open ones closed."""
        for w in sorted(self._open):
            self._done.append(self._window(w, pd.concat(self._open.pop(w))))
        self._done.sort(key=lambda window: window.start_s)
        return TimeWindows(window_s=self.window_s, windows=list(self._done))

    def _window(self, w: int, rows: pd.DataFrame) -> TimeWindow:
        ok = (rows["abort_reason"].astype(str) == "").to_numpy()
        done = rows[ok]
        ttft, e2el, tpot = latencies(done)
        good = int(within(ttft, tpot, e2el, self.slo_ms).sum()) if self.has_slo else None
        tokens = int(done["output_tokens"].sum())
        return TimeWindow(
            start_s=w * self.window_s, requests=len(rows), completed=int(ok.sum()), failed=int((~ok).sum()),
            good=good, output_tokens=tokens, request_throughput=int(ok.sum()) / self.window_s,
            request_goodput=None if good is None else good / self.window_s,
            output_throughput=tokens / self.window_s,
            mean_ttft_ms=_ms(ttft), p50_ttft_ms=_ms(ttft, 50), p99_ttft_ms=_ms(ttft, 99), p99_tpot_ms=_ms(tpot, 99),
            p99_e2el_ms=_ms(e2el, 99))


def latencies(done: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TTFT, E2EL and TPOT (seconds) of completed requests' rows, as :func:`cdbench.harness.metrics.summarize`
    defines them (TPOT ``NaN`` for a single output token)."""
    ttft = (done["first_token_s"] - done["issued_s"]).to_numpy()
    e2el = (done["finish_s"] - done["issued_s"]).to_numpy()
    out = done["output_tokens"].to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out > 1, (e2el - ttft) / np.maximum(out - 1, 1), np.nan)
    return ttft, e2el, tpot


def within(ttft: np.ndarray, tpot: np.ndarray, e2el: np.ndarray,
           limits: tuple[float | None, float | None, float | None]) -> np.ndarray:
    """Which requests meet every (TTFT, TPOT, E2EL) limit in ms (goodput's test; a NaN TPOT meets any)."""
    meets = np.ones(len(ttft), bool)
    for limit, values in zip(limits, (ttft, np.nan_to_num(tpot, nan=0.0), e2el)):
        if limit is not None:
            meets &= values * 1e3 <= limit
    return meets


def slo_limits(slo: Objectives | None) -> tuple[tuple[float | None, float | None, float | None], bool]:
    """(TTFT, TPOT, E2EL) limits of an SLO (or ``None``), and whether it is set."""
    if slo is None:
        return (None, None, None), False
    return (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms), True


def time_windows(requests: pd.DataFrame, slo: Objectives | None = None) -> TimeWindows | None:
    """The windows of an in-memory requests table (``None`` when no request was issued)."""
    issued = requests["issued_s"].to_numpy() if len(requests) else np.zeros(0)
    if not len(issued) or np.isnan(issued).all():
        return None
    tally = WindowTally(window_length(float(np.nanmax(issued))), *slo_limits(slo))
    tally.add(requests[list(COLUMNS)])
    return tally.result()


__all__ = ["COLUMNS", "MINUTES_UP_TO_S", "Objectives", "TimeWindow", "TimeWindows", "WindowTally", "latencies",
           "slo_limits", "time_windows", "window_length", "within"]
