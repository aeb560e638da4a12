"""``cdbench run``: one configured run into a results folder, with a summary table.

The run options (``--backend``, ``--policy``, ...) are shared with ``cdbench
compare`` and live in :mod:`cdbench.cli.support`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cdbench.cli.support import (
    BackendOpt,
    ConfigArg,
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
    execute,
    load_run_tree,
    output_folder,
    print_engine_log,
    print_forward_speed,
    print_spec_costs,
    print_workload_issues,
    user_errors,
)
from cdbench.reports.tables import console_sections, to_rich
from cdbench.results.run_config import validate_run_config


def run_command(
    config: ConfigArg = None,
    backend: BackendOpt = None,
    policy: PolicyOpt = None,
    mode: ModeOpt = None,
    model: ModelOpt = None,
    gpu: GpuOpt = None,
    corpus: CorpusOpt = None,
    requests: RequestsOpt = None,
    rate: RateOpt = None,
    seed: SeedOpt = None,
    set_: SetOpt = [],  # noqa: B006 (typer reads the default, it is never mutated)
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Results folder (default runs/<timestamp>); "
                                                                     "refused if it holds results.")] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Run one simulation and write its results folder (config, parquet tables, summary, report, plots, trace).

    Options override the config file. With no arguments: the built-in default (hybrid mode, xgrammar,
    sglang policy, Qwen3-8B on an H100, the embedded sample workload).

    Example: cdbench run --backend llguidance --policy vllm --rate 20 --out runs/llg
    """
    options = dict(backend=backend, policy=policy, mode=mode, model=model, gpu=gpu, corpus=corpus,
                   requests=requests, rate=rate, seed=seed)
    with user_errors():
        tree, source = load_run_tree(config, options, set_)
        run_config = validate_run_config(tree, source)
        out = output_folder(out, default_out_dir(), "run", overwrite=overwrite, runs=[run_config])
    saved = execute(run_config, out)
    for section in console_sections(saved.summary):
        console.print(to_rich(section))
    print_workload_issues(saved)
    print_forward_speed(saved)
    print_spec_costs(saved)
    print_engine_log([out])
    console.print(f"results: {out}/  (report: {out / 'report.md'}, trace: {out / 'trace.json'} for ui.perfetto.dev)")
