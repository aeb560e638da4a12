"""``cdbench compare``: the same workload across backends or policies, or saved runs, side by side."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cdbench.cli.support import (
    BackendOpt,
    CorpusOpt,
    GpuOpt,
    ModelOpt,
    ModeOpt,
    OverwriteOpt,
    PolicyOpt,
    RateOpt,
    RequestsOpt,
    SeedOpt,
    SetOpt,
    console,
    default_out_dir,
    err_console,
    execute,
    load_run_tree,
    option_overrides,
    output_folder,
    print_engine_log,
    user_errors,
)
from cdbench.reports.compare import (
    comparison_rich,
    comparison_table,
    label_runs,
    write_comparison,
)
from cdbench.results.config_files import ConfigError, apply_overrides
from cdbench.results.pack import open_run
from cdbench.results.run_config import validate_run_config
from cdbench.results.run_folder import SavedRun

if TYPE_CHECKING:
    from cdbench.harness.config import RunConfig


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


def compare(
    run_dirs: Annotated[list[str] | None, typer.Argument(
        help="Saved run folders or PACK::RUN_ID refs (cdbench pack) to compare (instead of running).")] = None,
    backends: Annotated[str | None, typer.Option("--backends", help="Comma-separated backends to run.")] = None,
    policies: Annotated[str | None, typer.Option("--policies", help="Comma-separated policies to run.")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Run-config YAML (default: built-in).")] = None,
    backend: BackendOpt = None,
    policy: PolicyOpt = None,
    mode: ModeOpt = None,
    model: ModelOpt = None,
    gpu: GpuOpt = None,
    corpus: CorpusOpt = None,
    requests: RequestsOpt = None,
    rate: RateOpt = None,
    seed: SeedOpt = None,
    set_: SetOpt = [],  # noqa: B006
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Folder for the runs and comparison.md "
                                                                     "(default runs/compare-<timestamp>).")] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Put runs side by side: each metric per run and its ratio to the first, plus overlaid TTFT/TPOT CDFs.

    Either run the same workload (same config, same seed, same requests) once per backend and/or policy,
    or compare run folders that already exist.

    Examples:
      cdbench compare --backends xgrammar,llguidance,outlines --mode model --requests 500
      cdbench compare --policies sglang,vllm --rate 30
      cdbench compare runs/a runs/b
      cdbench compare campaign.pack::cell/hybrid-a campaign.pack::cell/model
    """
    with user_errors():
        backend_list, policy_list = _split(backends), _split(policies)
        if run_dirs and (backend_list or policy_list):
            raise ConfigError("give either run folders or --backends/--policies, not both")
        if not run_dirs and not (backend_list or policy_list):
            raise ConfigError("nothing to compare: give run folders, --backends a,b or --policies a,b")
        runs: dict[str, SavedRun] = {}
        if run_dirs:
            runs = label_runs([open_run(ref) for ref in run_dirs])
        else:
            options = dict(backend=backend, policy=policy, mode=mode, model=model, gpu=gpu, corpus=corpus,
                           requests=requests, rate=rate, seed=seed)
            base, source = load_run_tree(config, options, set_)
            # Every combination is validated before any runs, so a typo in the last one fails in a second.
            configs: dict[str, RunConfig] = {}
            for b in backend_list or [None]:
                for p in policy_list or [None]:
                    label = "-".join(x for x in (b, p) if x)
                    if label in configs:
                        raise ConfigError(f"{label!r} is listed twice in --backends/--policies")
                    tree = apply_overrides(base, option_overrides({"backend": b, "policy": p}))
                    configs[label] = validate_run_config(tree, f"{source} ({label})")
        if out is not None and overwrite and any(out.resolve() in (run.folder.resolve(), *run.folder.resolve().parents)
                                                 for run in runs.values()):
            raise ConfigError(f"--out {out} holds a run being compared; --overwrite would delete it")
        out = output_folder(out, default_out_dir("compare-"), "compare", overwrite=overwrite,
                            runs=list(configs.values()) if not run_dirs else [])
    if not run_dirs:
        for label, run_config in configs.items():
            runs[label] = execute(run_config, out / label, label=label)
    with user_errors(out / "compare.log"), err_console.status("writing the comparison and its plots"):
        md = write_comparison(runs, out)
    table = comparison_table({label: run.summary for label, run in runs.items()})
    console.print(comparison_rich(table, len(runs)))
    for label, run in runs.items():  # where each model run's spec prices came from (nothing for other modes)
        coverage = run.spec_costs
        if coverage is not None:
            first, *rest = coverage.lines()
            for line in [first, *(line for line in rest if line.startswith("warning"))]:
                console.print(f"{label}: {line}", highlight=False)
    console.print(f"comparison: {md}  (plots in {out / 'plots'})")
    if not run_dirs:
        print_engine_log([run.folder for run in runs.values()])
