"""A sweep's summary: one row a grid point, and throughput-vs-latency curves across the grid."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from rich.table import Table

from cdbench.reports import plots
from cdbench.reports.tables import format_value, frame_to_markdown

HEADLINE_METRICS = ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                    "p99_tpot_ms", "mean_grammar_wait_ms", "failed")
"""Metrics shown in sweep tables (all metrics are in ``sweep.csv``)."""

CONSOLE_METRICS = ("request_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "failed")
"""The narrower set the console table shows."""

TRADEOFFS = (("request_throughput", "p99_ttft_ms"), ("output_throughput", "mean_tpot_ms"))
"""(throughput, latency) pairs drawn as curves across the grid."""


def _curve_axis(table: pd.DataFrame, grid_columns: Sequence[str]) -> str | None:
    """The numeric grid parameter with the most values (usually the rate): the points along each curve."""
    numeric = [c for c in grid_columns if pd.api.types.is_numeric_dtype(table[c]) and table[c].nunique() > 1]
    return max(numeric, key=lambda c: table[c].nunique()) if numeric else None


def write_sweep_report(name: str, grid_columns: Sequence[str], table: pd.DataFrame, out_dir: Path) -> Path:
    """Write ``sweep.md``, ``sweep.csv`` and the trade-off plots into ``out_dir``; returns the markdown path."""
    out_dir = Path(out_dir)
    table.to_csv(out_dir / "sweep.csv", index=False)
    done = table[table["status"] != "failed"]
    columns = [*grid_columns, "status", *(m for m in HEADLINE_METRICS if m in table.columns)]
    lines = [f"# cdbench sweep `{name}`", "", f"{len(table)} points; every metric of every point is in `sweep.csv`.",
             "", frame_to_markdown(columns, [[row.get(c) for c in columns] for _, row in table.iterrows()]), ""]
    if "error" in table.columns:
        failed = table[table["status"] == "failed"]
        lines += [f"- `{row['point']}` failed: {row['error']}" for _, row in failed.iterrows()] + [""]
    axis = _curve_axis(done, grid_columns) if len(done) else None
    series = [c for c in grid_columns if c != axis and done[c].nunique() > 1] if len(done) else []
    for x, y in TRADEOFFS:
        if len(done) and x in done and y in done:
            path = plots.tradeoff_plot(done, x, y, series, axis, f"{y} vs {x}" + (f" (points: {axis})" if axis else ""),
                                       out_dir / "plots" / f"{y}_vs_{x}.png")
            lines += [f"## {y} vs {x}", "", f"![{y} vs {x}]({path.relative_to(out_dir).as_posix()})", ""]
    md = out_dir / "sweep.md"
    md.write_text("\n".join(lines))
    return md


def _folded(name: str, width: int = 12) -> str:
    """A column header broken at underscores into lines of about ``width`` characters.

    >>> _folded("request_throughput"), _folded("p99_ttft_ms")
    ('request_\\nthroughput', 'p99_ttft_ms')
    """
    lines: list[str] = []
    for word in name.split("_"):
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += "_" + word
        else:
            lines.append(word)
    return "_\n".join(lines)


def sweep_rich(table: pd.DataFrame, grid_columns: Sequence[str]) -> Table:
    """The sweep table for the console: the grid values that vary, status, headline metrics.

    Grid parameters with one value across every point go to the title instead
    of a column, and long headers fold at underscores, so the table fits a
    140-column log without cutting values.
    """
    fixed = [c for c in grid_columns if table[c].nunique(dropna=False) <= 1]
    varying = [c for c in grid_columns if c not in fixed]
    title = "Sweep" + (f" (same for every point: {', '.join(f'{c}={format_value(table[c].iloc[0])}' for c in fixed)})"
                       if fixed and len(table) else "")
    metrics = [m for m in CONSOLE_METRICS if m in table.columns]
    rich_table = Table(title=title, title_justify="left")
    for c in varying:
        rich_table.add_column(c, justify="left", overflow="fold")
    rich_table.add_column("status", justify="left", no_wrap=True)
    for m in metrics:
        rich_table.add_column(_folded(m), justify="right", no_wrap=True)
    for _, row in table.iterrows():
        rich_table.add_row(*(format_value(row.get(c)) for c in [*varying, "status", *metrics]))
    return rich_table
