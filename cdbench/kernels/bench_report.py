"""Turn a ``cdbench kernels`` run into files: CSVs, a markdown summary, a plot, a cost table."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from cdbench.kernels.bench import BenchEnv, CopyResult, KernelResult
from cdbench.kernels.cost_table import CopyTiming, KernelTiming, MaskCostTable

APPLY_COLUMNS = ["copy", "naive", "xgr-cpu", "xgr-torch-native", "xgr-torch-compile", "xgr-triton", "xgr-cuda",
                 "cdbench-rmw", "cdbench-skip", "cdbench-store", "cdbench-adaptive", "cdbench"]
XGR_FAST = ["xgr-triton", "xgr-cuda", "xgr-cpu"]
GRAPH_COLUMNS = ["copy", "naive", "xgr-triton", "xgr-cuda", "cdbench-rmw", "cdbench-skip", "cdbench-store",
                 "cdbench-adaptive", "cdbench"]
FUSED_COLUMNS = ["apply+argmax", "cdbench-argmax", "apply+sample", "cdbench-sample"]
IDX_COLUMNS = ["cdbench", "cdbench-idx", "xgr-triton", "xgr-triton-idx", "xgr-cuda", "xgr-cuda-idx"]
KEYS = ["vocab", "dtype", "batch"]
DTYPE_ORDER = ("bf16", "fp16", "fp32")
DENSITIES = ("sparse", "dense")


def results_frame(results: Sequence[KernelResult]) -> pd.DataFrame:
    return pd.DataFrame([asdict(r) for r in results])


def load_run(folder: Path) -> tuple[list[KernelResult], list[CopyResult], BenchEnv]:
    """Read back what :func:`write_reports` wrote (to re-render a run's reports); a stored run may keep its
    ``results.csv`` gzipped (``results.csv.gz``)."""
    results_csv = folder / "results.csv"
    frame = pd.read_csv(results_csv if results_csv.is_file() else folder / "results.csv.gz", dtype={"error": str, "throttle": str}, keep_default_na=False,
                        na_values={k: [""] for k in ("median_us", "q20_us", "q80_us", "floor_us", "exact",
                                                     "gpu_temp_c", "sm_mhz")})
    results = []
    for row in frame.to_dict("records"):
        for key in ("median_us", "q20_us", "q80_us", "exact", "gpu_temp_c", "sm_mhz"):
            if key in row and isinstance(row[key], float) and math.isnan(row[key]):
                row[key] = None
        if row["exact"] is not None:
            row["exact"] = row["exact"] in (True, "True")
        results.append(KernelResult(**row))
    h2d = folder / "h2d.csv"
    # (a run that timed no copies wrote an empty file, or none)
    copies = [CopyResult(**r) for r in pd.read_csv(h2d).to_dict("records")] if h2d.is_file() and h2d.stat().st_size > 1 \
        else []
    env = BenchEnv(**json.loads((folder / "env.json").read_text(encoding="utf-8")))
    return results, copies, env


def write_reports(results: Sequence[KernelResult], copies: Sequence[CopyResult], env: BenchEnv, out: Path) -> str:
    """Write ``results.csv``, ``h2d.csv``, ``env.json``, ``summary.md`` and ``kernels.png``; return the summary."""
    out.mkdir(parents=True, exist_ok=True)
    frame = results_frame(results)
    frame.to_csv(out / "results.csv", index=False)
    pd.DataFrame([asdict(c) for c in copies]).to_csv(out / "h2d.csv", index=False)
    (out / "env.json").write_text(json.dumps(asdict(env), indent=1) + "\n", encoding="utf-8")
    summary = summary_markdown(frame, copies, env)
    (out / "summary.md").write_text(summary, encoding="utf-8")
    plot(frame, env, out / "kernels.png")
    return summary


def _pivot(frame: pd.DataFrame, timing: str, density: str, columns: Sequence[str]) -> pd.DataFrame:
    sub = frame[(frame.timing == timing) & (frame.density == density)]
    if sub.empty:
        return pd.DataFrame()
    table = sub.pivot_table(index=KEYS, columns="variant", values="median_us", aggfunc="first")
    floor = sub.groupby(KEYS)["floor_us"].first()
    table = table[[c for c in columns if c in table.columns]]
    table.insert(0, "floor", floor)
    return table


def _fmt(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _markdown(table: pd.DataFrame) -> str:
    head = [*KEYS, *table.columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, row in table.iterrows():
        cells = [str(k) for k in key] + [c if isinstance(c, str) else _fmt(c) for c in row.tolist()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _min_pct_floor(table: pd.DataFrame, key: str, stats: dict[str, float]) -> None:
    """``stats[key]``: lowest cdbench % of floor in ``table``; ``stats[key_<dtype>]``: the same per dtype."""
    pct = table["floor"] / table["cdbench"] * 100
    stats[key] = float(pct.min())
    for dtype, values in pct.groupby(level="dtype"):
        stats[f"{key}_{dtype}"] = float(values.min())


def target_stats(frame: pd.DataFrame) -> dict[str, float]:
    """The numbers the targets are judged on, per density (absent where the run lacks them)."""
    stats: dict[str, float] = {}
    for density in DENSITIES:
        event = _pivot(frame, "event", density, APPLY_COLUMNS)
        if event.empty or "cdbench" not in event:
            continue
        big = event[event.index.get_level_values("batch") >= 64]
        _min_pct_floor(big, f"{density}_b64_min_pct_floor", stats)
        xgr = [c for c in XGR_FAST if c in event]
        if xgr:
            stats[f"{density}_b64_min_ratio_vs_xgr"] = float((big[xgr].min(axis=1) / big["cdbench"]).min())
    graph = pd.concat([_pivot(frame, "graph", d, GRAPH_COLUMNS) for d in DENSITIES])
    if graph.empty or "cdbench" not in graph:
        return stats
    batch = graph.index.get_level_values("batch")
    small = graph[batch <= 8]
    if not small.empty and "copy" in small:
        stats["graph_max_ratio_to_copy"] = float((small["cdbench"] / small["copy"]).max())
        xgr = [c for c in XGR_FAST if c in small]
        if xgr:
            stats["graph_min_ratio_vs_xgr"] = float((small[xgr].min(axis=1) / small["cdbench"]).min())
    # graph replay at large batches: the kernel's own GPU time, without the launch gap before each timed call
    big_sparse = _pivot(frame, "graph", "sparse", GRAPH_COLUMNS)
    if not big_sparse.empty and "cdbench" in big_sparse:
        big_sparse = big_sparse[big_sparse.index.get_level_values("batch") >= 64]
        if not big_sparse.empty:
            _min_pct_floor(big_sparse, "graph_sparse_b64_min_pct_floor", stats)
            xgr = [c for c in XGR_FAST if c in big_sparse]
            if xgr:
                stats["graph_sparse_b64_min_ratio_vs_xgr"] = float(
                    (big_sparse[xgr].min(axis=1) / big_sparse["cdbench"]).min())
    return stats


def summary_markdown(frame: pd.DataFrame, copies: Sequence[CopyResult], env: BenchEnv) -> str:
    timing = "event" if env.device == "cuda" else "wall"
    unit = "do_bench median (L2 flushed, rotating inputs)" if timing == "event" else "CPU wall-clock median"
    parts = [
        "# cdbench kernels",
        "",
        f"- device: {env.gpu}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in env.versions.items())}",
        f"- date: {env.date}; seed {env.seed}",
        f"- command: `{env.command}`",
        f"- copy bandwidth (read + write counted): {env.copy_gbs:.0f} GB/s; floor = B·(4·⌈V/32⌉ + 2·V·elem) / that",
    ]
    parts += [f"- note: {n}" for n in env.notes]
    bad = frame[(frame.exact == False) | (frame.error != "")]  # noqa: E712 - pandas element-wise
    checked = frame[frame.timing != "graph"]
    parts.append(f"- correctness: {int((checked.exact == True).sum())}/{len(checked)} variant×case checks exact "  # noqa: E712
                 "against the torch reference (fresh inputs, torch.equal)")
    if "throttle" in frame and (frame.throttle.fillna("") != "").any():
        hot = frame[frame.throttle.fillna("") != ""].drop_duplicates(["vocab", "batch", "dtype", "density"])
        parts.append(f"- WARNING: GPU clock slowdown reported (NVML) at the start of {len(hot)} cases, e.g. "
                     + ", ".join(f"V={r.vocab} B={r.batch} {r.dtype} {r.density} ({r.throttle}, {r.gpu_temp_c:.0f} °C)"
                                 for r in hot.head(5).itertuples()))
    if "gpu_temp_c" in frame and frame.gpu_temp_c.notna().any():
        parts.append(f"- GPU temperature over the sweep: {frame.gpu_temp_c.min():.0f}–{frame.gpu_temp_c.max():.0f} °C, "
                     f"SM clock {frame.sm_mhz.min():.0f}–{frame.sm_mhz.max():.0f} MHz")
    for _, row in bad.iterrows():
        parts.append(f"  - {row.variant} V={row.vocab} B={row.batch} {row.dtype} {row.density} {row.timing}: "
                     f"{'error ' + row.error if row.error else 'NOT EXACT'}")
    stats = target_stats(frame)
    if stats:
        parts += ["", "## Targets (event timing for B ≥ 64 unless said, graph replay for B ≤ 8)", ""]

        def by_dtype(key: str) -> str:
            per = [f"{d} {stats[f'{key}_{d}']:.0f} %" for d in DTYPE_ORDER if f"{key}_{d}" in stats]
            return f" ({', '.join(per)})" if len(per) > 1 else ""

        for density in DENSITIES:
            if f"{density}_b64_min_pct_floor" in stats:
                parts.append(f"- B ≥ 64, {density}: cdbench reaches at least "
                             f"{stats[f'{density}_b64_min_pct_floor']:.0f} % of the byte floor"
                             + by_dtype(f"{density}_b64_min_pct_floor")
                             + (" (target ≥ 90 %)" if density == "sparse" else ""))
            if f"{density}_b64_min_ratio_vs_xgr" in stats:
                parts.append(f"- B ≥ 64, {density}: fastest xgrammar / cdbench ≥ "
                             f"{stats[f'{density}_b64_min_ratio_vs_xgr']:.2f} (target ≥ 1.0)")
        if "graph_sparse_b64_min_pct_floor" in stats:
            parts.append(f"- B ≥ 64, sparse, graph replay: cdbench reaches at least "
                         f"{stats['graph_sparse_b64_min_pct_floor']:.0f} % of the byte floor"
                         + by_dtype("graph_sparse_b64_min_pct_floor"))
        if "graph_sparse_b64_min_ratio_vs_xgr" in stats:
            parts.append(f"- B ≥ 64, sparse, graph replay: fastest xgrammar / cdbench ≥ "
                         f"{stats['graph_sparse_b64_min_ratio_vs_xgr']:.2f}")
        if "graph_max_ratio_to_copy" in stats:
            parts.append(f"- B ≤ 8, graph replay: cdbench / same-size copy ≤ {stats['graph_max_ratio_to_copy']:.2f} "
                         f"(target ≤ 1.2); fastest xgrammar / cdbench ≥ {stats.get('graph_min_ratio_vs_xgr', math.nan):.2f}")
    for density in ("sparse", "dense"):
        table = _pivot(frame, timing, density, APPLY_COLUMNS)
        if table.empty:
            continue
        if "cdbench" in table:
            table["%fl"] = [f"{100 * f / t:.0f} %" for f, t in zip(table["floor"], table["cdbench"])]
            xgr = [c for c in XGR_FAST if c in table]
            if xgr:
                table["xgr/cdb"] = [f"{v:.2f}" for v in table[xgr].min(axis=1) / table["cdbench"]]
        parts += ["", f"## Apply, {density} mask — {unit}, µs", "",
                  "`cdbench` = default mode (auto); `%fl` = floor / cdbench; `xgr/cdb` = fastest xgrammar kernel "
                  "/ cdbench (> 1: cdbench faster).", "", _markdown(table)]
    for density in ("sparse", "dense"):
        table = _pivot(frame, "graph", density, GRAPH_COLUMNS)
        if table.empty:
            continue
        if "cdbench" in table:
            table["%fl"] = [f"{100 * f / t:.0f} %" for f, t in zip(table["floor"], table["cdbench"])]
            xgr = [c for c in XGR_FAST if c in table]
            if xgr:
                table["xgr/cdb"] = [f"{v:.2f}" for v in table[xgr].min(axis=1) / table["cdbench"]]
        if {"cdbench", "copy"} <= set(table.columns):
            table["cdb/copy"] = [f"{v:.2f}" for v in table["cdbench"] / table["copy"]]
        parts += ["", f"## CUDA-graph replay, {density} mask — µs per call (no launch gaps, no L2 flush)", "",
                  _markdown(table)]
    dispatch = frame[frame.timing == "dispatch"]
    if not dispatch.empty:
        table = dispatch.pivot_table(index=["vocab", "dtype", "density"], columns="variant", values="median_us",
                                     aggfunc="first")
        order = [c for c in [*APPLY_COLUMNS, *FUSED_COLUMNS, "cdbench-idx"] if c in table.columns]
        head = ["vocab", "dtype", "density", *order]
        parts += ["", "## Host dispatch, B = 1 — CPU µs per call (200 calls enqueued without synchronizing)", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for key, row in table[order].iterrows():
            parts.append("| " + " | ".join([str(k) for k in key] + [_fmt(v) for v in row.tolist()]) + " |")
    for title, columns in (("Fused mask + token choice", FUSED_COLUMNS), ("Row subsets (`indices` = every other row)",
                                                                           IDX_COLUMNS)):
        for density in ("sparse", "dense"):
            table = _pivot(frame, timing, density, columns)
            # only when the run had this table's own variants, not just the plain apply ones
            if any(c not in APPLY_COLUMNS for c in table.columns.drop("floor", errors="ignore")):
                parts += ["", f"## {title}, {density} mask — {unit}, µs", "", _markdown(table)]
    if copies:
        parts += ["", "## Host→device bitmask copy, µs (pinned: CUDA events, non_blocking; pageable: host clock)", "",
                  "| bytes | pinned | pageable | pinned GB/s |", "|---|---|---|---|"]
        by_size: dict[int, dict[bool, float]] = {}
        for c in copies:
            by_size.setdefault(c.bytes, {})[c.pinned] = c.median_us
        for nbytes, row in sorted(by_size.items()):
            pinned, pageable = row.get(True, float("nan")), row.get(False, float("nan"))
            parts.append(f"| {nbytes} | {_fmt(pinned)} | {_fmt(pageable)} | {nbytes / pinned / 1e3:.1f} |")
    return "\n".join(parts) + "\n"


def plot(frame: pd.DataFrame, env: BenchEnv, path: Path) -> None:
    """Percent of the byte floor against batch size, one panel per (density, dtype), largest vocabulary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timing = "event" if env.device == "cuda" else "wall"
    sub = frame[(frame.timing == timing) & frame.kind.isin(["apply", "copy"]) & frame.median_us.notna()]
    densities = sorted(sub.density.unique()) or ["sparse"]
    dtypes = sorted(sub.dtype.unique()) or ["fp32"]
    fig, axes = plt.subplots(len(densities), len(dtypes), figsize=(5 * len(dtypes), 3.6 * len(densities)),
                             squeeze=False)
    vocab = sub.vocab.max() if not sub.empty else 0
    for i, density in enumerate(densities):
        for j, dtype in enumerate(dtypes):
            ax = axes[i][j]
            panel = sub[(sub.density == density) & (sub.dtype == dtype) & (sub.vocab == vocab)]
            for variant, rows in panel.groupby("variant"):
                rows = rows.sort_values("batch")
                ax.plot(rows.batch, 100 * rows.floor_us / rows.median_us, marker="o", label=variant,
                        linewidth=2.5 if variant == "cdbench" else 1)
            ax.set_xscale("log", base=2)
            ax.axhline(90, color="grey", linestyle=":", linewidth=1)
            ax.set_title(f"V={vocab} {dtype} {density}")
            ax.set_xlabel("batch")
            ax.set_ylabel("% of byte floor")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8)
    fig.suptitle(f"mask apply vs byte floor — {env.gpu}", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_cost_table(results: Sequence[KernelResult], copies: Sequence[CopyResult], env: BenchEnv,
                     gpu: str) -> MaskCostTable:
    """A :class:`MaskCostTable` (``kernel="cdbench"``) of every apply variant and the H2D copies.

    A row's time is its CUDA-graph replay time where one was measured (the kernel's GPU time, without
    the launch gap and host jitter that do_bench sees at small batches), else its do_bench median.
    """
    chosen: dict[tuple, KernelResult] = {}
    for r in results:
        if r.kind not in ("apply", "copy") or r.median_us is None or r.timing not in ("event", "graph"):
            continue
        key = (r.variant, r.vocab, r.batch, r.dtype, r.density)
        if key not in chosen or r.timing == "graph":
            chosen[key] = r
    apply = [KernelTiming(kernel=r.variant, vocab=r.vocab, batch=r.batch, dtype=r.dtype, density=r.density,
                          us=round(r.median_us, 3)) for r in chosen.values()]
    copy_rows = [CopyTiming(bytes=c.bytes, pinned=c.pinned, us=round(c.median_us, 3)) for c in copies]
    versions = ", ".join(f"{k} {v}" for k, v in env.versions.items())
    graph_batches = {r.batch for r in chosen.values() if r.timing == "graph"}
    graph = f"B <= {max(graph_batches)}" if graph_batches else "nowhere"
    source = (f"{env.gpu}; `{env.command}` on {env.date}; {versions}; apply = CUDA-graph replay per call where "
              f"measured ({graph}), else triton.testing.do_bench median (L2 flushed, rotating inputs); sparse rows "
              f"allow U(1-10 %) of tokens, dense 95 %; copy_h2d pinned = CUDA events of a non_blocking copy, "
              f"pageable = host clock of a blocking copy")
    return MaskCostTable(gpu=gpu, source=source, kernel="cdbench", apply=apply, copy_h2d=copy_rows)
