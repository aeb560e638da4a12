"""``cdbench gate``: fail (exit 1) when a run regressed against a stored baseline."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from cdbench.cli.support import console, err_console, user_errors
from cdbench.reports.gate import (
    Baseline,
    GateError,
    GateResult,
    Verdict,
    check_tolerance_names,
    evaluate_gate,
    is_run_summary,
    numeric_metrics,
    parse_tolerances,
)
from cdbench.reports.tables import format_value
from cdbench.results.run_folder import load_run

_STYLE = {Verdict.REGRESSED: "bold red", Verdict.MISSING: "bold red", Verdict.IMPROVED: "green", Verdict.OK: "",
          Verdict.NEW: "cyan", Verdict.INFO: "dim"}
_ORDER = [Verdict.REGRESSED, Verdict.MISSING, Verdict.IMPROVED, Verdict.OK, Verdict.NEW, Verdict.INFO]


def gate_table(result: GateResult) -> Table:
    table = Table(title="Regression gate", title_justify="left")
    widest = max((len(c.metric) for c in result.checks), default=6)
    table.add_column("metric", no_wrap=True, min_width=widest)
    for name, justify in (("better", "left"), ("baseline", "right"), ("current", "right"), ("change", "right"),
                          ("tolerance", "right"), ("verdict", "left")):
        table.add_column(name, justify=justify)
    # Regressions first, so a CI log shows what failed without scrolling.
    for check in sorted(result.checks, key=lambda c: (_ORDER.index(c.verdict), c.metric)):
        change = "-" if check.change_pct is None else f"{check.change_pct:+.2f}%"
        style = _STYLE[check.verdict]
        verdict = f"[{style}]{check.verdict.value}[/]" if style else check.verdict.value
        table.add_row(check.metric, check.direction.value, format_value(check.baseline), format_value(check.current),
                      change, f"{check.tolerance_pct:g}%", verdict)
    return table


def gate(
    run_dir: Path = typer.Argument(..., help="Run folder to check (holds summary.json)."),
    baseline: Path = typer.Option(..., "--baseline", "-b", help="Baseline JSON (see ci/baseline.json), or an earlier run's folder or summary.json (default tolerances)."),
    tolerance: list[str] = typer.Option(
        [], "--tolerance", "-t", help="METRIC=PCT: allowed change in the bad direction; repeatable; overrides the baseline's."
    ),
    update: bool = typer.Option(
        False, "--update", help="Write this run's metrics into the baseline (keeping its tolerances) instead of checking."
    ),
) -> None:
    """Compare a run with a baseline: latency up, throughput down, validity down, ... beyond tolerance is a regression.

    Prints every metric with its verdict; exits 1 on any regression (or a baseline metric the run lacks), else 0.

    Examples:
      cdbench gate runs/ci --baseline ci/baseline.json --tolerance p99_ttft_ms=5
      cdbench gate runs/new --baseline runs/old
    """
    with user_errors():
        tolerances = parse_tolerances(tolerance)
        run = load_run(run_dir, stopped_ok=False)  # a gate judges finished runs only
        current = numeric_metrics(run.summary)
        if update:
            if is_run_summary(baseline):
                raise GateError(f"--update writes a baseline JSON file; {baseline} is a run (folder or summary.json), "
                                "give a file such as ci/baseline.json")
            check_tolerance_names(tolerances, current, "--tolerance")
            old = Baseline.load(baseline) if baseline.is_file() else Baseline(metrics={})
            new = old.model_copy(update={"metrics": current, "source": f"cdbench gate --update from {run_dir}"})
            new.tolerances_pct.update(tolerances)
            new.save(baseline)
            console.print(f"baseline {baseline} updated with {len(current)} metrics from {run_dir}")
            return
        result = evaluate_gate(current, Baseline.load(baseline), tolerances)
    console.print(gate_table(result))
    if result.passed:
        console.print(f"[green]gate passed[/]: no regression against {baseline}")
        return
    names = ", ".join(c.metric for c in result.regressions)
    err_console.print(f"[bold red]gate failed[/]: {len(result.regressions)} regression(s): {names}")
    raise typer.Exit(1)
