"""Side-by-side comparison of runs: every metric per run and its ratio to the first run.

Examples
--------
>>> table = comparison_table({"xgrammar": {"mean_ttft_ms": 10.0}, "llguidance": {"mean_ttft_ms": 15.0}})
>>> table.loc["mean_ttft_ms"].tolist()
[10.0, 15.0, 1.5]
>>> list(table.columns)
['xgrammar', 'llguidance', 'llguidance / xgrammar']
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from rich.table import Table

from cdbench.reports import plots
from cdbench.reports.gate import Direction, metric_direction, numeric_metrics
from cdbench.reports.run_report import request_latencies_ms
from cdbench.reports.tables import format_value
from cdbench.results.run_folder import SavedRun
from cdbench.results.stopped_run import status_of

_LATENCY_ORDER = re.compile(r"^(mean|median|p\d+)_(ttft|tpot|itl|e2el)_ms$")


def _metric_order(name: str) -> tuple[int, str]:
    # Headline serving metrics first (vLLM's order), then the rest alphabetically.
    if "throughput" in name or "goodput" in name or name == "completed":
        return (0, name)
    match = _LATENCY_ORDER.match(name)
    if match:
        return (1 + ("ttft", "tpot", "itl", "e2el").index(match.group(2)), name)
    return (9, name)


def comparison_table(summaries: Mapping[str, Mapping[str, object]]) -> pd.DataFrame:
    """Metrics as rows; one column per run, then ``run / first`` ratio columns.

    A ratio is NaN where the first run's value is 0 or either value is missing.
    """
    labels = list(summaries)
    numeric = {label: numeric_metrics(summary) for label, summary in summaries.items()}
    metrics = sorted({m for values in numeric.values() for m in values}, key=_metric_order)
    table = pd.DataFrame({label: [numeric[label].get(m, np.nan) for m in metrics] for label in labels}, index=metrics)
    first = table[labels[0]].replace(0.0, np.nan)
    for label in labels[1:]:
        table[f"{label} / {labels[0]}"] = table[label] / first
    table.index.name = "metric"
    return table


def _ratio_style(metric: str, ratio: float) -> str:
    if np.isnan(ratio) or abs(ratio - 1.0) < 0.005:
        return ""
    direction = metric_direction(metric)
    if direction is Direction.INFORMATIONAL:
        return ""
    better = ratio < 1.0 if direction is Direction.LOWER_IS_BETTER else ratio > 1.0
    return "green" if better else "red"


def comparison_rich(table: pd.DataFrame, n_runs: int) -> Table:
    """The comparison as a rich table; ratios coloured green (better) or red (worse) by the metric's direction."""
    rich_table = Table(title="Comparison (ratios relative to the first run)", title_justify="left")
    rich_table.add_column("metric", no_wrap=True, min_width=max((len(str(m)) for m in table.index), default=6))
    for column in table.columns:
        rich_table.add_column(str(column), justify="right")
    for metric, row in table.iterrows():
        cells = [format_value(v) for v in row.iloc[:n_runs]]
        for ratio in row.iloc[n_runs:]:
            style = _ratio_style(str(metric), float(ratio))
            text = "-" if np.isnan(ratio) else f"{ratio:.3f}x"
            cells.append(f"[{style}]{text}[/]" if style else text)
        rich_table.add_row(str(metric), *cells)
    return rich_table


def comparison_markdown(table: pd.DataFrame, n_runs: int) -> str:
    """The comparison as a markdown table (ratios as ``1.234x``)."""
    header = ["metric", *map(str, table.columns)]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for metric, row in table.iterrows():
        cells = [format_value(v) for v in row.iloc[:n_runs]]
        cells += ["-" if np.isnan(r) else f"{r:.3f}x" for r in row.iloc[n_runs:]]
        lines.append("| " + " | ".join([str(metric), *cells]) + " |")
    return "\n".join(lines)


def label_runs(runs: Sequence[SavedRun]) -> dict[str, SavedRun]:
    """Each run under its folder's name (a run that stopped early with its status, e.g. ``(interrupted,
    120 of 3000 done)``); a name seen before gets ``#<position>`` appended."""
    labelled: dict[str, SavedRun] = {}
    for i, run in enumerate(runs):
        status = status_of(run.summary)
        name = run.label if status is None else f"{run.label} ({status.label()})"
        labelled[name if name not in labelled else f"{name}#{i}"] = run
    return labelled


def overlaid_cdfs(runs: Mapping[str, SavedRun], plot_dir: Path) -> list[tuple[str, Path]]:
    """TTFT, TPOT and E2EL CDFs with one line per run that kept its requests, written into ``plot_dir``:
    (name, path) of each; none when no run kept them."""
    latencies = {label: request_latencies_ms(run.requests) for label, run in runs.items() if run.has_tables}
    if not latencies:
        return []
    figures = []
    for metric, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2EL")):
        path = plots.cdf_plot({label: lat[metric].to_numpy() for label, lat in latencies.items()},
                              f"{name} (ms)", f"{name} CDF", plot_dir / f"{metric[:-3]}_cdf.png")
        figures.append((name, path))
    return figures


def figure_sections(figures: list[tuple[str, Path]], out_dir: Path) -> list[str]:
    """Markdown lines: one ``## <name> CDF`` section per figure, linked relative to ``out_dir``."""
    lines: list[str] = []
    for name, path in figures:
        lines += [f"## {name} CDF", "", f"![{name}]({path.relative_to(out_dir).as_posix()})", ""]
    return lines


def summary_only_lines(runs: Mapping[str, SavedRun]) -> list[str]:
    """A markdown line naming the runs saved without their per-request table (left out of the CDFs)."""
    missing = [f"`{label}`" for label, run in runs.items() if not run.has_tables]
    return [f"Not in the CDFs (saved without requests.parquet): {', '.join(missing)}.", ""] if missing else []


def write_comparison(runs: Mapping[str, SavedRun], out_dir: Path) -> Path:
    """Write ``comparison.md`` (the table) and overlaid TTFT/TPOT CDFs into ``out_dir``; returns the markdown path."""
    out_dir = Path(out_dir)
    table = comparison_table({label: run.summary for label, run in runs.items()})
    figures = overlaid_cdfs(runs, out_dir / "plots")
    lines = ["# cdbench comparison", "", "Runs: " + ", ".join(f"`{label}` ({run.ref})" for label, run in runs.items()),
             "", comparison_markdown(table, len(runs)), "", *figure_sections(figures, out_dir),
             *summary_only_lines(runs)]
    md = out_dir / "comparison.md"
    md.write_text("\n".join(lines))
    table.to_csv(out_dir / "comparison.csv")
    return md
