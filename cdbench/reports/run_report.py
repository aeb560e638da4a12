"""A run folder's ``report.md`` and ``plots/*.png``, built from its saved results alone.

Which plots appear depends on what the run did: the rollback plot needs
speculative decoding, the rank-skew plot more than one rank, the compile plot
at least one compile. A plot that has no data is left out and the report says
why, rather than showing an empty figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from cdbench.reports import plots
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


def _latency_cdfs(requests: pd.DataFrame, plot_dir: Path) -> list[Figure]:
    lat = request_latencies_ms(requests)
    if lat.empty:
        return [Figure("latency_cdf", "TTFT and TPOT CDFs", None, "no request completed")]
    figures = []
    for metric, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        series = {"all": lat[metric].to_numpy()}
        if lat["structured"].any() and not lat["structured"].all():
            series["structured"] = lat.loc[lat["structured"], metric].to_numpy()
            series["unconstrained"] = lat.loc[~lat["structured"], metric].to_numpy()
        path = plots.cdf_plot(series, f"{label} (ms)", f"{label} CDF", plot_dir / f"{metric[:-3]}_cdf.png")
        figures.append(Figure(f"{metric[:-3]}_cdf", f"{label} CDF (structured vs unconstrained requests when mixed)", path))
    return figures


def _step_breakdown(steps: pd.DataFrame, plot_dir: Path) -> list[Figure]:
    # the columns drawn, of the busy steps (a long run's step table is large: no copy of the rest)
    shown = [c for c in ("start_s", "duration_s", "exposed_cpu_s", "hidden_cpu_s", *STEP_PARTS) if c in steps]
    busy = steps.loc[(steps["kind"] != "idle").to_numpy(), shown]
    if busy.empty:
        return [Figure("step_breakdown", "Step-time breakdown", None, "no step ran")]
    # Bin steps over virtual time so a long run stays readable: mean per-step time of each part per bin.
    bins = min(200, len(busy))
    edges = np.linspace(busy["start_s"].min(), busy["start_s"].max() + 1e-12, bins + 1)
    which = np.clip(np.digitize(busy["start_s"], edges) - 1, 0, bins - 1)
    grouped = busy.groupby(which)
    centers = (edges[:-1] + edges[1:]) / 2
    idx = grouped.size().index.to_numpy()
    parts = {c.removesuffix("_s"): grouped[c].mean().to_numpy() * 1e3 for c in STEP_PARTS
             if c in busy and busy[c].sum() > 0}
    overlay = {"step duration": grouped["duration_s"].mean().to_numpy() * 1e3}
    path = plots.stacked_area_plot(centers[idx], parts, "virtual time (s)", "mean time per step (ms)",
                                   "Step-time breakdown (parts may overlap: see exposed vs hidden)",
                                   plot_dir / "step_breakdown.png", overlay)
    totals = {"exposed": [busy["exposed_cpu_s"].sum()], "hidden by overlap": [busy["hidden_cpu_s"].sum()]}
    overlap = plots.bar_plot(["CPU time in steps"], totals, "", "seconds (virtual)",
                             "Scheduler CPU time: exposed vs hidden by overlap", plot_dir / "overlap.png")
    return [
        Figure("step_breakdown", "Mean per-step time of each part over the run; the black line is the step duration", path),
        Figure("overlap", "CPU time on the critical path (exposed) vs overlapped with the GPU (hidden)", overlap),
    ]


def _compile_times(requests: pd.DataFrame, plot_dir: Path) -> Figure:
    misses = requests[requests["cache"].astype(str) == "miss"]
    seconds = (misses["compile_end_s"] - misses["compile_start_s"]).dropna()
    if seconds.empty:
        return Figure("compile_time", "Compile-time distribution", None, "no grammar was compiled (no cache miss)")
    path = plots.histogram_plot(seconds.to_numpy() * 1e3, "compile time (ms)", "Compile time per cache miss",
                                plot_dir / "compile_time.png", log_x=True)
    return Figure("compile_time", "Compile time of every cache miss (log scale)", path)


def _mask_times(steps: pd.DataFrame, plot_dir: Path) -> Figure:
    masked = steps.loc[(steps["mask_rows"] > 0).to_numpy(), ["fill_s", "mask_rows"]]
    if masked.empty:
        return Figure("mask_time", "Per-token mask time", None, "no step built a mask")
    per_row_us = (masked["fill_s"] / masked["mask_rows"]).to_numpy() * 1e6
    path = plots.histogram_plot(per_row_us, "mask fill time per row (µs)", "Per-token mask fill time",
                                plot_dir / "mask_time.png", log_x=True, weights=masked["mask_rows"].to_numpy(),
                                ylabel="mask rows")
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


def _rank_skew(requests: pd.DataFrame, plot_dir: Path) -> Figure:
    skew = requests["rank_skew_s"].dropna()
    if skew.empty or not (skew > 0).any():
        return Figure("rank_skew", "Per-rank release skew", None, "a single rank (or no compile), so no skew")
    path = plots.histogram_plot(skew.to_numpy() * 1e3, "latest − earliest rank compile end (ms)",
                                "Per-rank release skew", plot_dir / "rank_skew.png")
    return Figure("rank_skew", "How much later the slowest rank finished each compile than the fastest", path)


def _kv_usage(summary: Mapping[str, Any], steps: pd.DataFrame, plot_dir: Path) -> Figure:
    capacity = summary.get("kv_capacity_tokens")
    if not capacity or "kv_tokens" not in steps or steps.empty:
        return Figure("kv_usage", "KV-cache utilisation", None, "the KV cache was not modelled (unbounded)")
    bins = min(400, len(steps))
    edges = np.linspace(steps["start_s"].min(), steps["start_s"].max() + 1e-12, bins + 1)
    which = np.clip(np.digitize(steps["start_s"], edges) - 1, 0, bins - 1)
    grouped = (steps["kv_tokens"] / capacity).groupby(which)
    centers = ((edges[:-1] + edges[1:]) / 2)[grouped.size().index.to_numpy()]
    marks = steps.loc[steps["preempted"] > 0, "start_s"].to_numpy()
    path = plots.time_series_plot(centers, {"peak in the interval": grouped.max().to_numpy(),
                                            "mean in the interval": grouped.mean().to_numpy()},
                                  "virtual time (s)", "KV slots in use ÷ capacity",
                                  f"KV-cache utilisation ({capacity:,} token slots)", plot_dir / "kv_usage.png",
                                  marks, "steps that preempted or retracted")
    return Figure("kv_usage", "Share of the KV cache's token slots in use over the run; red ticks: steps that "
                  "preempted (vLLM) or retracted (SGLang) requests", path)


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
    """Draw every plot the run has data for into ``run.folder / "plots"``."""
    plot_dir = run.folder / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    return [
        *_latency_cdfs(run.requests, plot_dir),
        *_step_breakdown(run.steps, plot_dir),
        _compile_times(run.requests, plot_dir),
        _mask_times(run.steps, plot_dir),
        _rollbacks(run.summary, plot_dir),
        _rank_skew(run.requests, plot_dir),
        _kv_usage(run.summary, run.steps, plot_dir),
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
