"""The ``cdbench profile`` report: backends side by side, MaskBench-style, with plots.

Input is two tables (as ``cdbench profile`` writes them): ``items`` (one row
per item × backend: ``corpus, item_id, kind, backend, status, compile_ms,
n_valid, false_rejects, n_invalid, false_accepts, walk_error, ...``) and
``tokens`` (one row per timed token: ``backend, corpus, kind, position,
fill_us, accept_us, rollback_us, forced_tokens``).

Metrics (MaskBench names): TBM is the time of the first mask fill at a token
position (µs), over all tokens of all valid-instance walks; TTFM is the cold
compile time (ms) of the items that compiled. Declared coverage = compiled ÷
items; empirical coverage = compiled and every valid instance accepted ÷ items
(an item without an oracle instance cannot count as empirically covered).
Timeouts are split by what ran past its limit: a *compile timeout* has no
compile time (the compile, or the backend's construction before it, was
killed); a *walk timeout* compiled, then its instance walks were killed.
An item *out of memory* (``oom``) ran past its worker's memory cap
(``cdbench profile --worker-memory``), compiling or walking.

Forced (jump-forward) tokens are counted by each backend's own rule
(:data:`FORCED_TOKEN_RULES`), so their counts compare within a backend, not
across backends.

>>> import pandas as pd
>>> items = pd.DataFrame({"corpus": ["c"], "item_id": ["i"], "kind": ["regex"], "backend": ["b"],
...     "status": ["ok"], "compile_ms": [2.0], "n_valid": [1], "false_rejects": [0],
...     "n_invalid": [1], "false_accepts": [0], "n_warnings": [0], "walk_error": [""]})
>>> tokens = pd.DataFrame({"backend": ["b"] * 2, "corpus": ["c"] * 2, "kind": ["regex"] * 2,
...     "position": [0, 1], "fill_us": [10.0, 30.0], "accept_us": [1.0, 1.0],
...     "rollback_us": [None, 2.0], "forced_tokens": [0, 1]})
>>> summarize(items, tokens).loc["b", ["TBM avg µs", "declared coverage"]].tolist()
[20.0, 1.0]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

FAILED_STATUSES = ("unsupported", "error", "timeout", "crash", "oom")

# What "forced tokens" means per backend (cdbench/backends); the rules differ,
# so the counts do not compare across backends.
FORCED_TOKEN_RULES = {
    "xgrammar": "the string xgrammar's find_jump_forward_string says every continuation starts with, "
    "tokenized by the vocabulary's own tokenizer and cut at the first token the matcher refuses",
    "llguidance": "llguidance's compute_ff_tokens (its forced bytes, tokenized by llguidance)",
    "outlines": "the chain of states where exactly one token (not EOS) is allowed; a forced string "
    "that several tokenizations could spell counts 0",
}
FORCED_TOKENS_CAVEAT = (
    "Forced (jump-forward) tokens are counted by each backend's own rule, so compare them within "
    "a backend, not across backends"
)


@dataclass
class ProfileReportInfo:
    """What the report says about how the numbers were made."""

    command: str = ""
    settings: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _pct(values: pd.Series, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(items: pd.DataFrame, tokens: pd.DataFrame, by: Sequence[str] = ("backend",)) -> pd.DataFrame:
    """One row per group of ``by`` with the MaskBench-style columns."""
    by = list(by)
    rows = {}
    unwrap = (lambda key: key[0]) if len(by) == 1 else (lambda key: key)
    token_groups = {unwrap(k): g for k, g in tokens.groupby(by, observed=True)} if len(tokens) else {}
    for key, group in items.groupby(by):
        key = unwrap(key)
        fills = token_groups.get(key, pd.DataFrame({"fill_us": []}))["fill_us"]
        compiled = group[group.status == "ok"]
        covered = compiled[(compiled.n_valid > 0) & (compiled.false_rejects == 0) & (compiled.walk_error == "")]
        times = compiled.compile_ms.dropna()
        n = len(group)
        rows[key] = {
            "items": n,
            "TBM avg µs": float(fills.mean()) if len(fills) else float("nan"),
            "TBM p50 µs": _pct(fills, 50),
            "TBM p99 µs": _pct(fills, 99),
            "TBM p99.9 µs": _pct(fills, 99.9),
            "TBM max µs": float(fills.max()) if len(fills) else float("nan"),
            "TTFM p50 ms": _pct(times, 50),
            "TTFM p90 ms": _pct(times, 90),
            "TTFM p99 ms": _pct(times, 99),
            "declared coverage": len(compiled) / n,
            "empirical coverage": len(covered) / n,
            "false rejects": int(group.false_rejects.sum()),
            "false accepts": int(group.false_accepts.sum()),
            "unsupported": int((group.status == "unsupported").sum()),
            "errors": int((group.status == "error").sum()),
            "compile timeouts": int(((group.status == "timeout") & group.compile_ms.isna()).sum()),
            "walk timeouts": int(((group.status == "timeout") & group.compile_ms.notna()).sum()),
            "crashes": int((group.status == "crash").sum()),
            "out of memory": int((group.status == "oom").sum()),
            "warned items": int((group.n_warnings > 0).sum()),
        }
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index = pd.MultiIndex.from_tuples(list(rows), names=by) if len(by) > 1 else pd.Index(list(rows), name=by[0])
    return table


def token_costs(tokens: pd.DataFrame) -> pd.DataFrame:
    """Accept, rollback and jump-forward figures per backend."""
    rows = {}
    for backend, group in tokens.groupby("backend", observed=True):
        rollback = group.rollback_us.dropna()
        rows[backend] = {
            "tokens": len(group),
            "accept avg µs": float(group.accept_us.mean()),
            "accept p99 µs": _pct(group.accept_us, 99),
            "rollback(1) avg µs": float(rollback.mean()) if len(rollback) else float("nan"),
            "rollback(1) p99 µs": _pct(rollback, 99),
            "steps with forced tokens": float((group.forced_tokens > 0).mean()),
            "forced tokens per step": float(group.forced_tokens.mean()),
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def _markdown(table: pd.DataFrame) -> str:
    def cell(value: object) -> str:
        if isinstance(value, float):
            if np.isnan(value):
                return "–"
            if 0 < abs(value) <= 1 and value != int(value):
                return f"{value:.3f}"
            return f"{value:,.1f}" if abs(value) < 100 else f"{value:,.0f}"
        return str(value)

    index_names = [name or "" for name in table.index.names]
    header = index_names + [str(c) for c in table.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, *values in table.itertuples(name=None):  # itertuples keeps integer columns integers
        keys = list(key) if isinstance(key, tuple) else [key]
        lines.append("| " + " | ".join([str(k) for k in keys] + [cell(v) for v in values]) + " |")
    return "\n".join(lines)


def _cdf_plot(samples: dict[str, np.ndarray], xlabel: str, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in samples.items():
        values = np.sort(values[values > 0])
        if len(values):
            ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=f"{name} (n={len(values):,})")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction ≤ x")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _position_plot(tokens: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = max(int(tokens.position.max()) + 2, 2) if len(tokens) else 2
    edges = np.unique(np.geomspace(1, top, 30).astype(int)) - 1
    for backend, group in tokens.groupby("backend", observed=True):
        bins = pd.cut(group.position, edges, right=False)
        stats = group.groupby(bins, observed=True).fill_us.agg(
            p50="median", p99=lambda s: np.percentile(s, 99)
        )
        starts = [interval.left + 1 for interval in stats.index]
        (line,) = ax.plot(starts, stats.p50, marker=".", label=f"{backend} p50")
        ax.plot(starts, stats.p99, linestyle="--", color=line.get_color(), label=f"{backend} p99")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("token position in the output (1-based, log bins)")
    ax.set_ylabel("TBM (µs)")
    ax.set_title("Mask time against position in the output")
    ax.grid(True, which="both", alpha=0.3)
    # Below the axes: inside, it hides the curves whatever corner it takes.
    ax.legend(fontsize="small", ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _messages(items: pd.DataFrame, limit: int = 5) -> list[str]:
    lines = []
    failed = items[items.status.isin(FAILED_STATUSES)]
    for backend, group in failed.groupby("backend"):
        lines += [f"**{backend}**", ""]
        short = group.message.fillna("").str.replace(r"\s+", " ", regex=True).str.slice(0, 140)
        for (status, message), count in (
            group.assign(short=short).groupby(["status", "short"]).size().sort_values(ascending=False).head(limit).items()
        ):
            lines.append(f"- {count} × `{status}`: {message.replace('|', '/') or '(no message)'}")
        lines.append("")
    return lines


def _examples(items: pd.DataFrame, limit: int = 5) -> list[str]:
    lines = []
    rejects = items[items.false_rejects > 0]
    for backend, group in rejects.groupby("backend"):
        lines += [f"**{backend}** false rejects (first {min(limit, len(group))} of {len(group)} items):", ""]
        for row in group.head(limit).itertuples():
            # Escaped (\n, \t, ...) so that the text stays on one markdown line.
            text = json.dumps(str(row.first_reject_text), ensure_ascii=False)[1:-1]
            text = (text if len(text) <= 160 else "…" + text[-160:]).replace("`", "'")
            lines.append(f"- `{row.item_id}` at token {row.first_reject_position}: `{text}`")
        lines.append("")
    accepts = items[items.false_accepts > 0]
    for backend, group in accepts.groupby("backend"):
        labels = group.false_accept_labels.str.split(",").explode().value_counts()
        lines.append(
            f"- **{backend}** false accepts in {len(group)} items ("
            + ", ".join(f"`{item}`" for item in group.item_id.head(limit))
            + (", …" if len(group) > limit else "")
            + "), by mutation: "
            + ", ".join(f"{label} {count}" for label, count in labels.items())
        )
    return lines


def write_report(items: pd.DataFrame, tokens: pd.DataFrame, out_dir: str | Path, info: ProfileReportInfo) -> list[Path]:
    """Write ``report.md`` and the PNG plots into ``out_dir``; returns the paths written."""
    out_dir = Path(out_dir)
    backends = sorted(items.backend.unique())
    tbm_png, ttfm_png, position_png = (out_dir / n for n in ("tbm_cdf.png", "ttfm_cdf.png", "tbm_by_position.png"))
    _cdf_plot(
        {b: tokens[tokens.backend == b].fill_us.to_numpy() for b in backends},
        "TBM: first mask fill after a token (µs, log)", "Per-token mask time, CDF", tbm_png,
    )
    _cdf_plot(
        {b: items[(items.backend == b) & (items.status == "ok")].compile_ms.to_numpy(dtype=float) for b in backends},
        "TTFM: cold compile (ms, log)", "Compile time, CDF (compiled items)", ttfm_png,
    )
    _position_plot(tokens, position_png)

    lines = ["# Grammar backends side by side", ""]
    if info.command:
        lines += ["Command:", "", "```", info.command, "```", ""]
    if info.settings:
        lines += ["Settings: " + ", ".join(f"{k}={v}" for k, v in info.settings.items()), ""]
    if info.versions:
        lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in info.versions.items()), ""]
    lines += [f"- {note}" for note in info.notes] + ([""] if info.notes else [])
    lines += ["## All items", "", _markdown(summarize(items, tokens)), ""]
    if len(tokens):
        rules = [f"  - {b}: {FORCED_TOKEN_RULES[b]}." for b in backends if b in FORCED_TOKEN_RULES]
        lines += [
            "## Accept, rollback, jump-forward",
            "",
            _markdown(token_costs(tokens)),
            "",
            f"- {FORCED_TOKENS_CAVEAT}" + (":" if rules else "."),
            *rules,
            "",
        ]
    lines += [
        "## By corpus file and kind",
        "",
        _markdown(summarize(items, tokens, ("corpus", "kind", "backend"))),
        "",
        "## Plots",
        "",
        f"![TBM CDF]({tbm_png.name})",
        "",
        f"![TTFM CDF]({ttfm_png.name})",
        "",
        f"![TBM by position]({position_png.name})",
        "",
    ]
    messages = _messages(items)
    if messages:
        lines += ["## Most frequent compile failures", ""] + messages + [""]
    examples = _examples(items)
    if examples:
        lines += ["## Correctness failures", ""] + examples + [""]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    return [report, tbm_png, ttfm_png, position_png]
