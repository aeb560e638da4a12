"""Fidelity: how far runs of one workload sit from a reference run, beside the noise floor.

The reference is the first run (typically a ``hybrid`` run, which measures
real grammar backends); each other run (typically ``model`` mode) gets the
relative error of every fidelity metric against it, ``(run - ref) / |ref|``.
Two or more ``hybrid`` runs with the same seed differ only by host noise; the
largest absolute relative error per metric of any of them against the first
is the *noise floor* (with two runs, simply their spread), and a figure passes
when ``|error| <= max(tolerance, noise)``. The first noise run is usually the
reference itself, so the floor is measured against what the runs are judged
against. Metrics without a tolerance are reported only.

A checked run may come as several copies (``model`` runs of one workload with
other draws of the model's own randomness): it is judged by the median of its
copies' figures, metric by metric, and the range of the copies' errors is
reported beside it, so one lucky or unlucky draw neither passes nor fails it.

Given the runs' requests (and steps, for ITL), each latency figure's error carries its 95 % interval over
paired resamples of the workload's requests (:mod:`cdbench.results.resolution`), and
an error beyond its bar whose interval still reaches into the bar is *unresolved*: it still fails,
and the report says the runs are too short to judge it and about how many requests would.

Examples
--------
>>> result = evaluate_fidelity({"hybrid": {"median_ttft_ms": 20.0}, "model": {"median_ttft_ms": 21.5}},
...                            tolerances={"median_ttft_ms": 5.0})
>>> cell = result.cells[0]
>>> round(cell.error_pct, 1), cell.verdict.value
(7.5, 'beyond')
>>> noisy = evaluate_fidelity({"hybrid": {"median_ttft_ms": 20.0}, "model": {"median_ttft_ms": 21.5}},
...                           noise=({"median_ttft_ms": 20.0}, {"median_ttft_ms": 18.0}),
...                           tolerances={"median_ttft_ms": 5.0})
>>> noisy.cells[0].noise_pct, noisy.cells[0].verdict.value
(10.0, 'within')
>>> three = evaluate_fidelity({"hybrid": {"median_ttft_ms": 20.0}, "model": {"median_ttft_ms": 21.5}},
...                           noise=({"median_ttft_ms": 20.0}, {"median_ttft_ms": 21.0}, {"median_ttft_ms": 18.0}))
>>> three.cells[0].noise_pct  # the largest of 5 % and 10 % against the first noise run
10.0
>>> drawn = evaluate_fidelity({"live": {"median_ttft_ms": 20.0}, "model": [
...     {"median_ttft_ms": 19.0}, {"median_ttft_ms": 20.5}, {"median_ttft_ms": 23.0}]},
...                            tolerances={"median_ttft_ms": 5.0})
>>> drawn.cells[0].error_pct, drawn.cells[0].spread_pct, drawn.cells[0].verdict.value
(2.5, (-5.0, 15.0), 'within')
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np
import pandas as pd
from rich.table import Table

from cdbench.reports.compare import figure_sections, overlaid_cdfs, summary_only_lines
from cdbench.reports.gate import GateError, check_tolerance_names, numeric_metrics
from cdbench.reports.tables import format_value
from cdbench.results.resolution import (
    RESAMPLES,
    ErrorInterval,
    ResolutionError,
    error_intervals,
    itl_error_intervals,
)
from cdbench.results.run_folder import WORKLOAD_TRACE_FILE, SavedRun

FIDELITY_METRICS: tuple[str, ...] = (
    *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el") for stat in ("median", "p90", "p99")),
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_grammar_wait_ms",
    "median_grammar_wait_ms",
    "p99_grammar_wait_ms",
    "mean_compile_ms",
    "p99_compile_ms",
    "mask_share",
)
"""The metrics every fidelity report shows, in this order (``summary.json`` names)."""

ACCEPTANCE_TOLERANCES: dict[str, float] = {
    "median_ttft_ms": 5.0,
    "median_tpot_ms": 5.0,
    "request_throughput": 5.0,
    "p99_ttft_ms": 10.0,
    "p99_tpot_ms": 10.0,
    "p99_itl_ms": 10.0,
}
"""Default tolerances (percent |relative error|): the bar ``model`` mode with a run's own in-situ
grammar profile must meet against that ``hybrid`` run."""


class FidelityError(GateError):
    """Runs that cannot be compared for fidelity (different workloads, too few runs, a bad noise set)."""


class FidelityVerdict(str, Enum):
    WITHIN = "within"
    BEYOND = "beyond"
    NO_DATA = "no data"  # a value is missing (or the reference is 0 while the run is not): fails when checked
    INFO = "info"  # no tolerance: reported only


@dataclass(frozen=True, slots=True)
class FidelityCell:
    """One metric of one run against the reference."""

    metric: str
    run: str
    reference: float | None
    value: float | None
    error_pct: float | None  # signed: (value - reference) / |reference| * 100
    noise_pct: float | None  # largest |relative error| of a noise run against the first noise run
    tolerance_pct: float | None
    verdict: FidelityVerdict
    copies: int = 1  # runs whose median is ``value``
    spread_pct: tuple[float, float] | None = None  # the copies' smallest and largest error (copies > 1)
    interval: ErrorInterval | None = None  # the error's interval over paired resamples of the workload's requests

    @property
    def allowed_pct(self) -> float | None:
        """The bar this cell is held to: max(tolerance, noise); ``None`` when it has no tolerance."""
        if self.tolerance_pct is None:
            return None
        return max(self.tolerance_pct, self.noise_pct or 0.0)

    @property
    def unresolved(self) -> bool:
        """Beyond its bar, but its interval reaches into the bar: the runs are too short to judge it."""
        return (self.verdict is FidelityVerdict.BEYOND and self.interval is not None
                and self.interval.reaches(self.allowed_pct))  # type: ignore[arg-type]

    @property
    def requests_to_resolve(self) -> int | None:
        """For an unresolved cell, about how many requests would judge it
        (:meth:`~cdbench.results.resolution.ErrorInterval.requests_to_resolve`)."""
        if not self.unresolved:
            return None
        return self.interval.requests_to_resolve(self.allowed_pct)  # type: ignore[union-attr,arg-type]


@dataclass(frozen=True, slots=True)
class FidelityResult:
    """Every metric of every compared run; ``passed`` is False when a checked cell is beyond its bar."""

    reference: str
    runs: tuple[str, ...]
    metrics: tuple[str, ...]
    cells: tuple[FidelityCell, ...]
    noise_runs: tuple[str, ...] | None = None  # the first is the one the others are measured against

    @property
    def failures(self) -> tuple[FidelityCell, ...]:
        return tuple(c for c in self.cells if c.tolerance_pct is not None
                     and c.verdict in (FidelityVerdict.BEYOND, FidelityVerdict.NO_DATA))

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def unresolved(self) -> tuple[FidelityCell, ...]:
        """The failures whose interval reaches into their bar (:attr:`FidelityCell.unresolved`)."""
        return tuple(c for c in self.failures if c.unresolved)

    def cell(self, metric: str, run: str) -> FidelityCell:
        return next(c for c in self.cells if c.metric == metric and c.run == run)


def relative_error_pct(reference: float | None, value: float | None) -> float | None:
    """``(value - reference) / |reference|`` in percent; 0 when equal, ``None`` when either is missing or the
    reference is 0 while the value is not (no finite relative error exists).

    >>> relative_error_pct(10.0, 12.0), relative_error_pct(0.0, 0.0), relative_error_pct(0.0, 1.0)
    (20.0, 0.0, None)
    """
    if reference is None or value is None:
        return None
    if reference == value:
        return 0.0
    if reference == 0.0:
        return None
    return (value - reference) / abs(reference) * 100.0


Copies = Sequence[Mapping[str, object]]
"""Several runs of one checked label, judged by their median (:func:`evaluate_fidelity`)."""


def _median_of_copies(values: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per metric, the median of the copies' numeric values (a metric some copy lacks is left out)."""
    shared = set(values[0]).intersection(*values[1:])
    return {metric: float(np.median([v[metric] for v in values])) for metric in shared}


def evaluate_fidelity(
    summaries: Mapping[str, Mapping[str, object] | Copies],
    noise: Sequence[Mapping[str, object]] | None = None,
    tolerances: Mapping[str, float] | None = None,
    noise_labels: Sequence[str] | None = None,
    intervals: Mapping[str, Mapping[str, ErrorInterval]] | None = None,
) -> FidelityResult:
    """Relative error of every run after the first against the first, per metric.

    ``summaries``: label → ``summary.json`` mapping, the reference first; a checked label may map to a
    sequence of copies' summaries instead, judged by their per-metric median (each cell's ``spread_pct``: the
    copies' smallest and largest error). ``noise``: the summaries of two or
    more same-seed runs; per metric, the largest |relative error| of any of them against the first is the
    noise floor, and a metric some noise run cannot be compared on (missing, or 0 in the first) has none.
    ``noise_labels``: their names, one per summary, in the same order. ``tolerances``: metric → percent; a
    metric named here that is not among :data:`FIDELITY_METRICS` is added to the rows (it must be a
    numeric metric of a run). ``intervals``: label → figure → the error's interval
    (:func:`~cdbench.results.resolution.error_intervals`), carried by that run's cells of those figures.
    """
    if len(summaries) < 2:
        raise FidelityError("fidelity needs at least two runs: the reference first, then the runs to check")
    if noise is not None and len(noise) < 2:
        raise FidelityError(f"the noise floor needs at least two same-seed runs, got {len(noise)}")
    if noise_labels is not None and (noise is None or len(noise_labels) != len(noise)):
        raise FidelityError(f"{len(noise_labels)} noise labels for {0 if noise is None else len(noise)} noise runs")
    tolerances = dict(tolerances or {})
    labels = list(summaries)
    copies = {label: [numeric_metrics(s) for s in value] for label, value in summaries.items()
              if not isinstance(value, Mapping)}
    if labels[0] in copies:
        raise FidelityError(f"the reference {labels[0]!r} is one run, not {len(copies[labels[0]])} copies")
    for label, runs in copies.items():
        if not runs:
            raise FidelityError(f"{label!r} has no copies")
    numeric = {label: _median_of_copies(copies[label]) if label in copies
               else numeric_metrics(value)  # type: ignore[arg-type]
               for label, value in summaries.items()}
    known = set(FIDELITY_METRICS).union(*numeric.values())
    check_tolerance_names(tolerances, known, "--tolerance")
    metrics = (*FIDELITY_METRICS, *sorted(set(tolerances) - set(FIDELITY_METRICS)))
    noise_values = tuple(numeric_metrics(s) for s in noise) if noise is not None else None
    reference = labels[0]
    cells = []
    for metric in metrics:
        noise_pct = None
        if noise_values is not None:
            first = noise_values[0].get(metric)
            spreads = [relative_error_pct(first, other.get(metric)) for other in noise_values[1:]]
            # a floor taken over only some noise runs would understate the spread; without it the bar is stricter
            noise_pct = None if None in spreads else max(abs(spread) for spread in spreads)
        tol = tolerances.get(metric)
        ref = numeric[reference].get(metric)
        for label in labels[1:]:
            value = numeric[label].get(metric)
            error = relative_error_pct(ref, value)
            if error is None:
                verdict = FidelityVerdict.NO_DATA
            elif tol is None:
                verdict = FidelityVerdict.INFO
            else:
                verdict = (FidelityVerdict.WITHIN if abs(error) <= max(tol, noise_pct or 0.0)
                           else FidelityVerdict.BEYOND)
            spread = None
            if label in copies and len(copies[label]) > 1:
                errors = [relative_error_pct(ref, run.get(metric)) for run in copies[label]]
                spread = None if None in errors else (min(errors), max(errors))  # type: ignore[type-var]
            cells.append(FidelityCell(metric, label, ref, value, error, noise_pct, tol, verdict,
                                      len(copies[label]) if label in copies else 1, spread,
                                      (intervals or {}).get(label, {}).get(metric)))
    return FidelityResult(reference, tuple(labels[1:]), metrics, tuple(cells),
                          None if noise_labels is None else tuple(noise_labels))


def paired_intervals(runs: Mapping[str, SavedRun | Sequence[SavedRun]]) -> dict[str, dict[str, ErrorInterval]]:
    """Label → figure → the error's interval (:func:`~cdbench.results.resolution.error_intervals`) of each
    run after the first (the reference) against it; a checked label may map to its copies. A run saved
    without its requests table, or whose requests are not the reference's, has none."""
    labels = list(runs)
    reference = runs[labels[0]]
    if not isinstance(reference, SavedRun) or not reference.has_tables:
        return {}
    out = {}
    for label in labels[1:]:
        value = runs[label]
        checked = [value] if isinstance(value, SavedRun) else list(value)
        if not checked or not all(run.has_tables for run in checked):
            continue
        try:
            out[label] = {**error_intervals(reference.requests, [run.requests for run in checked]),
                          **itl_error_intervals(_records(reference), [_records(run) for run in checked])}
        except ResolutionError:
            continue
    return out


def _records(run: SavedRun) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, float]]:
    """A run's requests, steps and numeric summary, as :func:`~cdbench.results.resolution.itl_error_intervals`
    takes them."""
    return run.requests, run.steps, numeric_metrics(run.summary)


# ----------------------------------------------------------------------------- same workload


@dataclass(frozen=True, slots=True)
class WorkloadIdentity:
    """What a run's workload is compared by: the digest of its requests (or of its config's workload section)."""

    source: str
    digest: str


def workload_identity(run: SavedRun, by_config: bool = False) -> WorkloadIdentity:
    """The digest of the request lines of the run's ``workload.trace.jsonl`` (its header, which restates the
    config with every default of the cdbench version that wrote it, is left out), or with ``by_config`` or
    no trace, of the ``workload`` section of its ``config.yaml``."""
    trace = None if by_config else run.read_file(WORKLOAD_TRACE_FILE)
    if trace is not None:
        digest = hashlib.sha256()
        lines = io.BytesIO(trace)
        next(lines, None)  # line 1 is the header
        for line in lines:
            digest.update(line)
        return WorkloadIdentity(f"the requests in {WORKLOAD_TRACE_FILE}", digest.hexdigest())
    section = run.config.get("workload", {})
    text = json.dumps(section, sort_keys=True, default=str)
    return WorkloadIdentity("the workload section of config.yaml", hashlib.sha256(text.encode()).hexdigest())


def check_same_workload(runs: Mapping[str, SavedRun]) -> None:
    """Raise :class:`FidelityError` naming the first run whose workload differs from the first run's."""
    labels = list(runs)
    by_config = any(run.read_file(WORKLOAD_TRACE_FILE) is None for run in runs.values())
    first = workload_identity(runs[labels[0]], by_config)
    for label in labels[1:]:
        other = workload_identity(runs[label], by_config)
        if other.digest != first.digest:
            raise FidelityError(
                f"run {runs[label].ref} has a different workload from {runs[labels[0]].ref} "
                f"(compared by {first.source}); give --allow-different-workloads to compare them anyway")


# ----------------------------------------------------------------------------- output


def _pct(value: float | None, signed: bool = True) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:+.1f}%" if signed else f"{value:.1f}%"


def fidelity_frame(result: FidelityResult) -> pd.DataFrame:
    """One row a (metric, run): reference, value, error, noise, tolerance, allowed bar and verdict."""
    rows = [{"metric": c.metric, "run": c.run, "reference": c.reference, "value": c.value,
             "error_pct": c.error_pct, "abs_error_pct": None if c.error_pct is None else abs(c.error_pct),
             "noise_pct": c.noise_pct, "tolerance_pct": c.tolerance_pct, "allowed_pct": c.allowed_pct,
             "verdict": c.verdict.value, "copies": c.copies,
             "spread_min_pct": c.spread_pct[0] if c.spread_pct else None,
             "spread_max_pct": c.spread_pct[1] if c.spread_pct else None,
             "interval_low_pct": c.interval.low_pct if c.interval else None,
             "interval_high_pct": c.interval.high_pct if c.interval else None,
             "unresolved": c.unresolved, "requests_to_resolve": c.requests_to_resolve} for c in result.cells]
    return pd.DataFrame(rows, columns=["metric", "run", "reference", "value", "error_pct", "abs_error_pct",
                                       "noise_pct", "tolerance_pct", "allowed_pct", "verdict", "copies",
                                       "spread_min_pct", "spread_max_pct", "interval_low_pct",
                                       "interval_high_pct", "unresolved", "requests_to_resolve"])


def spread_text(low: float | None, high: float | None) -> str:
    """A checked run's copies' range of errors, as the tables write it beside their median's error.

    >>> spread_text(-4.5, 13.25), spread_text(None, None)
    (' [-4.5..+13.2]', '')
    """
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return ""
    return f" [{low:+.1f}..{high:+.1f}]"


def _bar(cell: FidelityCell) -> str:
    if cell.tolerance_pct is None:
        return "-"
    if cell.noise_pct is not None and cell.noise_pct > cell.tolerance_pct:
        return f"{cell.noise_pct:.1f}% (noise)"
    return f"{cell.tolerance_pct:g}%"


def unresolved_text(low: float, high: float, requests: int | None) -> str:
    """The note an unresolved error carries: its interval, and about how many requests would judge it (``None``:
    the error is at its bar's edge, where no run size would).

    >>> unresolved_text(-50.34, 7.8, 1900), unresolved_text(-20.0, -9.0, None)
    (' (unresolved: -50.3..+7.8, ~1,900 requests)', " (unresolved: -20.0..-9.0, at the bar's edge)")
    """
    more = f", ~{requests:,} requests" if requests else ", at the bar's edge"
    return f" (unresolved: {low:+.1f}..{high:+.1f}{more})"


def _rows(result: FidelityResult, mark: tuple[str, str]) -> list[list[str]]:
    """Table rows: metric, reference value, then per run its value and error, then noise, bar and the
    reference's interval over resamples of its requests."""
    rows = []
    for metric in result.metrics:
        cells = [result.cell(metric, run) for run in result.runs]
        row = [metric, format_value(cells[0].reference)]
        for cell in cells:
            error = _pct(cell.error_pct)
            if cell.tolerance_pct is not None and cell.verdict is not FidelityVerdict.WITHIN:
                error = f"{mark[0]}{error}{mark[1]}"
            if cell.unresolved:
                error += unresolved_text(cell.interval.low_pct, cell.interval.high_pct,  # type: ignore[union-attr]
                                         cell.requests_to_resolve)
            if cell.spread_pct:
                error += spread_text(*cell.spread_pct)
            row += [format_value(cell.value), error]
        row += [_pct(cells[0].noise_pct, signed=False), _bar(cells[0])]
        rows.append(row)
    return rows


def _header(result: FidelityResult) -> list[str]:
    header = ["metric", result.reference]
    for run in result.runs:
        header += [run, f"{run} error"]
    return [*header, "noise", "bar"]


def fidelity_markdown(result: FidelityResult) -> str:
    """The table as markdown; a checked error beyond its bar is bold."""
    header = _header(result)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(result, ("**", "**"))]
    return "\n".join(lines)


def fidelity_rich(result: FidelityResult) -> Table:
    """The table for the terminal; a checked error beyond its bar is red."""
    table = Table(title=f"Fidelity (relative error against {result.reference})", title_justify="left")
    for i, name in enumerate(_header(result)):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in _rows(result, ("[bold red]", "[/]")):
        table.add_row(*row)
    return table


def verdict_line(result: FidelityResult) -> str:
    """One line: how many checked figures are within their bar."""
    checked = [c for c in result.cells if c.tolerance_pct is not None]
    if result.passed:
        return f"all {len(checked)} checked figures within their bar"
    names = ", ".join(f"{c.metric} ({c.run})" for c in result.failures)
    line = f"{len(result.failures)} of {len(checked)} checked figures beyond their bar: {names}"
    if result.unresolved:
        line += (f"; {len(result.unresolved)} of them unresolved (their 95 % interval over resampled requests "
                 "reaches into the bar: too few requests to judge)")
    return line


def _noise_text(labels: tuple[str, ...] | None) -> str:
    """Which runs made the noise floor, for ``fidelity.md``."""
    if labels is None:
        return "none given: every bar is the tolerance alone"
    if len(labels) == 2:
        return f"|relative error| between `{labels[0]}` and `{labels[1]}` (same seed)"
    others = ", ".join(f"`{label}`" for label in labels[1:])
    return f"the largest |relative error| of {others} against `{labels[0]}` (same seed)"


def _copies_lines(result: FidelityResult) -> list[str]:
    """Which checked runs are medians of copies, for ``fidelity.md``."""
    copies = {c.run: c.copies for c in result.cells if c.copies > 1}
    return [f"`{run}`: the median of {n} copies' figures (its CDFs draw the first); [low..high]: the copies' "
            "smallest and largest error." for run, n in copies.items()]


def _resolution_lines(result: FidelityResult) -> list[str]:
    """What an unresolved error's note means, for ``fidelity.md`` (when any cell has an interval)."""
    if not any(c.interval for c in result.cells):
        return []
    return [f"Unresolved: an error beyond its bar whose 95 % interval over {RESAMPLES:,} paired resamples of the "
            "workload's requests (latencies and ITL; in `fidelity.csv` for every such figure) reaches "
            "into the bar. It fails; the runs are too short to judge it (~N: about the requests that would; at the "
            "bar's edge: an error so near its bar that no run size would)."]


def write_fidelity(runs: Mapping[str, SavedRun], result: FidelityResult, out_dir: Path,
                   noise_runs: Mapping[str, SavedRun] | None = None) -> Path:
    """Write ``fidelity.md``, ``fidelity.csv`` and overlaid CDFs (``plots/``) into ``out_dir``; returns the md path.

    The noise runs, when given, are drawn in the CDFs too; runs saved without their tables are not.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = overlaid_cdfs({**runs, **(noise_runs or {})}, out_dir / "plots")
    noise = _noise_text(result.noise_runs)
    lines = ["# cdbench fidelity", "",
             "Runs: " + ", ".join(f"`{label}` ({run.ref})" for label, run in runs.items()),
             f"Reference: `{result.reference}`; error = (run - reference) / |reference|.",
             f"Noise floor: {noise}. A checked figure passes when |error| <= max(tolerance, noise).",
             *_resolution_lines(result), *_copies_lines(result), "",
             fidelity_markdown(result), "", f"Verdict: {verdict_line(result)}.", "",
             *figure_sections(figures, out_dir), *summary_only_lines({**runs, **(noise_runs or {})})]
    md = out_dir / "fidelity.md"
    md.write_text("\n".join(lines))
    fidelity_frame(result).replace({np.nan: None}).to_csv(out_dir / "fidelity.csv", index=False)
    return md
