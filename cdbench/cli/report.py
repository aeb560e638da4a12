"""``cdbench report``: rebuild a run folder's report.md and plots from its saved results."""

from __future__ import annotations

from pathlib import Path

import typer

from cdbench.cli.support import (
    console,
    err_console,
    print_forward_speed,
    print_spec_costs,
    print_workload_issues,
    user_errors,
)
from cdbench.reports.run_report import build_report
from cdbench.reports.tables import console_sections, to_rich
from cdbench.results.run_folder import load_run
from cdbench.results.stopped_run import status_of


def report(
    run_dir: Path = typer.Argument(..., help="Run folder written by `cdbench run` (holds summary.json)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only print where the report is."),
) -> None:
    """(Re)build report.md and plots/*.png of a run from its saved results; the run is not repeated.

    Example: cdbench report runs/default
    """
    with user_errors(run_dir / "run.log"):
        run = load_run(run_dir, stopped_ok=True)
        with err_console.status("drawing plots and writing report.md"):
            path = build_report(run)
    if not quiet:
        for section in console_sections(run.summary):
            console.print(to_rich(section))
        print_workload_issues(run)
        print_forward_speed(run)
        print_spec_costs(run)
    status = status_of(run.summary)
    if status is not None:
        console.print(f"[yellow]this run {status.describe()}[/]: the report covers the requests that ended",
                      highlight=False)
    console.print(f"report: {path}")
