"""``cdbench measure-specs``: the command-line face of :mod:`cdbench.profile.fill_store`."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from cdbench.cli.support import console, err_console, progress_bar, user_errors


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def measure_specs(
    corpus: Annotated[str, typer.Option(
        help="Corpus names (files of the shared corpora by stem, 'embedded') or JSONL paths, comma-separated.")],
    backend: Annotated[str, typer.Option(help="Grammar backends, comma-separated.")] = "xgrammar",
    vocab: Annotated[str, typer.Option(help="Vocabulary: deepseek-v4, qwen3.6 or cl100k.")] = "qwen3.6",
    limit: Annotated[int | None, typer.Option(min=1, help="Items per corpus (the first ones in file order).")] = None,
    instances: Annotated[int, typer.Option(
        min=0, help="Oracle texts walked per spec (0: compile only).")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the oracle texts.")] = 0,
    store: Annotated[Path | None, typer.Option(
        help="Spec-cost store folder (default: <cache>/spec_costs, where model runs look).")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Worker processes measuring at once.")] = 1,
    compile_timeout: Annotated[float, typer.Option(
        min=0.001, help="Seconds before a compile is killed and the spec recorded as timeout.")] = 60.0,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Measure the specs of corpora into the spec-cost store, as model mode would on demand, without a run.

    Specs the store already holds for this host are skipped, so a rerun measures only what is new.

    Example: cdbench measure-specs --corpus regex_from_json_schemas,jsonschemabench_github_easy --backend xgrammar,llguidance --vocab qwen3.6 --limit 40 --store .cache/spec_store_dev
    """
    from cdbench._env import cache_dir
    from cdbench.profile.fill_store import fill_store

    folder = store if store is not None else cache_dir() / "spec_costs"
    with user_errors(), (progress_bar(transient=True) if progress else nullcontext()) as bar:
        task = bar.add_task("loading corpora", total=100) if bar is not None else None

        def show(stage: str, fraction: float) -> None:
            bar.update(task, description=stage, completed=100 * fraction)

        report = fill_store(_split(corpus), _split(backend), vocab, folder, limit=limit, instances=instances,
                            seed=seed, workers=workers, compile_timeout_s=compile_timeout,
                            progress=show if bar is not None else None)
    for line in report.skipped_lines:
        err_console.print(f"skipped: {line}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"{report.items} corpus items; store {folder} (host {report.host.id}, {report.host.name})",
                  highlight=False, markup=False, soft_wrap=True)
    if report.without_texts:
        label, reason = next(iter(report.without_texts.items()))
        console.print(f"{len(report.without_texts)} specs without an oracle text were compiled only "
                      f"(e.g. {label}: {reason[:160]})", highlight=False, markup=False, soft_wrap=True)
    for fill in report.backends:
        statuses = ", ".join(f"{status} {n}" for status, n in fill.statuses.items())
        console.print(f"{fill.backend} {fill.version}: {fill.specs} specs, {fill.held} skipped (already stored for "
                      f"this host), {fill.measured} measured in {fill.wall_s:.1f} s" + (f": {statuses}" if statuses
                                                                                          else ""),
                      highlight=False, markup=False, soft_wrap=True)
        if fill.impossible is not None:
            err_console.print(f"[yellow]{fill.backend}: cannot measure here:[/] {escape(fill.impossible[:300])}",
                              highlight=False, soft_wrap=True)
    if any(fill.impossible is not None for fill in report.backends):
        raise typer.Exit(1)
