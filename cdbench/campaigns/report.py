"""A campaign's report: each comparison, cell by cell, with ``cdbench fidelity``'s bars and noise floor.

For every comparison, cell and seed, the comparison's runs (an arm's one run, or the median of its copies'
figures with their range) are judged against the reference arm's first copy, beside the noise arm's copies
(:func:`cdbench.reports.fidelity.evaluate_fidelity`);
each judgement is written as ``<report>/<comparison>/<cell>[/seed<S>]/fidelity.md`` with its CDF plots, and
all of them as one frame (``campaign.csv``) and one page (``campaign.md``: per comparison, the cells passing,
the figures within their bar, and a table of the checked figures' signed errors).

Runs are read through a :data:`RunOpener` (run id -> run), so the report is the same from the campaign's run
folders and from a pack of them.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from cdbench.campaigns.plan import Cell, axis_label, cells, plan_runs, run_id
from cdbench.campaigns.spec import CampaignSpec, Comparison
from cdbench.reports.fidelity import (
    FidelityError,
    check_same_workload,
    evaluate_fidelity,
    fidelity_frame,
    paired_intervals,
    spread_text,
    unresolved_text,
    write_fidelity,
)
from cdbench.results.run_folder import ResultsError, SavedRun

RunOpener = Callable[[str], SavedRun]
"""Run id -> the saved run (raises :class:`ResultsError` when it is missing)."""


def folder_opener(out: Path) -> RunOpener:
    """Read runs from the campaign folder (a run kept with only its summary and config reads with empty tables;
    one that stopped early is refused, as ``cdbench fidelity`` refuses it)."""
    from cdbench.results.pack import open_run

    return lambda rid: open_run(Path(out) / rid, stopped_ok=False)


def _judgements(spec: CampaignSpec, comparison: Comparison) -> list[tuple[Cell, int]]:
    """The (cell, seed) pairs a comparison judges: one per distinct set of runs it reads."""
    arms = [comparison.reference, *comparison.runs, *([comparison.noise] if comparison.noise else [])]
    seen: dict[tuple[str, ...], tuple[Cell, int]] = {}
    for cell, seed in itertools.product(cells(spec), spec.seeds):
        if not all(spec.runs_in(arm, cell.as_dict()) for arm in arms):
            continue
        key = tuple(run_id(spec, arm, cell, seed) for arm in arms)
        seen.setdefault(key, (cell, seed))
    return list(seen.values())


def _copies(spec: CampaignSpec, arm: str, cell: Cell, seed: int, open_run: RunOpener) -> list[SavedRun]:
    """Every copy of ``arm``'s run in this cell and seed, the first first."""
    return [open_run(run_id(spec, arm, cell, seed, copy)) for copy in range(1, spec.arms[arm].copies + 1)]


def _noise_runs(spec: CampaignSpec, comparison: Comparison, cell: Cell, seed: int,
                open_run: RunOpener) -> dict[str, SavedRun]:
    if comparison.noise is None:
        return {}
    arm = comparison.noise
    first, *others = _copies(spec, arm, cell, seed, open_run)
    label = comparison.reference if arm == comparison.reference else f"{arm}-1"
    return {label: first, **{f"{arm}-{copy}": run for copy, run in enumerate(others, 2)}}


def _folder(spec: CampaignSpec, comparison: Comparison, cell: Cell, seed: int) -> Path:
    folder = Path(comparison.name) / cell.name
    return folder / f"seed{seed}" if len(spec.seeds) > 1 else folder


def evaluate_campaign(spec: CampaignSpec, open_run: RunOpener, report_dir: Path) -> pd.DataFrame:
    """Every comparison's figures as one frame (one row a cell, seed, run and metric; a row with an empty
    metric says why a judgement is incomplete), writing each judgement's fidelity page and plots."""
    rows = []
    for comparison in spec.comparisons:
        tolerances = comparison.tolerances()
        for cell, seed in _judgements(spec, comparison):
            key = {**{axis: _scalar(value) for axis, value in cell.values}, "seed": seed,
                   "comparison": comparison.name}
            try:
                copies = {arm: _copies(spec, arm, cell, seed, open_run) for arm in comparison.runs
                          if spec.arms[arm].copies > 1}
                runs = {arm: copies[arm][0] if arm in copies else open_run(run_id(spec, arm, cell, seed))
                        for arm in (comparison.reference, *comparison.runs)}
                noise = _noise_runs(spec, comparison, cell, seed, open_run)
                check_same_workload({**runs, **{f"{arm}-{i}": run for arm, arm_copies in copies.items()
                                                for i, run in enumerate(arm_copies[1:], 2)}})
                if noise:
                    check_same_workload(noise)
            except (ResultsError, FidelityError) as err:
                rows.append({**key, "run": "", "metric": "", "verdict": str(err)})
                continue
            result = evaluate_fidelity({label: [c.summary for c in copies[label]] if label in copies else run.summary
                                        for label, run in runs.items()},
                                       [run.summary for run in noise.values()] or None, tolerances,
                                       tuple(noise) if noise else None,
                                       paired_intervals({label: copies.get(label, run) for label, run in runs.items()}))
            # the CDFs draw the other noise copies only beside runs of their own workload
            drawn = {k: v for k, v in noise.items() if k not in runs} if comparison.noise == comparison.reference \
                else None
            write_fidelity(runs, result, report_dir / _folder(spec, comparison, cell, seed), drawn)
            frame = fidelity_frame(result)
            for position, (name, value) in enumerate(key.items()):
                frame.insert(position, name, value)
            rows.extend(frame.to_dict("records"))
    return pd.DataFrame(rows)


def _scalar(value: object) -> object:
    """A cell value as one table entry: lists and mappings as JSON text, booleans as YAML writes them."""
    if isinstance(value, bool):
        return str(value).lower()
    return value if isinstance(value, int | float | str) or value is None else json.dumps(value, sort_keys=True)


def runs_table(spec: CampaignSpec, open_run: RunOpener) -> pd.DataFrame:
    """One row a planned run: its cell values, seed, arm, copy and id, and the numeric figures of its
    summary (none where the run is missing)."""
    rows = []
    for run in plan_runs(spec):
        row: dict[str, object] = {axis: _scalar(value) for axis, value in run.cell.values}
        row.update(seed=run.seed, arm=run.arm, copy=run.copy, run_id=run.run_id)
        try:
            summary = open_run(run.run_id).summary
        except ResultsError:
            summary = {}
        row.update({k: v for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)})
        rows.append(row)
    return pd.DataFrame(rows)


def _cell_text(row: pd.Series) -> str:
    if pd.isna(row["error_pct"]):
        return "n/a"
    text = f"{row['error_pct']:+.1f}"
    if pd.notna(row["noise_pct"]) and row["noise_pct"] > row["tolerance_pct"]:
        text += f" (n {row['noise_pct']:.1f})"
    text = text if row["verdict"] == "within" else f"**{text}** ✗"
    if pd.notna(row.get("unresolved")) and bool(row.get("unresolved")):
        requests = row.get("requests_to_resolve")
        text += unresolved_text(row["interval_low_pct"], row["interval_high_pct"],
                                int(requests) if pd.notna(requests) else None)
    return text + spread_text(row.get("spread_min_pct"), row.get("spread_max_pct"))


def _table(spec: CampaignSpec, part: pd.DataFrame, checked: list[str]) -> list[str]:
    keys = [*spec.axes, *(["seed"] if len(spec.seeds) > 1 else []), "run"]
    header = [*(axis_label(k, spec.axes) for k in keys), *checked, "pass"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for key, rows in part.groupby(keys, sort=False, dropna=False):
        by_metric = rows.set_index("metric")
        values = [_cell_text(by_metric.loc[m]) if m in by_metric.index else "-" for m in checked]
        ok = (rows["verdict"] == "within").all()
        lines.append("| " + " | ".join([*map(str, key), *values, "yes" if ok else "no"]) + " |")
    return lines


def verdicts(spec: CampaignSpec, frame: pd.DataFrame) -> dict[str, tuple[int, int, int, int, int]]:
    """Per comparison: (cells passing, cells judged, figures within their bar, figures checked, figures beyond
    their bar but unresolved); a cell of a comparison with several runs counts once per run."""
    out = {}
    keys = [*spec.axes, "seed", "run"]
    for comparison in spec.comparisons:
        part = frame[(frame["comparison"] == comparison.name) & (frame["metric"] != "")] if len(frame) else frame
        checked = part[part["tolerance_pct"].notna()] if len(part) else part
        if checked.empty:
            out[comparison.name] = (0, 0, 0, 0, 0)
            continue
        cell_pass = checked.groupby(keys, dropna=False)["verdict"].apply(lambda v: (v == "within").all())
        unresolved = int(checked["unresolved"].eq(True).sum()) if "unresolved" in checked else 0
        out[comparison.name] = (int(cell_pass.sum()), len(cell_pass), int((checked["verdict"] == "within").sum()),
                                len(checked), unresolved)
    return out


def write_campaign_report(spec: CampaignSpec, frame: pd.DataFrame, runs: pd.DataFrame, report_dir: Path) -> Path:
    """``campaign.md``, ``campaign.csv`` (the comparisons' figures) and ``runs.csv`` (:func:`runs_table`) in
    ``report_dir``; returns the markdown's path."""
    report_dir.mkdir(parents=True, exist_ok=True)
    frame.to_csv(report_dir / "campaign.csv", index=False)
    runs.to_csv(report_dir / "runs.csv", index=False)
    lines = [f"# Campaign {spec.name}", ""]
    if spec.description:
        lines += [spec.description.strip(), ""]
    lines += ["Written by `cdbench campaign report`; every figure is read from the campaign's runs. Signed relative "
              "error of each run against the reference, in percent; `(n X)`: the noise floor X % when it exceeds "
              "the tolerance; bold ✗: beyond the bar (max of tolerance and noise); `(unresolved: low..high, ~N "
              "requests)`: the error's 95 % interval over paired resamples of the workload's requests reaches into "
              "the bar (N: about the requests that would judge it); an arm of several copies is judged by the "
              "median of its copies' figures, `[low..high]` the range of the copies' errors.", ""]
    finished = int(runs["request_throughput"].notna().sum()) if "request_throughput" in runs else 0
    lines += [f"Runs: {finished} of {len(runs)} planned runs found (one row each in `runs.csv`).", ""]
    counts = verdicts(spec, frame)
    complete = frame[frame["metric"] != ""] if len(frame) else frame
    for comparison in spec.comparisons:
        passing, judged, within, checked, unresolved = counts[comparison.name]
        bar = ", ".join(f"{m} {p:g} %" for m, p in comparison.tolerances().items())
        noise = f"the copies of `{comparison.noise}`" if comparison.noise else "none"
        lines += [f"## {comparison.name}: {', '.join(comparison.runs)} against {comparison.reference}", ""]
        if comparison.title:
            lines += [comparison.title, ""]
        lines += [f"Bar: {bar}. Noise floor: {noise}.", "",
                  f"Cells passing: {passing} of {judged}; figures within their bar: {within} of {checked}"
                  + (f"; of the others, {unresolved} unresolved (their 95 % interval over resampled requests "
                     "reaches into the bar: too few requests to judge)" if unresolved else "") + ".", ""]
        part = complete[complete["comparison"] == comparison.name] if len(complete) else complete
        if not part.empty:
            metrics = [m for m in comparison.tolerances() if m in set(part["metric"])]
            lines += [*_table(spec, part[part["metric"].isin(metrics)], metrics), ""]
    incomplete = frame[frame["metric"] == ""] if len(frame) else frame
    for _, row in incomplete.iterrows():
        where = ", ".join(f"{axis}={row[axis]}" for axis in spec.axes)
        lines.append(f"- incomplete: {row['comparison']} at {where or 'the cell'}, seed {row['seed']}: {row['verdict']}")
    md = report_dir / "campaign.md"
    md.write_text("\n".join(lines).rstrip() + "\n")
    return md
