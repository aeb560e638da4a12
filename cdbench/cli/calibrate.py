"""``cdbench calibrate``: time the live forward on a GPU over a grid of step shapes, fit the forward model.

Measuring needs CUDA; fitting stored measurements (``--measurements``) runs
anywhere. ``--probe`` fits nothing: it times a few of a calibration's shapes on
this host (``--tp``: on that many rank processes, against a tensor-parallel calibration) and writes the host's
forward speed against the calibration's. The module runs on its own too (``python -m cdbench.cli.calibrate``,
same options) so a GPU host needs only torch, scipy, pydantic and typer.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from cdbench.harness.costs.calibration import (
    CalibrationError,
    ForwardCalibration,
    ForwardMeasurement,
    read_measurements,
    shape_label,
    shipped_calibration_path,
    write_measurements,
)
from cdbench.harness.costs.calibration_fit import fit_calibration, holdout_errors, roofline_errors
from cdbench.harness.costs.forward_speed import (
    MIN_PROBE_SHAPES,
    PROBE_PREFIX,
    ForwardProbe,
    ForwardSpeedError,
)
from cdbench.harness.costs.hardware import SpecFileError, UnknownSpecError, resolve_gpu, resolve_model


def calibrate(
    model: Annotated[str, typer.Option("--model", help="built-in model name or a model spec file")],
    gpu_name: Annotated[str, typer.Option("--gpu-name", help="the GPU spec the fit is for (h100-sxm, h200, ...)")],
    out: Annotated[Path | None, typer.Option("--out", help="calibration JSON to write; 'auto': the shipped "
                                             "location (not with --probe)")] = None,
    measurements: Annotated[Path | None, typer.Option(
        "--measurements", help="fit this measurement CSV instead of measuring")] = None,
    measure_out: Annotated[Path | None, typer.Option(
        "--measure-out", help="where the measured CSV goes (default: --out with .csv)")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="also write the fit table as markdown")] = None,
    grid: Annotated[str, typer.Option("--grid", help="default; chunks or few_rows (the default grid's "
                                      "several-chunk steps, or its mixed steps of a few decode rows, only: to add "
                                      "to an earlier measurement); draft (the MTP head's draft shapes only, which "
                                      "the default grid adds for a model with an MTP head: measured, not fitted); "
                                      "or tiny (a few small shapes: a CPU smoke test)")] = "default",
    device: Annotated[str, typer.Option("--device", help="torch device to measure on")] = "cuda",
    decode_attention: Annotated[str, typer.Option(
        "--decode-attention", help="per_row: each decode row attends to its own length through the kernel "
        "live mode runs; dense: masked attention over the longest row")] = "per_row",
    tp: Annotated[int, typer.Option("--tp", min=1, help="tensor-parallel ranks, one process and GPU each (NCCL; "
                                    "gloo on the CPU): the sharded forward live mode's TP ranks run")] = 1,
    linear_kernels: Annotated[str, typer.Option(
        "--linear-kernels", help="a hybrid model's Gated DeltaNet kernels: auto (flash-linear-attention's where it "
        "imports on a GPU, else torch's), torch or fla")] = "auto",
    all_reduce: Annotated[list[str] | None, typer.Option(
        "--all-reduce", help="a live tensor-parallel run (folder or PACK::RUN, repeatable): its measured "
        "all-reduce's per-row time (live.json) prices the all-reduces' bandwidth, the median over the runs; "
        "without it the fit solves it")] = None,
    holdout: Annotated[int, typer.Option(
        "--holdout", min=0, help="also fit on all but every K-th shape, K times, and report the held-out "
        "shapes' errors (0: no)")] = 0,
    probe: Annotated[Path | None, typer.Option(
        "--probe", help="fit nothing: time a few of the calibration's own shapes on this host (with --tp, on that "
        "many rank processes) and write this host's forward speed against the calibration's host here "
        "(costs.forward_speed=probe:<file>)")] = None,
    calibration: Annotated[Path | None, typer.Option(
        "--calibration", help="with --probe: the calibration to probe (default: the one shipped for the model, "
        "GPU and --tp)")] = None,
    probe_shapes: Annotated[int, typer.Option("--probe-shapes", min=MIN_PROBE_SHAPES,
                                              help="with --probe: how many of its shapes to time")] = 16,
    idle_s: Annotated[float, typer.Option(
        "--idle-s", min=0.0, help="launch each repetition after this long with the GPU idle, timed from its launch "
        "(0: back to back). Back to back, a compute-bound step holds the GPU at its power cap and its clocks drop, "
        "which a serving loop's steps, between host work and lighter decode steps, do not (with --tp, on every "
        "rank; a probe times as its calibration did)")] = 0.0,
    write_contexts: Annotated[bool, typer.Option(
        "--write-contexts", help="before timing a shape, write its decode rows' contexts and its chunks' cached "
        "prefixes with prefill steps, as a live request's prefill has (one GPU; a MoE routes rows over written "
        "contexts to fewer experts); otherwise they are unwritten")] = False,
) -> None:
    """Fit the forward cost model to live forward steps: every shape's fit error is printed.

    Examples:
      cdbench calibrate --model llama-3.1-8b --gpu-name h100-sxm --out auto
      cdbench calibrate --model qwen3-8b --gpu-name h200 --out auto --measurements reports/calibration/qwen3-8b__h200.csv
      cdbench calibrate --model qwen3-8b --gpu-name h200 --tp 2 --out auto
      cdbench calibrate --model qwen3-8b --gpu-name h200 --out auto --measurements reports/calibration/qwen3-8b__h200__tp2.csv --all-reduce runs/tp2-live --holdout 4
      cdbench calibrate --model qwen3-8b --gpu-name h100-sxm --out auto --idle-s 0.02
      cdbench calibrate --model qwen3-8b --gpu-name h100-sxm --probe probe.json   (then --set costs.forward_speed=probe:probe.json)
      cdbench calibrate --model qwen3-8b --gpu-name h200 --tp 2 --probe probe_tp2.json   (prices costs.tp=2 runs)
      cdbench calibrate --model qwen3.5-35b-a3b --gpu-name h200 --grid draft --out draft.json   (the MTP head's
        draft shapes only: writes draft.csv, fits nothing)
    """
    args = sys.argv[1:]
    command = shlex.join(["cdbench", *(args if args[:1] == ["calibrate"] else ["calibrate", *args])])
    if probe is not None:
        return _probe(model, gpu_name, calibration, device, probe, probe_shapes, linear_kernels, tp, idle_s)
    if out is None:
        typer.echo("error: --out is required (the calibration JSON to write), unless --probe", err=True)
        raise typer.Exit(2)
    try:
        spec, gpu = resolve_model(model), resolve_gpu(gpu_name)
        if measurements is None:
            target = shipped_calibration_path(spec.name, gpu.name, tp) if str(out) == "auto" else out
            csv_path = measure_out or target.with_suffix(".csv")
            rows = _measure(spec, grid, device, decode_attention, tp, linear_kernels, idle_s, write_contexts)
            write_measurements(rows, csv_path)
            typer.echo(f"measurements: {csv_path}")
            if all(r.mtp_drafts for r in rows):
                typer.echo("draft shapes only: nothing fitted (the draft term is fitted beside step shapes: "
                           "the default grid measures both)")
                return
        else:
            csv_path, rows = measurements, read_measurements(measurements)
            target = shipped_calibration_path(spec.name, gpu.name, rows[0].tp) if str(out) == "auto" else out
        options = {} if not all_reduce else {"all_reduce_token_s": measured_all_reduce(all_reduce),
                                             "all_reduce_runs": all_reduce}
        cal = fit_calibration(rows, spec, gpu, measurements=str(csv_path), command=command, **options)
        held = holdout_errors(rows, spec, gpu, holdout, **options) if holdout else None
    except (CalibrationError, UnknownSpecError, SpecFileError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    cal.save(target)
    table = fit_table(cal, roofline_errors(rows, spec, gpu), held)
    typer.echo(table)
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(table, encoding="utf-8")
        typer.echo(f"fit table: {report}")
    typer.echo(f"calibration: {target}")


def _probe(model: str, gpu_name: str, calibration: Path | None, device: str, out: Path, shapes: int,
           linear_kernels: str, tp: int, idle_s: float) -> None:
    """``--probe``: time ``shapes`` of the calibration's own shapes (evenly over its list) as it timed them
    (``tp`` > 1: on that many tensor-parallel rank processes, as ``--tp`` measures; after its idle gap),
    each over its host's time, and write the :class:`ForwardProbe` to ``out``."""
    try:
        spec, gpu = resolve_model(model), resolve_gpu(gpu_name)
        path = calibration or shipped_calibration_path(spec.name, gpu.name, tp)
        cal = ForwardCalibration.load(path)
        if (cal.model, cal.gpu, cal.tp) != (spec.name, gpu.name, tp):
            raise ValueError(f"--calibration {path} is for {cal.model} on {cal.gpu} at tp={cal.tp}; the probe "
                             f"times {spec.name} on {gpu.name} at tp={tp}")
        if idle_s and idle_s != cal.idle_s:
            raise ValueError(f"--idle-s {idle_s:g}: {path} was measured with {cal.idle_s:g} s before each "
                             "repetition, and its probe times its shapes so (leave --idle-s out)")
        from cdbench.harness.live.measure import GRIDS, measure_grid, measure_grid_tp

        # steps only: the forward speed is the steps' (the head's draft shapes are not probed)
        known = {shape_label(s.rows, s.kv, s.chunks, s.new, s.cached): s for grid in GRIDS.values() for s in grid()
                 if not s.drafts}
        ours = [known[f.shape] for f in cal.fit if f.shape in known]
        if len(ours) < MIN_PROBE_SHAPES:
            raise ValueError(f"{path}: {len(ours)} of its shapes are on a measuring grid; a probe needs "
                             f"{MIN_PROBE_SHAPES}")
        picked = ours[::-(-len(ours) // shapes)]
        typer.echo(f"probing {spec.name} on {device}: {len(picked)} of {path}'s {len(cal.fit)} shapes"
                   + (f", {tp} tensor-parallel ranks" if tp > 1 else ""))
        smoke = not device.startswith("cuda")  # a CPU probe (tests) times a few repetitions only
        per_row = cal.decode_attention == "per_row"
        if tp > 1:  # as --tp measured: each rank the same number of repetitions, in step
            rows = measure_grid_tp(spec, picked, tp, device, min_reps=3 if smoke else 20, per_row=per_row,
                                   idle_s=cal.idle_s)
        else:
            rows = measure_grid(spec, picked, device, min_reps=3 if smoke else 10, min_time_s=0.0 if smoke else 0.25,
                                per_row=per_row, linear_kernels=linear_kernels, idle_s=cal.idle_s,
                                write_contexts=cal.contexts_written)  # (a probe times as its calibration did)
        result = ForwardProbe.of(cal, str(path), rows, out)
    except (CalibrationError, ForwardSpeedError, UnknownSpecError, SpecFileError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result.model_dump_json(indent=1) + "\n", encoding="utf-8")
    for shape, ratio in zip(result.shapes, result.ratios, strict=True):
        typer.echo(f"  {shape:<32} {ratio:7.3f} x the calibration host's")
    typer.echo(f"forward speed: {result.speed.describe()}")
    typer.echo(f"probe: {out}  (--set costs.forward_speed={PROBE_PREFIX}{out})")


def _measure(spec, grid: str, device: str, decode_attention: str, tp: int, linear_kernels: str = "auto",
             idle_s: float = 0.0, write_contexts: bool = False) -> list[ForwardMeasurement]:
    # Imported here: measuring needs torch on a GPU, fitting stored measurements does not.
    from cdbench.harness.live.measure import grid_shapes, measure_grid, measure_grid_tp

    shapes = grid_shapes(grid, spec, tp)
    if decode_attention not in ("per_row", "dense"):
        raise ValueError(f"--decode-attention {decode_attention!r}: choose per_row or dense")
    if write_contexts and tp > 1:
        raise ValueError("--write-contexts is built for one GPU: the ranks' grid writes no contexts")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError("measuring on 'cuda' needs a CUDA device; fit stored ones with --measurements")

    def show(row: ForwardMeasurement) -> None:
        typer.echo(f"  {row.label:<32} {row.median_s * 1e3:9.3f} ms  ({row.reps} reps{', graph' if row.graph else ''})")

    typer.echo(f"measuring {spec.name} on {device}: {len(shapes)} shapes" + (f", {tp} tensor-parallel ranks" if tp > 1 else ""))
    if tp > 1:
        rows = measure_grid_tp(spec, shapes, tp, device, min_reps=3 if grid == "tiny" else 20,
                               per_row=decode_attention == "per_row", idle_s=idle_s)
        for row in rows:
            show(row)
        return rows
    drafts = sum(1 for s in shapes if s.drafts)
    if drafts:
        typer.echo(f"  ({drafts} of them the MTP head's draft shapes)")
    return measure_grid(spec, shapes, device, progress=show, min_reps=3 if grid == "tiny" else 10,
                        min_time_s=0.0 if grid == "tiny" else 0.25, per_row=decode_attention == "per_row",
                        linear_kernels=linear_kernels, idle_s=idle_s, write_contexts=write_contexts)


def measured_all_reduce(runs: list[str]) -> float:
    """The median over ``runs`` (live tensor-parallel runs, folders or ``PACK::RUN``) of their all-reduce's
    measured per-row time (:attr:`~cdbench.harness.live.rank_info.RanksInfo.all_reduce_token_s`)."""
    # imported here: fitting on a GPU host needs neither the results readers nor the rank code
    from cdbench.harness.live.ranks import ranks_info_of
    from cdbench.results.errors import ResultsError
    from cdbench.results.pack import open_run

    slopes = []
    for ref in runs:
        try:
            text = open_run(ref).read_file("live.json")
        except ResultsError as exc:
            raise ValueError(f"--all-reduce {ref}: {exc}") from exc
        if text is None:
            raise ValueError(f"--all-reduce {ref}: not a live run (no live.json)")
        slope = ranks_info_of(text, ref).all_reduce_token_s
        if slope is None:
            raise ValueError(f"--all-reduce {ref}: its live.json times the all-reduce at fewer than two sizes")
        slopes.append(slope)
    return float(np.median(slopes))


def fit_table(cal: ForwardCalibration, roofline: np.ndarray, held: np.ndarray | None = None) -> str:
    """The fit as markdown: parameters, then each shape's measured and fitted time and the roofline's error
    (and each shape's error when held out of the fit, ``held``); the MTP head's draft shapes, where measured,
    summed up apart from the steps."""
    draft = np.asarray([s.is_draft for s in cal.fit])

    def summary(what: str, picked: np.ndarray) -> list[str]:
        fit = np.asarray([abs(s.error) for s in cal.fit])[picked]
        lines = [f"{what} over {int(picked.sum())} shapes: max |error| {fit.max():.1%}, median {np.median(fit):.1%} "
                 f"(uncalibrated roofline: max {np.max(np.abs(roofline[picked])):.1%}, "
                 f"median {np.median(np.abs(roofline[picked])):.1%}).", ""]
        if held is not None:
            lines += [f"Held out (fitted on the other shapes, {int(picked.sum())} shapes in turn): max |error| "
                      f"{np.max(np.abs(held[picked])):.1%}, median {np.median(np.abs(held[picked])):.1%}.", ""]
        return lines

    measured = [] if not cal.all_reduce_runs else [
        f"all_reduce_token_s measured (median per-row slope of the all-reduce, live.json): "
        f"{', '.join(f'`{r}`' for r in cal.all_reduce_runs)}.", ""]
    drafted = [] if not draft.any() else summary("The MTP head's draft term (each pass mtp_pass_s + "
                                                 "mtp_roof_scale x its roofline price)", draft)
    lines = [
        f"# Forward calibration: {cal.model} on {cal.gpu}{f' at tp={cal.tp}' if cal.tp > 1 else ''} "
        f"({cal.gpu_device}, torch {cal.torch_version})",
        "",
        f"Command: `{cal.command}`  ",
        f"Measurements: `{cal.measurements}`",
        "",
        *summary("Fit" if not draft.any() else "Step fit", ~draft),
        *drafted,
        *measured,
        "| parameter | value |",
        "|---|---|",
        *(f"| {name} | {getattr(cal, name):.4g} |" for name in (
            "compute_efficiency", "memory_efficiency", "attention_efficiency", "kv_memory_efficiency",
            "linear_sharpness", "step_overhead_s", "token_layer_s", "row_layer_s", "attention_rows",
            "attention_sharpness", "multi_token_read", "chunk_attention_rows", "chunk_layer_s",
            "mixed_row_layer_s", "decode_layer_s")),
        *(f"| {name} | {getattr(cal, name):.4g} |" for name in ("all_reduce_s", "all_reduce_token_s") if cal.tp > 1),
        *([f"| chunk_routing_skew | {cal.chunk_routing_skew:.4g} |"] if cal.chunk_routing_skew is not None else []),
        *([f"| expert_small_tile_cost | {cal.expert_small_tile_cost:.4g} |"]
          if cal.expert_small_tile_cost is not None else []),
        *([f"| mtp_pass_s | {cal.mtp_draft.pass_s:.4g} |", f"| mtp_roof_scale | {cal.mtp_draft.roof_scale:.4g} |"]
          if cal.mtp_draft is not None else []),
        "",
        "| shape | measured ms | fitted ms | fit error | roofline error |" + (" held-out error |" if held is not None
                                                                              else ""),
        "|---|---:|---:|---:|---:|" + ("---:|" if held is not None else ""),
        *(f"| {s.shape} | {s.measured_s * 1e3:.3f} | {s.predicted_s * 1e3:.3f} | {s.error:+.1%} | {r:+.1%} |"
          + (f" {h:+.1%} |" if held is not None else "")
          for s, r, h in zip(cal.fit, roofline, held if held is not None else roofline, strict=True)),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    typer.run(calibrate)
