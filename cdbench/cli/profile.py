"""``cdbench profile``: the command-line face of :mod:`cdbench.profile.runner`.

The command's module; :mod:`cdbench.cli.app` registers it.
"""

from __future__ import annotations

from pathlib import Path

import typer


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def profile(
    backends: str = typer.Option("xgrammar,llguidance,outlines", help="Comma-separated backend names."),
    corpus: str = typer.Option(..., help="Corpus names (files of the shared corpora by stem, 'embedded') or JSONL paths, comma-separated."),
    out: Path = typer.Option(..., help="Output folder; rerunning with the same settings resumes there, other "
                                       "settings or another command's folder are refused."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start the --out folder afresh (refused unless "
                                                             "cdbench wrote it)."),
    vocab: str = typer.Option("qwen3.6", help="Vocabulary: deepseek-v4, qwen3.6 or cl100k."),
    limit: int | None = typer.Option(None, min=1, help="Items per corpus (the first ones in file order)."),
    seed: int = typer.Option(0, help="Seed of the oracle instances and mutations."),
    compile_timeout: float = typer.Option(60.0, min=0.001, help="Seconds before a compile is killed and recorded as timeout."),
    walk_timeout: float = typer.Option(600.0, min=0.001, help="Seconds an item's instance walks may take."),
    workers: int = typer.Option(1, min=1, help="Worker processes (each serves every backend)."),
    worker_memory: str | None = typer.Option(
        None, help="Memory each worker's engines may use, e.g. 8GB or 512MiB; an item past it is recorded as oom "
                   "(default: 80% of the memory available at the start, shared among the workers)."),
    valid_instances: int = typer.Option(1, min=0, help="Oracle instances walked per item."),
    invalid_instances: int = typer.Option(3, min=0, help="Mutated invalid instances checked per item."),
    plugin: list[str] = typer.Option([], help="Module, module:function or .py file registering extra backends (repeatable)."),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """Profile grammar backends side by side on real corpora: compile time, per-token mask time, coverage, correctness.

    Example: cdbench profile --backends xgrammar,llguidance,outlines --corpus jsonschemabench_github_easy,regex_from_json_schemas --vocab qwen3.6 --limit 50 --compile-timeout 30 --out reports/profile
    """
    from pydantic import ByteSize, TypeAdapter, ValidationError

    from cdbench.backends.measure_worker import load_plugin
    from cdbench.backends.registry import available_backends
    from cdbench.profile.runner import (
        ProfileConfig,
        ResumeMismatchError,
        check_resume,
        run_profile,
    )
    from cdbench.results.output_folder import FolderInUseError, claim_folder

    try:
        memory: dict[str, ByteSize] = {}  # left out: ProfileConfig's default
        if worker_memory is not None:
            try:
                memory["worker_memory"] = TypeAdapter(ByteSize).validate_python(worker_memory)
            except ValidationError:
                raise ValueError(f"--worker-memory {worker_memory!r} is not a size (e.g. 8GB, 512MiB)") from None
        for name in plugin:
            load_plugin(name)
        config = ProfileConfig(
            backends=_split(backends), corpora=_split(corpus), vocab=vocab, limit=limit, seed=seed,
            compile_timeout_s=compile_timeout, walk_timeout_s=walk_timeout, workers=workers,
            valid_instances=valid_instances, invalid_instances=invalid_instances, plugins=plugin,
            **memory,
        )
        unknown = [b for b in config.backends if b not in available_backends()]
        if unknown:
            raise ValueError(f"unknown backend(s) {', '.join(unknown)}; available: {', '.join(available_backends())}")
        if not overwrite:
            check_resume(config, out)  # first: its message names the settings that differ
        claim_folder(out, "profile", resumable=True, overwrite=overwrite)  # refuses other commands' folders
        run = run_profile(config, out, progress=progress)
    except (ValueError, KeyError, ValidationError, ResumeMismatchError, FileNotFoundError, FolderInUseError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    for line in run.skipped_lines:
        typer.echo(f"skipped: {line}", err=True)
    typer.echo(f"{run.results} results ({run.new_results} new) in {run.out_dir}; report: {run.out_dir / 'report.md'}")
    if run.out_of_memory:
        typer.echo(f"oom: {run.out_of_memory} item{'s' if run.out_of_memory != 1 else ''} ran out of the "
                   f"{config.worker_memory.human_readable(decimal=True)} worker memory cap (--worker-memory); "
                   "status oom in the report")
    if run.engine_log_lines:
        lines = f"{run.engine_log_lines} line{'s' if run.engine_log_lines != 1 else ''}"
        typer.echo(f"engine: {lines} the engines logged while compiling (listed per item in "
                   f"{run.out_dir / 'items.parquet'}, column warnings)")
