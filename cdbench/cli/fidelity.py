"""``cdbench fidelity``: how far runs sit from a reference run of the same workload (exit 1 beyond the bar)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cdbench.cli.support import (
    OverwriteOpt,
    console,
    default_out_dir,
    err_console,
    output_folder,
    user_errors,
)
from cdbench.reports.compare import label_runs
from cdbench.reports.fidelity import (
    ACCEPTANCE_TOLERANCES,
    FidelityError,
    check_same_workload,
    evaluate_fidelity,
    fidelity_rich,
    paired_intervals,
    verdict_line,
    write_fidelity,
)
from cdbench.reports.gate import parse_tolerances
from cdbench.results.pack import open_run
from cdbench.results.run_folder import SavedRun


def _noise_runs(refs: list[str], runs: dict[str, SavedRun]) -> dict[str, SavedRun]:
    """The noise runs by label, in the order given; a run that is also a compared run keeps that run's label."""
    opened = [open_run(ref, stopped_ok=False) for ref in refs]
    seen: dict[Path, str] = {}
    for ref, run in zip(refs, opened, strict=True):
        key = run.folder.resolve()  # a packed run's folder is its pack joined with its id: one per run
        if key in seen:
            also = "" if seen[key] == ref else f" (also as {seen[key]})"
            raise FidelityError(f"--noise/--noise-run name {ref} twice{also}; give each same-seed run once")
        seen[key] = ref
    known = {run.folder.resolve(): label for label, run in runs.items()}
    noise: dict[str, SavedRun] = {}
    for ref, run in zip(refs, opened, strict=True):
        label = known.get(run.folder.resolve()) or next(
            name for name in (f"noise {run.label}", f"noise {run.label} ({ref})") if name not in noise)
        noise[label] = run
    return noise


_DEFAULT_BAR = ", ".join(f"{m}={p:g}" for m, p in ACCEPTANCE_TOLERANCES.items())


def fidelity(
    run_dirs: Annotated[list[str], typer.Argument(help="Run folders or PACK::RUN_ID refs (cdbench pack): the reference first (e.g. hybrid), then the runs to check (e.g. model).")],
    noise: Annotated[tuple[str, str] | None, typer.Option(
        "--noise", help="Two same-seed reference-mode runs X Y (e.g. hybrid A and B): their spread is the noise floor; --noise-run adds more.")] = None,
    noise_run: Annotated[list[str], typer.Option(
        "--noise-run", help="One more same-seed run for the noise set given by --noise; repeatable. The noise floor "
                            "becomes the largest |relative error| of any noise run against the first --noise run.")] = [],  # noqa: B006
    tolerance: Annotated[list[str], typer.Option(
        "--tolerance", "-t", help=f"METRIC=PCT: allowed |relative error|; repeatable; adds to or overrides the default bar ({_DEFAULT_BAR}).")] = [],  # noqa: B006
    allow_different_workloads: Annotated[bool, typer.Option(
        "--allow-different-workloads", help="Compare runs even when their workloads (requests) differ.")] = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Folder for fidelity.md, fidelity.csv and plots/.")] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Relative error of each run against the first, per metric (latency medians/p90/p99, throughput, grammar wait,
    compile, mask share), beside the noise floor of two or more same-seed runs.

    The noise floor of a metric is the largest |relative error| of any noise run (--noise Y, each --noise-run)
    against the first --noise run X. A checked figure passes when |error| <= max(tolerance, noise). Exits 1
    when one does not, 2 on bad input (a missing or repeated run folder, a run that stopped early, runs of
    different workloads).
    A run is a folder or a run in a pack (PACK::RUN_ID); a run that kept only its summary is compared
    but not drawn.

    Examples:
      cdbench fidelity runs/hybrid-a runs/model --noise runs/hybrid-a runs/hybrid-b
      cdbench fidelity runs/hybrid-a runs/model --noise runs/hybrid-a runs/hybrid-b --noise-run runs/hybrid-c
      cdbench fidelity runs/hybrid runs/model -t median_ttft_ms=15 -t p99_ttft_ms=25 --out runs/fid
      cdbench fidelity camp.pack::cell/hybrid-a camp.pack::cell/model --noise camp.pack::cell/hybrid-a camp.pack::cell/hybrid-b
    """
    with user_errors():
        tolerances = {**ACCEPTANCE_TOLERANCES, **parse_tolerances(tolerance)}
        if len(run_dirs) < 2:
            raise FidelityError("fidelity needs at least two run folders: the reference first, then the runs to check")
        runs = label_runs([open_run(ref, stopped_ok=False) for ref in run_dirs])
        if noise_run and noise is None:
            raise FidelityError("--noise-run adds to the noise set of --noise; give --noise X Y as well")
        noise_runs = _noise_runs([*noise, *noise_run], runs) if noise is not None else {}
        if not allow_different_workloads:
            check_same_workload({**runs, **noise_runs})
        out = output_folder(out, default_out_dir("fidelity-"), "fidelity", overwrite=overwrite)
        noise_summaries = [run.summary for run in noise_runs.values()] if noise_runs else None
        result = evaluate_fidelity({label: run.summary for label, run in runs.items()}, noise_summaries, tolerances,
                                   tuple(noise_runs) if noise_runs else None,
                                   paired_intervals(runs))
    with user_errors(out / "fidelity.log"), err_console.status("writing the fidelity report and its plots"):
        md = write_fidelity(runs, result, out, noise_runs)
    console.print(fidelity_rich(result))
    console.print(f"fidelity: {md}  (table in {out / 'fidelity.csv'}, plots in {out / 'plots'})")
    if result.passed:
        console.print(f"[green]fidelity passed[/]: {verdict_line(result)}")
        return
    err_console.print(f"[bold red]fidelity failed[/]: {verdict_line(result)}")
    raise typer.Exit(1)
