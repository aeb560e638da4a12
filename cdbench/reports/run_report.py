"""A run folder's ``report.md`` and ``plots/*.png``, built from its saved results alone.

Which plots appear depends on what the run did: the rollback plot needs
speculative decoding, the rank-skew plot more than one rank, the compile plot
at least one compile. A plot that has no data is left out and the report says
why, rather than showing an empty figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import yaml

from cdbench.reports import plots
from cdbench.reports.binned import Binned
from cdbench.reports.tables import summary_sections, to_markdown
from cdbench.results.run_folder import WORKLOAD_TRACE_FILE, SavedRun
from cdbench.results.stopped_run import STOPPED_SUMMARY_FILE, status_of
from cdbench.workloads.workload import WorkloadReport

STEP_PARTS = ("forward_s", "fill_s", "copy_s", "transfer_s", "apply_s", "sample_s", "schedule_s", "poll_s", "sync_s",
              "check_s", "process_s")
"""Per-step time components of ``steps.parquet`` shown in the breakdown (seconds)."""


@dataclass(frozen=True, slots=True)
class Figure:
    """One plot of a report: where it is, its caption, or why it was left out."""

    name: str
    caption: str
    path: Path | None
    skipped_because: str | None = None


def request_latencies_ms(requests: pd.DataFrame) -> pd.DataFrame:
    """TTFT, TPOT and E2EL per completed request, in milliseconds (vLLM's definitions; TPOT needs ≥ 2 tokens)."""
    done = requests[(requests["abort_reason"].astype(str) == "") & requests["first_token_s"].notna()]
    ttft = (done["first_token_s"] - done["issued_s"]) * 1e3
    e2el = (done["finish_s"] - done["issued_s"]) * 1e3
    tokens = done["output_tokens"].astype(float)
    tpot = ((e2el - ttft) / (tokens - 1)).where(tokens > 1)
    return pd.DataFrame({"ttft_ms": ttft, "tpot_ms": tpot, "e2el_ms": e2el, "structured": done["structured"]})


_LATENCY_COLUMNS = ("abort_reason", "first_token_s", "issued_s", "finish_s", "output_tokens", "structured")


def _latency_cdfs(run: SavedRun, plot_dir: Path) -> list[Figure]:
    def values(metric: str, structured: bool | None) -> Callable[[], Iterator[tuple[np.ndarray, None]]]:
        def read() -> Iterator[tuple[np.ndarray, None]]:
            for chunk in run.chunks("requests", _LATENCY_COLUMNS):
                lat = request_latencies_ms(chunk)
                if structured is not None:
                    lat = lat[lat["structured"].to_numpy() == structured]
                yield lat[metric].to_numpy(float), None
        return read

    mixed = [False, False]  # some structured, some not
    for chunk in run.chunks("requests", _LATENCY_COLUMNS):
        kinds = request_latencies_ms(chunk)["structured"].to_numpy(bool)
        mixed = [mixed[0] or bool(kinds.any()), mixed[1] or bool((~kinds).any())]
    figures = []
    for metric, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        every = Binned.of(values(metric, None), log=None)
        if every is None:
            if metric == "ttft_ms":
                return [Figure("latency_cdf", "TTFT and TPOT CDFs", None, "no request completed")]
            figures.append(Figure("tpot_cdf", "TPOT CDF", None, "no completed request had two output tokens"))
            continue
        series = {"all": every}
        if all(mixed):
            for name, structured in (("structured", True), ("unconstrained", False)):
                part = Binned.of(values(metric, structured), log=every.log)
                if part is not None:
                    series[name] = part
        path = plots.binned_cdf_plot(series, f"{label} (ms)", f"{label} CDF", plot_dir / f"{metric[:-3]}_cdf.png")
        figures.append(Figure(f"{metric[:-3]}_cdf", f"{label} CDF (structured vs unconstrained requests when mixed)", path))
    return figures


def _busy(chunk: pd.DataFrame) -> pd.DataFrame:
    return chunk[(chunk["kind"] != "idle").to_numpy()]


def _time_bins(run: SavedRun, select: Callable[[pd.DataFrame], pd.DataFrame], most: int
               ) -> tuple[np.ndarray, Callable[[pd.DataFrame], np.ndarray]] | None:
    """Bins of virtual time over the steps ``select`` keeps: their edges (at most ``most`` bins) and the bin of
    each kept step of a chunk; ``None`` when no step is kept."""
    lo, hi, n = math.inf, -math.inf, 0
    for chunk in run.chunks("steps", ("kind", "start_s")):
        start = select(chunk)["start_s"].to_numpy()
        if len(start):
            lo, hi, n = min(lo, float(start.min())), max(hi, float(start.max())), n + len(start)
    if not n:
        return None
    bins = min(most, n)
    edges = np.linspace(lo, hi + 1e-12, bins + 1)
    return edges, lambda chunk: np.clip(np.digitize(chunk["start_s"].to_numpy(), edges) - 1, 0, bins - 1)


def _step_breakdown(run: SavedRun, plot_dir: Path) -> list[Figure]:
    # Bin steps over virtual time so a long run stays readable: mean per-step time of each part per bin.
    binned = _time_bins(run, _busy, 200)
    if binned is None:
        return [Figure("step_breakdown", "Step-time breakdown", None, "no step ran")]
    edges, bin_of = binned
    present = set(_columns(run, "steps"))
    shown = [c for c in ("duration_s", "exposed_cpu_s", "hidden_cpu_s", *STEP_PARTS) if c in present]
    bins = len(edges) - 1
    sums = {c: np.zeros(bins) for c in shown}
    counts = np.zeros(bins, np.int64)
    for chunk in run.chunks("steps", ("kind", "start_s", *shown)):
        busy = _busy(chunk)
        which = bin_of(busy)
        counts += np.bincount(which, minlength=bins)
        for c in shown:
            sums[c] += np.bincount(which, busy[c].to_numpy(float), minlength=bins)
    idx = counts.nonzero()[0]
    centers = (edges[:-1] + edges[1:]) / 2
    parts = {c.removesuffix("_s"): sums[c][idx] / counts[idx] * 1e3 for c in STEP_PARTS
             if c in sums and sums[c].sum() > 0}
    overlay = {"step duration": sums["duration_s"][idx] / counts[idx] * 1e3}
    path = plots.stacked_area_plot(centers[idx], parts, "virtual time (s)", "mean time per step (ms)",
                                   "Step-time breakdown (parts may overlap: see exposed vs hidden)",
                                   plot_dir / "step_breakdown.png", overlay)
    totals = {"exposed": [sums["exposed_cpu_s"].sum()], "hidden by overlap": [sums["hidden_cpu_s"].sum()]}
    overlap = plots.bar_plot(["CPU time in steps"], totals, "", "seconds (virtual)",
                             "Scheduler CPU time: exposed vs hidden by overlap", plot_dir / "overlap.png")
    return [
        Figure("step_breakdown", "Mean per-step time of each part over the run; the black line is the step duration", path),
        Figure("overlap", "CPU time on the critical path (exposed) vs overlapped with the GPU (hidden)", overlap),
    ]


def _columns(run: SavedRun, table: str) -> list[str]:
    """The columns of the run's ``table`` (read from the Parquet file's schema when it is on disk)."""
    if run.tables is not None:
        return getattr(run, table).columns.tolist()
    return pq.read_schema(run.folder / f"{table}.parquet").names


def _compile_times(run: SavedRun, plot_dir: Path) -> Figure:
    def seconds() -> Iterator[tuple[np.ndarray, None]]:
        for chunk in run.chunks("requests", ("cache", "compile_start_s", "compile_end_s")):
            misses = chunk[(chunk["cache"].astype(str) == "miss").to_numpy()]
            yield (misses["compile_end_s"] - misses["compile_start_s"]).to_numpy(float) * 1e3, None

    hist = Binned.of(seconds, log=True, spread=1.01)
    if hist is None:
        return Figure("compile_time", "Compile-time distribution", None, "no grammar was compiled (no cache miss)")
    path = plots.histogram_plot(hist, "compile time (ms)", "Compile time per cache miss", plot_dir / "compile_time.png")
    return Figure("compile_time", "Compile time of every cache miss (log scale)", path)


def _mask_times(run: SavedRun, plot_dir: Path) -> Figure:
    def per_row_us() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for chunk in run.chunks("steps", ("fill_s", "mask_rows")):
            masked = chunk[(chunk["mask_rows"] > 0).to_numpy()]
            rows = masked["mask_rows"].to_numpy(float)
            yield masked["fill_s"].to_numpy(float) / rows * 1e6, rows

    hist = Binned.of(per_row_us, log=True, spread=1.01)
    if hist is None:
        return Figure("mask_time", "Per-token mask time", None, "no step built a mask")
    path = plots.histogram_plot(hist, "mask fill time per row (µs)", "Per-token mask fill time",
                                plot_dir / "mask_time.png", ylabel="mask rows")
    return Figure("mask_time", "Mask fill time per row, each step's mean weighted by its rows", path)


def _rollbacks(summary: Mapping[str, Any], plot_dir: Path) -> Figure:
    drafted = np.asarray(summary.get("drafted_by_position", []), dtype=float)
    if not drafted.any():
        return Figure("rollback", "Rollback by draft position", None, "no speculative decoding (no draft tokens)")
    accepted = summary["accepted_by_position"]
    rolled = np.asarray(summary["rolled_back_by_position"], dtype=float)
    share = np.divide(rolled, drafted, out=np.zeros_like(rolled), where=drafted > 0)
    path = plots.draft_position_plot(
        {"verified": drafted, "accepted": accepted, "rolled back in the grammar": rolled}, share,
        "rolled back ÷ verified", "Rollback by draft position", plot_dir / "rollback.png")
    return Figure("rollback", "Drafts verified, accepted and rolled back at each draft position", path)


def _rank_skew(run: SavedRun, plot_dir: Path) -> Figure:
    def skew_ms() -> Iterator[tuple[np.ndarray, None]]:
        for chunk in run.chunks("requests", ("rank_skew_s",)):
            yield chunk["rank_skew_s"].to_numpy(float) * 1e3, None

    skewed = any((chunk["rank_skew_s"] > 0).any() for chunk in run.chunks("requests", ("rank_skew_s",)))
    hist = Binned.of(skew_ms, log=False) if skewed else None
    if hist is None:
        return Figure("rank_skew", "Per-rank release skew", None, "a single rank (or no compile), so no skew")
    path = plots.histogram_plot(hist, "latest − earliest rank compile end (ms)", "Per-rank release skew",
                                plot_dir / "rank_skew.png")
    return Figure("rank_skew", "How much later the slowest rank finished each compile than the fastest", path)


def _kv_usage(run: SavedRun, plot_dir: Path) -> Figure:
    capacity = run.summary.get("kv_capacity_tokens")
    binned = _time_bins(run, lambda chunk: chunk, 400) if capacity and "kv_tokens" in _columns(run, "steps") else None
    if binned is None:
        return Figure("kv_usage", "KV-cache utilisation", None, "the KV cache was not modelled (unbounded)")
    edges, bin_of = binned
    bins = len(edges) - 1
    peak, total, counts = np.full(bins, -np.inf), np.zeros(bins), np.zeros(bins, np.int64)
    preempting = np.zeros(bins, bool)
    for chunk in run.chunks("steps", ("start_s", "kv_tokens", "preempted")):
        which = bin_of(chunk)
        used = chunk["kv_tokens"].to_numpy() / capacity
        np.maximum.at(peak, which, used)
        total += np.bincount(which, used, minlength=bins)
        counts += np.bincount(which, minlength=bins)
        preempting[which[chunk["preempted"].to_numpy() > 0]] = True
    idx = counts.nonzero()[0]
    centers = (edges[:-1] + edges[1:]) / 2
    path = plots.time_series_plot(centers[idx], {"peak in the interval": peak[idx],
                                                 "mean in the interval": total[idx] / counts[idx]},
                                  "virtual time (s)", "KV slots in use ÷ capacity",
                                  f"KV-cache utilisation ({capacity:,} token slots)", plot_dir / "kv_usage.png",
                                  centers[preempting], "intervals with a step that preempted or retracted")
    return Figure("kv_usage", "Share of the KV cache's token slots in use over the run; red ticks: intervals "
                  "with a step that preempted (vLLM) or retracted (SGLang) requests", path)


def _over_time(summary: Mapping[str, Any], plot_dir: Path) -> Figure:
    section = summary.get("time_windows") or {}
    windows = pd.DataFrame(section.get("windows", []))
    if len(windows) < 2:
        return Figure("over_time", "Latency and throughput over time", None, "the run's requests fit in one time window")
    width = float(section["window_s"])
    unit, scale = ("h", 3600.0) if width >= 3600 else ("min", 60.0)
    x = windows["start_s"].to_numpy() / scale
    latency = {"p99 TTFT": windows["p99_ttft_ms"], "p50 TTFT": windows["p50_ttft_ms"],
               "p99 TPOT": windows["p99_tpot_ms"]}
    rates = {"requests/s": windows["request_throughput"]}
    if windows["request_goodput"].notna().any():
        rates["goodput (requests/s)"] = windows["request_goodput"]
    path = plots.over_time_plot(x, {k: v.astype(float).to_numpy() for k, v in latency.items()}, "ms",
                                {k: v.astype(float).to_numpy() for k, v in rates.items()}, "requests per second",
                                f"virtual time ({unit}, window start)", f"Latency and throughput per {unit} window",
                                plot_dir / "over_time.png")
    return Figure("over_time", f"p50/p99 TTFT and p99 TPOT (left) and completed requests and goodput per second "
                  f"(right) of the requests issued in each {width:g} s window", path)


def build_figures(run: SavedRun) -> list[Figure]:
    """Draw every plot the run has data for into ``run.folder / "plots"``, reading its tables a row group at
    a time (:meth:`~cdbench.results.run_folder.SavedRun.chunks`): distributions are binned
    (:mod:`cdbench.reports.binned`), step series averaged per interval of virtual time."""
    plot_dir = run.folder / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    return [
        *_latency_cdfs(run, plot_dir),
        *_step_breakdown(run, plot_dir),
        _compile_times(run, plot_dir),
        _mask_times(run, plot_dir),
        _rollbacks(run.summary, plot_dir),
        _rank_skew(run, plot_dir),
        _kv_usage(run, plot_dir),
        _over_time(run.summary, plot_dir),
    ]


WORKLOAD_ENTRIES_SHOWN = 20
"""Entries of each kind of workload issue listed in ``report.md`` (the details file has them all)."""


def workload_issue_lines(run: SavedRun) -> list[str]:
    """Markdown for what did not make it into the run's requests, each entry with its reason."""
    issues = run.workload_issues
    if issues is None:
        return []
    if not issues.total:
        return ["## Workload issues", "", "None: every corpus line loaded and every spec was used.", ""]
    lines = ["## Workload issues", "", f"{issues.describe()}; all of them, with reasons, in `{issues.details}`.", ""]
    path = run.folder / issues.details
    try:
        details = WorkloadReport.model_validate_json(path.read_text())
    except (OSError, ValueError) as err:  # ValidationError is a ValueError
        return [*lines, f"*`{issues.details}` could not be read: {err}*", ""]
    kinds = (("Corpus lines skipped", [f"`{e.path}:{e.line}`: {e.reason}" for e in details.skipped_lines]),
             ("Specs without a valid instance", [f"`{e.spec_id}`: {e.reason}" for e in details.spec_failures]),
             ("Trace lines skipped", [f"line {e.line}: {e.reason}" for e in details.bad_trace_lines]),
             ("Corpus items dropped as duplicate specs",
              [f"`{dup}` (same spec as `{kept}`)" for dup, kept in details.duplicate_specs.items()]))
    for title, entries in kinds:
        if entries:
            more = len(entries) - WORKLOAD_ENTRIES_SHOWN
            lines += [f"### {title}", "", *(f"- {e}" for e in entries[:WORKLOAD_ENTRIES_SHOWN])]
            lines += [f"- ... and {more} more", ""] if more > 0 else [""]
    return lines


def spec_cost_lines(run: SavedRun) -> list[str]:
    """The report's account of where a ``model`` run's spec prices came from (nothing for other modes)."""
    coverage = run.spec_costs
    if coverage is None:
        return []
    rows = [f"| {name} | {specs} | {requests} | {share:.1%} |" for name, specs, requests, share in coverage.rows()]
    lines = ["## Spec costs", "", "Where each spec's grammar costs came from (model mode prices every spec from "
             "a measurement, a prediction with its error, or, where neither exists, a guess per kind):", "",
             "| source | specs | requests | share of requests |", "| --- | ---: | ---: | ---: |", *rows, ""]
    return lines + [f"- {line}" for line in coverage.lines()[1:]] + ([""] if len(coverage.lines()) > 1 else [])


def forward_speed_lines(run: SavedRun) -> list[str]:
    """The report's line on the forward speed that priced the steps (nothing where none did)."""
    speed = run.forward_speed
    if speed is None:
        return []
    return ["## Forward speed", "", f"Every step's modelled forward was multiplied by {speed.describe()} "
            "(this host's forward over the calibration's; `costs.forward_speed`).", ""]


def build_report(run: SavedRun) -> Path:
    """Write ``report.md`` (config, summary tables, plots) into the run folder and return its path."""
    figures = build_figures(run)
    lines = [f"# cdbench run `{run.folder.name}`", ""]
    status = status_of(run.summary)
    if status is not None:
        lines += [f"**This run {status.describe()}.** Its summary, tables and plots cover the requests that "
                  "ended before it stopped (their outputs unchecked).", ""]
    trace_note = run.trace_note()
    lines += [f"Files: `{'summary.json' if status is None else STOPPED_SUMMARY_FILE}`, `requests.parquet`, `steps.parquet`, `config.yaml`, "
              f"`trace.json` (open in https://ui.perfetto.dev){'; ' + trace_note if trace_note else ''}.", ""]
    replay = run.folder / WORKLOAD_TRACE_FILE
    if replay.is_file():
        lines += [f"The requests are in `{replay.name}`: `--set workload.trace={replay}` runs the same workload again.",
                  ""]
    lines += ["## Summary", ""]
    for section in summary_sections(run.summary):
        lines += [f"### {section.title}", "", to_markdown(section), ""]
    lines += workload_issue_lines(run)
    lines += forward_speed_lines(run)
    lines += spec_cost_lines(run)
    lines += ["## Plots", ""]
    for figure in figures:
        if figure.path is None:
            lines += [f"- *{figure.caption}*: not drawn — {figure.skipped_because}.", ""]
        else:
            rel = figure.path.relative_to(run.folder).as_posix()
            lines += [f"### {figure.caption}", "", f"![{figure.name}]({rel})", ""]
    lines += ["## Configuration", "", "```yaml", yaml.safe_dump(run.config, sort_keys=False).rstrip(), "```", ""]
    path = run.folder / "report.md"
    path.write_text("\n".join(lines))
    return path
