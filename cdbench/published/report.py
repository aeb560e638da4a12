"""The published-against-cdbench table (CSV, Markdown, rich) and the plot of the effects."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from rich.table import Table

from cdbench.published.runner import EntryResult, SweepPoint

_COLORS = {"reproduced": "tab:green", "missed": "tab:red", "not reproducible": "tab:gray"}


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 100:+.1f} %"


def _ratio(r: EntryResult) -> str:
    return "n/a" if r.ratio is None or math.isnan(r.ratio) else f"{r.ratio:.2f}"


def results_frame(results: Sequence[EntryResult]) -> pd.DataFrame:
    """One row an entry: the published and predicted arms, effects, their ratio and the verdict."""
    return pd.DataFrame([r.row() for r in results])


def rich_table(results: Sequence[EntryResult]) -> Table:
    table = Table(title="Published effects and cdbench's (model mode)")
    for col in ("entry", "metric", "published", "cdbench", "ratio", "verdict"):
        table.add_column(col, justify="right" if col in ("published", "cdbench", "ratio") else "left")
    for r in results:
        table.add_row(r.id, r.metric, _pct(r.published_effect), _pct(r.predicted_effect), _ratio(r), r.verdict)
    return table


def markdown_table(results: Sequence[EntryResult]) -> str:
    """The table as Markdown (the report's)."""
    lines = ["| entry | metric | published | cdbench | ratio | verdict |", "|---|---|---:|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r.id} | {r.metric} | {_pct(r.published_effect)} | {_pct(r.predicted_effect)} | "
                     f"{_ratio(r)} | {r.verdict} |")
    return "\n".join(lines) + "\n"


def plot_effects(results: Sequence[EntryResult], path: Path) -> None:
    """Published against predicted effect per entry (symlog axes: the claims span -50 % to +900 %),
    the diagonal and the reproduced band of +-30 % around it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image

    fig, ax = plt.subplots(figsize=(7.5, 6.5))
    lim = max(1.0, *(abs(v) * 100 for r in results for v in (r.published_effect, r.predicted_effect)
                      if not math.isnan(v))) * 1.3
    line = np.concatenate([-np.geomspace(lim, 0.1, 200), np.geomspace(0.1, lim, 200)])
    ax.plot(line, line, color="black", lw=0.8, label="cdbench = published")
    ax.fill_between(line, line * 0.7, line * 1.3, color="tab:green", alpha=0.12, label="within +-30 %")
    for verdict_name, color in _COLORS.items():
        chosen = [r for r in results if r.verdict == verdict_name]
        ax.scatter([r.published_effect * 100 for r in chosen], [r.predicted_effect * 100 for r in chosen],
                   color=color, label=verdict_name, zorder=3)
        for r in chosen:
            ax.annotate(r.id, (r.published_effect * 100, r.predicted_effect * 100), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    for axis in (ax.set_xscale, ax.set_yscale):
        axis("symlog", linthresh=10)
    ax.set_xlim(-lim, lim)
    ax.set_ylim(-lim, lim)
    ax.axhline(0, color="gray", lw=0.5)
    ax.axvline(0, color="gray", lw=0.5)
    ax.set_xlabel("published effect (%)")
    ax.set_ylabel("cdbench effect, model mode (%)")
    ax.set_title("Published A/B effects on structured outputs against cdbench's")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    # a palette of 256 colours leaves the flat plot unchanged to the eye at a third of the bytes (the checkout's limit)
    Image.open(png).convert("RGB").quantize(colors=256).save(path, optimize=True)


def write_results(results: Sequence[EntryResult], out: Path) -> list[Path]:
    """``results.csv``, ``table.md`` and ``effects.png`` in ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.csv", out / "table.md", out / "effects.png"]
    results_frame(results).to_csv(paths[0], index=False, float_format="%.6g")
    paths[1].write_text(markdown_table(results), encoding="utf-8")
    plot_effects(results, paths[2])
    return paths


def sweep_frame(points: Sequence[SweepPoint], key: str) -> pd.DataFrame:
    """One row an entry and swept value: the value, then the entry's result (:func:`results_frame`'s columns)."""
    return pd.DataFrame([{key: p.value, **r.row()} for p in points for r in p.results])


def sweep_markdown(points: Sequence[SweepPoint], key: str) -> str:
    """The sweep as Markdown: a row a value, a column an entry (cdbench's effect, bold where reproduced), the
    published effects in the first row, and how many entries each value reproduces."""
    if not points:
        return ""
    ids = [r.id for r in points[0].results]
    lines = [f"| {key} | " + " | ".join(ids) + " | reproduced |", "|---|" + "---:|" * (len(ids) + 1),
             "| published | " + " | ".join(_pct(r.published_effect) for r in points[0].results) + " | |"]
    for p in points:
        cells = [f"**{_pct(r.predicted_effect)}**" if r.verdict == "reproduced" else _pct(r.predicted_effect)
                 for r in p.results]
        lines.append(f"| {p.value} | " + " | ".join(cells) + f" | {p.reproduced} of {len(cells)} |")
    return "\n".join(lines) + "\n"
