"""Plots for run reports, comparisons and sweeps (matplotlib, Agg backend, PNG files).

Each function takes plain arrays or frames (already in the units to show),
draws one figure, writes it to ``path`` and returns the path. Callers decide
which columns to plot; nothing here reads a run folder.

Examples
--------
>>> import numpy as np, tempfile, pathlib
>>> out = pathlib.Path(tempfile.mkdtemp()) / "cdf.png"
>>> cdf_plot({"run": np.array([1.0, 2.0, 3.0])}, "TTFT (ms)", "TTFT", out).name
'cdf.png'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never open a window (CI, ssh, workers)

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from cdbench.reports.binned import Binned  # noqa: E402

_DPI = 110


def _save(fig: plt.Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _label(ax: plt.Axes, xlabel: str, ylabel: str, title: str) -> None:
    """Axis labels, title and the light grid every plot here has."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)


def cdf_plot(series: Mapping[str, np.ndarray], xlabel: str, title: str, path: Path, log_x: bool | None = None) -> Path:
    """Empirical CDFs of one quantity, one line per label (NaNs dropped).

    ``log_x=None`` picks a log axis when the positive values span more than two decades.
    """
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    if log_x is None:
        values = np.concatenate([np.asarray(v, dtype=float) for v in series.values()] or [np.zeros(0)])
        positive = values[values > 0]
        log_x = bool(positive.size) and positive.max() > 100 * positive.min()
    for label, values in series.items():
        values = np.sort(np.asarray(values, dtype=float)[~np.isnan(np.asarray(values, dtype=float))])
        if values.size == 0:
            continue
        ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=f"{label} (n={values.size})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    if log_x:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize="small", loc="lower right")
    return _save(fig, path)


def histogram_plot(hist: Binned, xlabel: str, title: str, path: Path, ylabel: str = "count") -> Path:
    """A binned histogram (:class:`~cdbench.reports.binned.Binned`; a log axis for log bins) with its median
    and p99 marked."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    edges, counts = hist.bars()
    ax.stairs(counts, edges, fill=True, color="#4C72B0", alpha=0.85)
    if hist.log:
        ax.set_xscale("log")
    for q, style in ((50, "--"), (99, ":")):
        x = hist.quantile(q / 100)
        ax.axvline(x, color="black", linestyle=style, linewidth=1, label=f"p{q} = {x:.4g}")
    ax.legend(fontsize="small")
    _label(ax, xlabel, ylabel, title)
    return _save(fig, path)


def binned_cdf_plot(series: Mapping[str, Binned], xlabel: str, title: str, path: Path) -> Path:
    """CDFs of binned distributions (:meth:`~cdbench.reports.binned.Binned.cdf`), one line per label; a log
    axis when the first one's bins are log-spaced (all share their bins' edges)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, hist in series.items():
        x, share = hist.cdf()
        ax.plot(x, share, label=f"{label} (n={hist.n})")
    ax.set_ylim(0, 1.02)
    if next(iter(series.values())).log:
        ax.set_xscale("log")
    _label(ax, xlabel, "fraction of requests", title)
    ax.legend(fontsize="small", loc="lower right")
    return _save(fig, path)


def stacked_area_plot(x: np.ndarray, parts: Mapping[str, np.ndarray], xlabel: str, ylabel: str, title: str,
                      path: Path, overlay: Mapping[str, np.ndarray] | None = None) -> Path:
    """Stacked areas of ``parts`` over ``x``; ``overlay`` lines drawn on top (e.g. the step time itself)."""
    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    labels = list(parts)
    ax.stackplot(x, *(np.asarray(parts[k], dtype=float) for k in labels), labels=labels, alpha=0.85)
    for label, values in (overlay or {}).items():
        ax.plot(x, values, color="black", linewidth=0.8, label=label)
    _label(ax, xlabel, ylabel, title)
    ax.legend(fontsize="small", loc="upper left", ncols=3)
    return _save(fig, path)


def over_time_plot(x: np.ndarray, left: Mapping[str, np.ndarray], left_label: str, right: Mapping[str, np.ndarray],
                   right_label: str, xlabel: str, title: str, path: Path) -> Path:
    """Lines of ``left`` on the left axis and dashed lines of ``right`` on a right axis, over ``x``
    (e.g. latency and throughput per time window)."""
    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    for label, values in left.items():
        ax.plot(x, np.asarray(values, dtype=float), marker=".", label=label)
    _label(ax, xlabel, left_label, title)
    handles, labels = ax.get_legend_handles_labels()
    if right:
        twin = ax.twinx()
        for (label, values), style in zip(right.items(), ("--", ":", "-.")):
            twin.plot(x, np.asarray(values, dtype=float), linestyle=style, color="grey", label=label)
        twin.set_ylabel(right_label)
        more_handles, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, fontsize="small", loc="upper left")
    return _save(fig, path)


def bar_plot(labels: Sequence[str], values: Mapping[str, Sequence[float]], xlabel: str, ylabel: str, title: str,
             path: Path) -> Path:
    """Grouped bars: one group per label, one bar per key of ``values``."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    x = np.arange(len(labels))
    width = 0.8 / max(len(values), 1)
    for i, (name, heights) in enumerate(values.items()):
        ax.bar(x + (i - (len(values) - 1) / 2) * width, heights, width, label=name)
    ax.set_xticks(x, list(labels))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(values) > 1:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def draft_position_plot(counts: Mapping[str, Sequence[int]], share: Sequence[float], share_label: str, title: str,
                        path: Path) -> Path:
    """Grouped bars of counts per draft position (1, 2, ...) with ``share`` (0..1) as a line on a second axis."""
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    positions = np.arange(1, len(share) + 1)
    width = 0.8 / max(len(counts), 1)
    for i, (name, heights) in enumerate(counts.items()):
        ax.bar(positions + (i - (len(counts) - 1) / 2) * width, heights, width, label=name)
    ax.set_xticks(positions)
    ax.set_xlabel("draft position")
    ax.set_ylabel("draft tokens")
    ax.grid(alpha=0.3, axis="y")
    rate_ax = ax.twinx()
    rate_ax.plot(positions, np.asarray(share, dtype=float) * 100, color="black", marker="o", label=share_label)
    rate_ax.set_ylabel(f"{share_label} (%)")
    rate_ax.set_ylim(0, 105)
    handles = ax.get_legend_handles_labels()[0] + rate_ax.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize="small", loc="upper center",
              bbox_to_anchor=(0.5, -0.15), ncol=2)
    ax.set_title(title)
    return _save(fig, path)


def time_series_plot(x: np.ndarray, series: Mapping[str, np.ndarray], xlabel: str, ylabel: str, title: str,
                     path: Path, marks: np.ndarray | None = None, marks_label: str = "") -> Path:
    """Lines over ``x`` (one per ``series``), with vertical ticks at ``marks`` (e.g. the steps that preempted)."""
    fig, ax = plt.subplots(figsize=(7.0, 3.6))
    for label, values in series.items():
        ax.plot(x, values, label=label, linewidth=1.0)
    if marks is not None and len(marks):
        ax.plot(marks, np.full(len(marks), 1.0), "|", color="tab:red", markersize=10, label=marks_label)
    _label(ax, xlabel, ylabel, title)
    ax.legend(fontsize="small")
    return _save(fig, path)


def tradeoff_plot(table: pd.DataFrame, x: str, y: str, series: Sequence[str], order_by: str | None, title: str,
                  path: Path) -> Path:
    """Throughput-vs-latency style curves: one line per combination of ``series`` columns, points ordered by ``order_by``."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    groups = table.groupby(list(series), sort=False) if series else [((), table)]
    for key, group in groups:
        if order_by:
            group = group.sort_values(order_by)
        key = key if isinstance(key, tuple) else (key,)
        label = ", ".join(f"{s}={k}" for s, k in zip(series, key)) or "grid"
        ax.plot(group[x], group[y], marker="o", label=label)
        if order_by:
            for _, row in group.iterrows():
                ax.annotate(f"{row[order_by]}", (row[x], row[y]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    _label(ax, x, y, title)
    ax.legend(fontsize="small")
    return _save(fig, path)
