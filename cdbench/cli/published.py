"""``cdbench published``: the engines' published A/B results beside cdbench's prediction of each."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cdbench.cli.support import SetOpt, console, parse_set_options, progress_bar, user_errors

app = typer.Typer(help="Published A/B results on structured outputs, each predicted by cdbench "
                  "(reports/published/README.md).", no_args_is_help=True)

RegistryOpt = Annotated[Path | None, typer.Option(
    "--registry", help="Registry YAML (default: the shipped cdbench/published/registry.yaml).")]
ScaleOpt = Annotated[str, typer.Option("--scale", help="full (the source's request counts) or small "
                                       "(each entry's small_requests, for a quick check).")]


def _check_scale(scale: str) -> None:
    from cdbench.published.registry import RegistryError

    if scale not in ("full", "small"):
        raise RegistryError(f"--scale {scale!r}: choose full or small")


@app.command("list")
def list_entries(registry: RegistryOpt = None) -> None:
    """List the registry's entries. Example: cdbench published list"""
    from cdbench.published.registry import load_registry

    with user_errors():
        reg = load_registry(registry)
    for e in reg.entries:
        effect = e.published.effect * 100
        console.print(f"{e.id}: {e.title} ({e.published.metric} {effect:+.1f} %, {e.source.url})",
                      highlight=False, soft_wrap=True)


@app.command("run")
def run_published(
    entry: Annotated[list[str] | None, typer.Option("--entry", "-e", help="Entry id to run (repeatable; default: all).")] = None,
    scale: ScaleOpt = "full",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Folder for results.csv, table.md and "
                                             "effects.png.")] = None,
    registry: RegistryOpt = None,
) -> None:
    """Run both arms of each entry in model mode and print cdbench's effect beside the published one.

    Example: cdbench published run --entry vllm-24300 --scale small
    """
    from cdbench.published.registry import load_registry
    from cdbench.published.report import rich_table, write_results
    from cdbench.published.runner import run_registry

    with user_errors():
        _check_scale(scale)
        reg = load_registry(registry)
        ids = list(entry) if entry else None
        count = len(ids) if ids else len(reg.entries)
        with progress_bar(transient=True) as bar:
            task = bar.add_task("published entries", total=count)

            def step(entry_id: str) -> None:
                bar.update(task, description=f"running {entry_id}", advance=0)

            results = run_registry(reg, ids, scale, progress=step,
                                   done=lambda: bar.advance(task))  # type: ignore[arg-type]
    console.print(rich_table(results))
    for r in results:
        if r.reason:
            console.print(f"{r.id} ({r.verdict}): {r.reason}", highlight=False, soft_wrap=True)
    if out is not None:
        for path in write_results(results, out):
            console.print(f"wrote {path}", highlight=False)


@app.command("sweep")
def sweep_published(
    key: Annotated[str, typer.Argument(help="Config path to sweep in both arms, "
                                           "e.g. costs.fixed_grammar.fill_time_s.")],
    values: Annotated[list[str], typer.Argument(help="Its values (parsed as YAML).")],
    entry: Annotated[list[str], typer.Option("--entry", "-e", help="Entry id or shell pattern, e.g. 'vllm-26866-*' "
                                             "(repeatable).")],
    sets: SetOpt = [],  # noqa: B006 (typer's list option)
    scale: ScaleOpt = "full",
    csv: Annotated[Path | None, typer.Option("--csv", help="Write every entry's result at every value here.")] = None,
    registry: RegistryOpt = None,
) -> None:
    """Run the entries with KEY set to each value in both arms (over --set values): whether one value of an input
    the source leaves unstated reproduces them together. Prints a Markdown table, a row a value.

    Example: cdbench published sweep costs.gpu a100-80gb h100-sxm h200 --entry vllm-24300
    """
    import yaml

    from cdbench.published.registry import load_registry
    from cdbench.published.report import sweep_frame, sweep_markdown
    from cdbench.published.runner import sweep_registry

    with user_errors():
        _check_scale(scale)
        reg = load_registry(registry)
        fixed = parse_set_options(sets)
        parsed = [yaml.safe_load(v) for v in values]
        with progress_bar(transient=True) as bar:
            task = bar.add_task("values", total=len(parsed))
            points = sweep_registry(reg, entry, key, parsed, fixed, scale,  # type: ignore[arg-type]
                                    progress=lambda v: bar.update(task, description=f"{key}={v}", advance=1))
    console.print(sweep_markdown(points, key), highlight=False, soft_wrap=True, markup=False)
    if csv is not None:
        csv.parent.mkdir(parents=True, exist_ok=True)
        sweep_frame(points, key).to_csv(csv, index=False, float_format="%.6g")
        console.print(f"wrote {csv}", highlight=False)
