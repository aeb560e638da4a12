"""``cdbench sweep``: run a grid of configurations (local processes or Ray), resumable, with a summary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from cdbench.backends.engine_log import engine_log
from cdbench.cli.support import (
    OverwriteOpt,
    console,
    err_console,
    output_folder,
    print_engine_log,
    progress_bar,
    save_engine_log,
    user_errors,
)
from cdbench.reports.run_report import build_report
from cdbench.reports.sweep_report import sweep_rich, write_sweep_report
from cdbench.results.run_config import validate_run_config
from cdbench.results.sweep import (
    PointOutcome,
    expand_grid,
    grid_columns,
    ineffective_parameters,
    is_finished,
    load_sweep,
    point_config,
    run_point,
    run_sweep,
    sweep_table,
)


def run_and_report(config_tree: dict[str, Any], folder: str) -> str | None:
    """One sweep point: :func:`~cdbench.results.sweep.run_point` with the run's report and its engine log, as
    ``cdbench run`` keeps them (module level: picklable)."""
    try:
        with engine_log() as logged:
            return run_point(config_tree, folder, finish=build_report)
    finally:
        save_engine_log(logged, Path(folder))


def sweep(
    sweep_file: Annotated[Path, typer.Argument(help="Sweep YAML: base config, overrides and a grid of dotted paths.")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Sweep folder (default runs/sweep-<name>); a rerun "
                                                                     "of the same sweep resumes there.")] = None,
    overwrite: OverwriteOpt = False,
    workers: Annotated[int, typer.Option("--workers", "-w", min=1, help="Local worker processes.")] = 1,
    ray: Annotated[
        str | None, typer.Option("--ray", help="Run on Ray: a cluster address (ray://host:10001, auto) or 'local'.")
    ] = None,
) -> None:
    """Run every point of a grid into its own folder; finished points are skipped, so a rerun resumes.

    Prints a table of the points and writes sweep.md with throughput-vs-latency plots.

    Example: cdbench sweep cdbench/configs/sweep_example.yaml --workers 2
    """
    with user_errors():
        spec, base = load_sweep(sweep_file)
        points = expand_grid(spec)
        # Validate every point before running any, so a typo fails in a second, not an hour in.
        configs = [validate_run_config(point_config(base, point), source=f"sweep point {point.name}")
                   for point in points]
        # The same sweep file content resumes; another sweep (or command) is refused.
        # the disk asked for: the points a rerun still has to run
        out = output_folder(out, Path("runs") / f"sweep-{spec.name}", "sweep", overwrite=overwrite,
                            identity=spec.model_dump(mode="json"), resumable=True,
                            runs=lambda folder: [c for p, c in zip(points, configs, strict=True)
                                                 if overwrite or not is_finished(folder / p.name)])
    for warning in ineffective_parameters(spec, configs):
        err_console.print(f"[bold yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    failures: list[PointOutcome] = []
    with user_errors(out / "sweep.log"), progress_bar() as bar:
        task = bar.add_task(f"sweep {spec.name} ({len(points)} points)", total=len(points))

        def advance(outcome: PointOutcome) -> None:
            if outcome.status == "failed":
                failures.append(outcome)
            bar.advance(task)

        outcomes = run_sweep(spec, base, out, workers=workers, ray_address=ray, on_outcome=advance,
                             runner=run_and_report)
    table = sweep_table(spec, outcomes)
    with user_errors(out / "sweep.log"):
        md = write_sweep_report(spec.name, grid_columns(spec), table, out)
    console.print(sweep_rich(table, grid_columns(spec)))
    skipped = sum(o.status == "skipped" for o in outcomes)
    console.print(f"sweep: {out}/ ({len(outcomes) - skipped - len(failures)} run, {skipped} already done, "
                  f"{len(failures)} failed); report: {md}")
    print_engine_log([o.folder for o in outcomes if o.status != "skipped"])
    for failure in failures:
        err_console.print(f"[red]failed[/] {failure.point.name}: {failure.error}")
    if failures:
        raise typer.Exit(1)

