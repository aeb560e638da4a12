"""How finely a workload's requests resolve a fidelity error: a paired request bootstrap.

A p99 TTFT of 150 requests is their second-longest TTFT: whether a model run's p99 sits 15 % below the
reference's can hang on which two or three requests the workload happened to draw. Both runs serve the
same requests, so the error is resampled pairwise: the workload's requests are drawn with replacement,
each run's figure is computed over its own completed requests among those drawn (as
:func:`cdbench.harness.metrics.summarize` computes it), and the relative error of the checked run against
the reference over 1,000 such draws (fewer for runs of over 20,000 requests) gives the error's 95 %
interval. A checked run of several copies is judged by the median of its copies' figures, in each draw as
well. The judgement
(:mod:`cdbench.reports.fidelity`) names an error beyond its bar whose interval still reaches into the bar
*unresolved*: the error rests on few enough requests that resampling them carries it back within the bar,
so the runs are too short to show the model wrong by more than that (nor right). Each request's latency is
taken as the run gave it; the queue couples requests, so this measures how much the figure hangs on which
requests it holds, not a rerun with other requests.

Per-request latency figures (median, p90 and p99 of TTFT, TPOT and E2EL) are resampled as they are. A run
keeps its gaps between tokens (ITL) in a histogram, not by request, so :func:`itl_error_intervals` rebuilds
each request's gaps from the step log (a running request's next token comes at the end of each step with
decode rows) and resamples those, where the rebuilt gaps give the run's own ITL figures within
:data:`ITL_MATCH` (the histogram's bins are 1.2 % wide); a run whose steps do not rebuild them (ranks whose
steps interleave) has no ITL interval. Throughput is one figure of the whole run and has none.

Examples
--------
>>> import pandas as pd
>>> def rows(ttft_s):
...     n = len(ttft_s)
...     return pd.DataFrame({"request_id": range(n), "issued_s": [0.0] * n, "first_token_s": ttft_s,
...                          "finish_s": [t + 1.0 for t in ttft_s], "output_tokens": [11] * n,
...                          "abort_reason": [""] * n})
>>> ref = rows([0.10, 0.20, 0.30, 0.40, 0.50, 0.60])
>>> twice = error_intervals(ref, [rows([0.20, 0.40, 0.60, 0.80, 1.00, 1.20])], resamples=200)
>>> twice["median_ttft_ms"].error_pct, twice["median_ttft_ms"].low_pct, twice["median_ttft_ms"].high_pct
(100.0, 100.0, 100.0)
>>> same = error_intervals(ref, [ref], resamples=200)["p99_ttft_ms"]
>>> (same.error_pct, same.low_pct, same.high_pct, same.samples)
(0.0, 0.0, 0.0, 6)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from cdbench.harness.windows import latencies
from cdbench.results.pack import STEP_QUANTUM_S

STATISTICS: tuple[tuple[str, float], ...] = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))
LATENCIES: tuple[str, ...] = ("ttft", "e2el", "tpot")  # the order :func:`latencies` returns them in
RESOLVED_FIGURES: tuple[str, ...] = tuple(f"{stat}_{lat}_ms" for lat in LATENCIES for stat, _ in STATISTICS)
"""The ``summary.json`` figures whose error a paired request bootstrap resolves from the requests table."""
_QUANTILES: tuple[float, ...] = tuple(q for _, q in STATISTICS)
ITL_FIGURES: tuple[str, ...] = tuple(f"{stat}_itl_ms" for stat, _ in STATISTICS)
"""The ITL figures, resolved from gaps rebuilt from the step log (:func:`itl_error_intervals`)."""
ITL_MATCH = 0.02  # rebuilt gaps must give each ITL figure within 2 % of the run's own to be resampled
MAX_GAPS = 20_000_000  # a run of more output tokens gets no ITL interval (its gaps alone would take GBs)

RESAMPLES = 1000
LEVEL = 0.95
EDGE_FACTOR = 100  # an error needing more than this many times the run's requests is at the bar's edge
VALUES_DRAWN = 20_000_000  # a run's latencies drawn at most: a run of more than 20,000 requests takes fewer draws
MIN_RESAMPLES = 100
_CHUNK_VALUES = 1 << 21  # resampled values held at once, per run


class ResolutionError(ValueError):
    """Runs whose requests cannot be paired (not the same workload's request ids)."""


@dataclass(frozen=True, slots=True)
class ErrorInterval:
    """One figure's relative error of a checked run against the reference, with its interval over paired
    resamples of the workload's requests (percent)."""

    figure: str
    error_pct: float  # over the requests as they are
    low_pct: float
    high_pct: float
    samples: int  # the workload's requests drawn in each resample

    def reaches(self, bar_pct: float) -> bool:
        """Whether the interval reaches into ``[-bar, +bar]``: the error may be within the bar."""
        return self.low_pct <= bar_pct and self.high_pct >= -bar_pct

    def requests_to_resolve(self, bar_pct: float) -> int | None:
        """About how many requests would keep the interval clear of the bar, were the error as it is: the side
        toward the bar narrowing as one over the root of the requests. ``None`` where it already is clear, where
        the error itself is within the bar, or where it sits so near the bar's edge that more than
        :data:`EDGE_FACTOR` times the requests would be needed (no run size settles an error at the edge)."""
        beyond = abs(self.error_pct) - bar_pct
        if beyond <= 0 or not self.reaches(bar_pct):
            return None
        side = self.error_pct - self.low_pct if self.error_pct > 0 else self.high_pct - self.error_pct
        needed = math.ceil(self.samples * (side / beyond) ** 2)
        return needed if needed <= EDGE_FACTOR * self.samples else None


def _latency_columns(requests: pd.DataFrame, ids: pd.Index) -> np.ndarray:
    """``[latency, request]`` in ms, aligned to ``ids``, NaN where a request did not complete (or has no TPOT)."""
    done = requests[requests["abort_reason"] == ""]
    values = np.stack(latencies(done)) * 1e3
    frame = pd.DataFrame(values.T, index=done["request_id"].to_numpy())
    if not frame.index.is_unique:
        raise ResolutionError("a run's requests table has repeated request ids")
    return frame.reindex(ids).to_numpy().T


def _figures(values: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """``[draw, statistic]`` figures of ``values`` (one latency, by request) over each draw of request
    positions (``rows``: ``[draw, request]``; ``None``: the requests as they are, one draw)."""
    drawn = values[None, :] if rows is None else values[rows]
    if not np.isnan(drawn).any():
        return np.percentile(drawn, _QUANTILES, axis=1).T
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a draw with no completed request: NaN, left out below
        return np.nanpercentile(drawn, _QUANTILES, axis=1).T


def _drawn_rows(seed: int, n: int, resamples: int) -> Iterator[tuple[int, np.ndarray]]:
    """The draws of request positions (``[draw, request]``), a chunk of at most :data:`_CHUNK_VALUES` values at a
    time, with the chunk's first draw's number: each draw from its own stream of ``seed``, so the draws do not
    depend on the chunks."""
    chunk = max(1, _CHUNK_VALUES // max(n, 1))
    for at in range(0, resamples, chunk):
        draws = range(at, min(at + chunk, resamples))
        yield at, np.stack([np.random.default_rng([seed, draw]).integers(0, n, n) for draw in draws])


def _workload_ids(reference: pd.DataFrame, checked: Sequence[pd.DataFrame]) -> pd.Index:
    """The reference's request ids, refusing a repeated id or a checked run with requests the reference lacks."""
    ids = pd.Index(reference["request_id"].to_numpy())
    if not ids.is_unique:
        raise ResolutionError("the reference's requests table has repeated request ids")
    for run in checked:
        if not pd.Index(run["request_id"].to_numpy()).isin(ids).all():
            raise ResolutionError("a checked run has requests the reference lacks: not the same workload")
    return ids


def _interval(figure: str, error: float, errors: np.ndarray, level: float, samples: int) -> ErrorInterval:
    """``error`` with the ``level`` interval of its drawn ``errors``, widened to hold ``error`` itself (a skewed
    spread can leave it outside its percentiles)."""
    low, high = np.percentile(errors, (100.0 * (1.0 - level) / 2.0, 100.0 * (1.0 + level) / 2.0))
    return ErrorInterval(figure, float(error), float(min(low, error)), float(max(high, error)), samples)


def resamples_for(requests: int, resamples: int = RESAMPLES) -> int:
    """The draws a workload of ``requests`` requests takes: ``resamples``, fewer where they would draw more than
    :data:`VALUES_DRAWN` values (at least :data:`MIN_RESAMPLES`; a long run's interval is narrow anyway).

    >>> resamples_for(600), resamples_for(100_000), resamples_for(10_000_000)
    (1000, 200, 100)
    """
    return max(MIN_RESAMPLES, min(resamples, VALUES_DRAWN // max(requests, 1)))


def error_intervals(reference: pd.DataFrame, checked: Sequence[pd.DataFrame], resamples: int = RESAMPLES,
                    level: float = LEVEL, seed: int = 0) -> dict[str, ErrorInterval]:
    """Each figure of :data:`RESOLVED_FIGURES`: the relative error of ``checked`` (one run's requests table, or
    several copies', judged by the median of their figures) against ``reference``, with its ``level`` interval
    over ``resamples`` paired draws of the reference's request ids (:func:`resamples_for`: fewer for a long run).
    The same ``seed`` draws the same requests.
    A figure some draw leaves without a value (too few completed requests) or the reference has at 0 is left
    out."""
    ids = _workload_ids(reference, checked)
    if ids.empty:
        return {}
    columns = [_latency_columns(frame, ids) for frame in (reference, *checked)]
    n = len(ids)
    resamples = resamples_for(n, resamples)
    out: dict[str, ErrorInterval] = {}
    for lat_index, lat in enumerate(LATENCIES):
        whole = [_figures(c[lat_index], None)[0] for c in columns]
        drawn = [np.empty((resamples, len(STATISTICS))) for _ in columns]
        for at, rows in _drawn_rows(seed, n, resamples):
            for figures, c in zip(drawn, columns):
                figures[at:at + len(rows)] = _figures(c[lat_index], rows)
        ref_whole, run_whole = whole[0], np.median(np.stack(whole[1:]), axis=0)
        ref_drawn, run_drawn = drawn[0], np.median(np.stack(drawn[1:]), axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            errors = (run_drawn - ref_drawn) / np.abs(ref_drawn) * 100.0
        for k, (stat, _) in enumerate(STATISTICS):
            if not ref_whole[k] or np.isnan(ref_whole[k]) or np.isnan(run_whole[k]) \
                    or not np.isfinite(errors[:, k]).all():
                continue
            error = (run_whole[k] - ref_whole[k]) / abs(ref_whole[k]) * 100.0
            out[f"{stat}_{lat}_ms"] = _interval(f"{stat}_{lat}_ms", error, errors[:, k], level, n)
    return out


def token_gaps(requests: pd.DataFrame, steps: pd.DataFrame, ids: pd.Index) -> tuple[np.ndarray, np.ndarray]:
    """Each completed request's gaps between its tokens (ms), rebuilt from the step log, with the request's
    position in ``ids``: a request's tokens after its first come at the ends of the steps with decode rows
    that end after its first token and no later than its finish."""
    decode = steps[steps["decode_rows"] > 0]
    # at a pack's resolution, so a run read from its folder and from a pack gives the same gaps
    per_second = round(1 / STEP_QUANTUM_S)
    start, duration = (np.rint(decode[column].to_numpy(np.float64) / STEP_QUANTUM_S) / per_second
                       for column in ("start_s", "duration_s"))
    ends = np.sort(start + duration)
    done = requests[requests["abort_reason"] == ""]
    first, finish = done["first_token_s"].to_numpy(), done["finish_s"].to_numpy()
    keep = ~(np.isnan(first) | np.isnan(finish))
    first, finish = first[keep], finish[keep]
    position = ids.get_indexer(done["request_id"].to_numpy()[keep])
    lo = np.searchsorted(ends, first, side="right")
    hi = np.searchsorted(ends, finish * (1 + 1e-12) + 1e-12, side="right")  # (a finish is a step's end, rounded)
    counts = np.maximum(hi - lo, 0)
    owner = np.repeat(np.arange(len(first)), counts)
    starts = np.cumsum(counts) - counts
    times = ends[lo[owner] + np.arange(len(owner)) - starts[owner]]
    previous = np.empty_like(times)
    previous[1:] = times[:-1]
    opens = starts[counts > 0]
    previous[opens] = first[counts > 0]
    return (times - previous) * 1e3, position[owner]


def _weighted_figures(gaps: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``[draw, statistic]`` percentiles of sorted ``gaps`` each counted ``weights[draw]`` times, as
    ``np.percentile`` of that many copies of each would give (linear between order statistics)."""
    quantiles = np.array(_QUANTILES) / 100.0
    cumulative = np.cumsum(weights, axis=1)
    out = np.full((len(weights), len(quantiles)), np.nan)
    for draw, cum in enumerate(cumulative):
        total = cum[-1] if len(cum) else 0
        if total == 0:
            continue
        h = (total - 1) * quantiles
        below = np.floor(h)
        at = np.searchsorted(cum, np.concatenate([below, np.minimum(below + 1, total - 1)]), side="right")
        low, high = gaps[at[:len(h)]], gaps[at[len(h):]]
        out[draw] = low + (h - below) * (high - low)
    return out


def itl_error_intervals(reference: tuple[pd.DataFrame, pd.DataFrame, Mapping[str, float]],
                        checked: Sequence[tuple[pd.DataFrame, pd.DataFrame, Mapping[str, float]]],
                        resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0) -> dict[str, ErrorInterval]:
    """:data:`ITL_FIGURES` as :func:`error_intervals` gives the per-request figures: each run a (requests, steps,
    summary) triple, its gaps rebuilt by :func:`token_gaps` and resampled by request, pairwise. Empty where a
    run's rebuilt gaps miss one of its own ITL figures by more than :data:`ITL_MATCH`, where it has none, or
    where it has more than :data:`MAX_GAPS` output tokens."""
    ids = _workload_ids(reference[0], [requests for requests, _, _ in checked])
    if ids.empty:
        return {}
    n = len(ids)
    rebuilt = []
    for requests, steps, summary in (reference, *checked):
        if int(requests["output_tokens"].sum()) > MAX_GAPS:
            return {}
        gaps, owner = token_gaps(requests, steps, ids)
        if not len(gaps):
            return {}
        whole = np.percentile(gaps, _QUANTILES)
        for figure, value in zip(ITL_FIGURES, whole):
            own = summary.get(figure)
            if own is None or not own or abs(value - own) > ITL_MATCH * abs(own):
                return {}
        order = np.argsort(gaps, kind="stable")
        rebuilt.append((gaps[order], owner[order], whole))
    resamples = resamples_for(max(n, max(len(g) for g, _, _ in rebuilt)), resamples)
    figures = [np.empty((resamples, len(STATISTICS))) for _ in rebuilt]
    for at, rows in _drawn_rows(seed, n, resamples):
        counts = np.zeros((len(rows), n), np.int64)
        np.add.at(counts, (np.repeat(np.arange(len(rows)), n), rows.ravel()), 1)
        for drawn, (gaps, owner, _) in zip(figures, rebuilt):
            step = max(1, _CHUNK_VALUES // len(gaps))
            for sub in range(0, len(rows), step):
                drawn[at + sub:at + sub + step] = _weighted_figures(gaps, counts[sub:sub + step][:, owner])
    ref_drawn, run_drawn = figures[0], np.median(np.stack(figures[1:]), axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        errors = (run_drawn - ref_drawn) / np.abs(ref_drawn) * 100.0
    out: dict[str, ErrorInterval] = {}
    own_ref = reference[2]
    own_run = np.median([[summary[f] for f in ITL_FIGURES] for _, _, summary in checked], axis=0)
    for k, figure in enumerate(ITL_FIGURES):
        if not np.isfinite(errors[:, k]).all():
            continue
        # the judged error is the runs' own (from their histograms); the rebuilt gaps give its spread
        error = (own_run[k] - own_ref[figure]) / abs(own_ref[figure]) * 100.0
        rebuilt_error = (np.median([r[2][k] for r in rebuilt[1:]]) - rebuilt[0][2][k]) / abs(rebuilt[0][2][k]) * 100.0
        out[figure] = _interval(figure, error, errors[:, k] + (error - rebuilt_error), level, n)
    return out
