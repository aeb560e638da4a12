"""``cdbench kernels``: the mask-kernel benchmark (:mod:`cdbench.kernels.bench`) from the command line."""

from __future__ import annotations

from pathlib import Path

import torch
import typer
from rich.progress import Progress

from cdbench.cli.support import OverwriteOpt, default_out_dir, output_folder, user_errors
from cdbench.kernels.bench import (
    DENSITIES,
    DTYPES,
    FULL_BATCHES,
    FULL_VOCABS,
    QUICK_BATCHES,
    QUICK_VOCABS,
    Case,
    KernelResult,
    build_variants,
    cpu_copy_gbs,
    environment,
    gpu_short_name,
    h2d_sizes,
    run_h2d,
    run_sweep,
)
from cdbench.kernels.bench_report import build_cost_table, results_frame, write_reports
from cdbench.kernels.cost_table import TABLE_DIR
from cdbench.kernels.timing import MiB, copy_bandwidth_gbs


def kernels_command(
    quick: bool = typer.Option(False, "--quick", help="tiny shapes (V=1000, B=1,4): a smoke test, runs on CPU"),
    vocab: list[int] = typer.Option(None, "--vocab", help="vocabulary sizes (repeatable)"),
    batch: list[int] = typer.Option(None, "--batch", help="batch sizes (repeatable)"),
    dtype: list[str] = typer.Option(None, "--dtype", help="fp32 / bf16 / fp16 (repeatable)"),
    density: list[str] = typer.Option(None, "--density", help="sparse / dense (repeatable)"),
    variant: list[str] = typer.Option(None, "--variant", help="variants to run (repeatable); default all but xgr-torch-compile"),
    out: Path | None = typer.Option(None, "--out", help="output folder (default: runs/kernels-<UTC time>)"),
    overwrite: OverwriteOpt = False,
    cost_table: str = typer.Option("", "--cost-table", help="write a MaskCostTable: a path, or 'auto' for cdbench/kernels/cost_tables/<gpu>.json.gz (a path ending .gz is gzipped)"),
    seed: int = typer.Option(0, "--seed"),
    graph_max_batch: int = typer.Option(8, "--graph-max-batch", help="also time CUDA-graph replays up to this batch"),
    rotate_mb: int = typer.Option(512, "--rotate-mb", help="rotate inputs until this many MiB of logits"),
    rep_ms: float = typer.Option(40, "--rep-ms", help="do_bench repeat time per measurement"),
    no_h2d: bool = typer.Option(False, "--no-h2d", help="skip the host-to-device copy measurements"),
) -> None:
    """Benchmark the mask kernels against xgrammar, torch and the byte floor. Example: cdbench kernels --quick"""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, values, allowed_values in (("dtype", dtype, DTYPES), ("density", density, DENSITIES)):
        bad = sorted(set(values or []) - set(allowed_values))
        if bad:
            raise typer.BadParameter(f"unknown {name} {', '.join(bad)}; choose from {', '.join(allowed_values)}")
    if cost_table and device != "cuda":
        raise typer.BadParameter("--cost-table needs GPU measurements; this run had no CUDA device")
    vocabs = vocab or (QUICK_VOCABS if quick else FULL_VOCABS)
    batches = batch or (QUICK_BATCHES if quick else FULL_BATCHES)
    cases = [Case(v, b, d, m) for m in (density or DENSITIES) for v in vocabs for d in (dtype or ("fp32", "bf16"))
             for b in batches]
    try:
        variants, notes = build_variants(device, variant)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if device == "cpu":
        variants = [v for v in variants if v.name in ("copy", "naive", "cdbench", "cdbench-argmax", "xgr-cpu")]
        notes.append("no CUDA device: CPU wall-clock timings of the CPU paths (torch reference, xgrammar CPU); "
                     "GPU kernel timing needs CUDA")
        typer.echo("No CUDA device: timing needs CUDA; timing the CPU paths (torch reference, xgrammar CPU) instead.")
    with user_errors():  # a folder holding earlier results is not written into unasked
        out = output_folder(out, default_out_dir("kernels-"), "kernels", overwrite=overwrite)
    copy_gbs = copy_bandwidth_gbs() if device == "cuda" else cpu_copy_gbs()

    def checkpoint(so_far: list[KernelResult]) -> None:  # a killed run still leaves its measurements
        results_frame(so_far).to_csv(out / "results.csv", index=False)

    with Progress() as bar:
        task = bar.add_task("kernels", total=len(cases))

        started = []

        def advance(label: str) -> None:
            bar.update(task, advance=1 if started else 0, description=label)
            started.append(label)

        results = run_sweep(cases, variants, device, seed, graph_max_batch, rotate_mb * MiB, rep_ms=rep_ms,
                            copy_gbs=copy_gbs, progress=advance, on_case=checkpoint)
        bar.update(task, completed=len(cases), description="done")
    copies = run_h2d(h2d_sizes(vocabs, batches)) if device == "cuda" and not no_h2d else []
    env = environment(device, seed, copy_gbs, notes)
    summary = write_reports(results, copies, env, out)
    typer.echo(summary)
    if cost_table:
        table = build_cost_table(results, copies, env, gpu_short_name(torch.cuda.get_device_name(0)))
        path = Path(cost_table) if cost_table != "auto" else None
        path = path or TABLE_DIR / f"{table.gpu}.json.gz"
        table.save(path)
        typer.echo(f"cost table: {path}")
