"""Where a live prefill step's forward time parts from the calibration's measurement of the same shape.

At saturation SGLang runs its prefill steps alone (no decode rows beside them), several whole prompts a
step, and live mode's prefill forwards there ran 4-8 % over model mode's calibrated price
(``reports/fidelity/live_vs_model.md``, "Saturated pairs"). This times prefill shapes -- ``chunks`` whole
prompts of ``new`` tokens each, optionally beside ``rows`` decode rows of ``kv`` cached tokens (vLLM's mixed
steps) -- three ways, on one GPU (``--tp 1``) and on tensor-parallel ranks, one process and GPU each
(``--tp 2``: NCCL; gloo on the CPU):

- ``grid``: as the calibration does (:func:`~cdbench.harness.live.measure.measure_grid`: the step captured
  as a CUDA graph and replayed back to back);
- ``live``: through :class:`~cdbench.harness.live.step.LiveStep`, as live mode runs it (the step's graph
  captured before its clock starts, then the bitmask copy, apply and sampling of its rows), equal chunks;
- ``live_ragged``: the same tokens in chunks spread from half to one and a half times the mean (a step's
  prompts are of different lengths);

and, with ``--gpu``, the price of the forward cost model (the calibration shipped for that GPU and ``tp``).
One CSV row a shape and ``tp``. The shapes' default is the saturated ranks campaign's prefill steps
(the saturated cells of ``campaigns/ranks_vs_model.yaml`` replayed in model mode, TP=2 JSON: 1-5 prompts a step,
76-3296 tokens, median 776; two prompts a step median 1192 tokens, three 2145). Usage (a CUDA host)::

    python benchmarks/live_prefill_gap.py --model qwen3-8b --gpu h200 --tp 1 2 --out reports/live/prefill_gap_h200.csv

On the CPU (``--device cpu``, a tiny model's spec file, tiny shapes) the same steps run eagerly and the wall
clock times them: what the tests check.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cdbench.harness.costs.forward import ForwardCostModel, attention_pairs
from cdbench.harness.costs.hardware import ModelSpec, resolve_model
from cdbench.harness.live.forward import TensorParallel
from cdbench.harness.live.measure import StepShape, measure_grid
from cdbench.harness.live.step import LiveStep

#: (chunks, tokens each): the saturated campaign's prefill steps (module doc)
SHAPES = ("1x256", "1x576", "1x1024", "1x2048", "2x576", "2x1024", "3x704", "5x660")
VARIANTS = ("live", "live_ragged")


@dataclass(frozen=True)
class Options:
    """What every rank measures (picklable: handed to the rank processes)."""

    model: ModelSpec
    shapes: tuple[StepShape, ...]
    device: str
    vocab: int
    max_len: int
    reps: int


def parse_shape(text: str) -> StepShape:
    """``CxN`` (C prompts of N tokens) or ``CxN+RxK`` (beside R decode rows of K cached tokens).

    >>> parse_shape("3x704")
    StepShape(rows=0, kv=0, chunks=3, new=704, cached=0)
    >>> parse_shape("1x512+64x1024").kind
    'mixed'
    """
    try:
        prefill, _, decode = text.partition("+")
        chunks, new = (int(v) for v in prefill.split("x"))
        rows, kv = (int(v) for v in decode.split("x")) if decode else (0, 0)
    except ValueError:
        raise ValueError(f"shape {text!r}: expected CxN or CxN+RxK (integers)") from None
    if chunks < 1 or new < 1 or rows < 0 or kv < 0 or (rows and kv < 1):
        raise ValueError(f"shape {text!r}: chunks and tokens must be positive, rows and their context not negative")
    return StepShape(rows=rows, kv=kv, chunks=chunks, new=new)


def chunk_lengths(shape: StepShape, ragged: bool) -> np.ndarray:
    """The step's prompt lengths: ``chunks`` of ``new`` tokens, or (``ragged``) spread evenly from half to one
    and a half times ``new`` with the same total.

    >>> chunk_lengths(StepShape(chunks=3, new=100), ragged=True).tolist()
    [50, 100, 150]
    >>> chunk_lengths(StepShape(chunks=2, new=5), ragged=True).tolist()
    [2, 8]
    """
    if not ragged or shape.chunks == 1:
        return np.full(shape.chunks, shape.new, dtype=np.int64)
    lens = np.maximum(1, np.round(np.linspace(0.5, 1.5, shape.chunks) * shape.new)).astype(np.int64)
    lens[-1] += shape.chunks * shape.new - int(lens.sum())
    return lens


def longest_context(shapes: Sequence[StepShape]) -> int:
    """The longest context any variant's row reaches (a ragged step's last prompt, a decode row's next token)."""
    return max(max(int(chunk_lengths(s, True).max()), s.kv + 1 if s.rows else 0) for s in shapes)


def live_times(step: LiveStep, shape: StepShape, ragged: bool, reps: int) -> tuple[list[float], list[float]]:
    """Forward and whole-step seconds of ``reps`` live steps of ``shape`` (after two warm-ups)."""
    new = chunk_lengths(shape, ragged)
    decode = np.full(shape.rows, shape.kv, dtype=np.int64)
    forward, duration = [], []
    for i in range(reps + 2):
        step.begin(decode, np.zeros(shape.rows, dtype=np.int64), new, np.zeros(shape.chunks, dtype=np.int64),
                   sync=True, host_s=0.0)
        times = step.end(shape.rows + shape.chunks, shape.rows + shape.chunks, 0.0, sync=True)
        if i >= 2:
            forward.append(times.forward_s)
            duration.append(times.duration)
    return forward, duration


def measure(options: Options, tp: TensorParallel | None = None) -> list[dict]:
    """Every shape's grid, live and ragged live forward (milliseconds): one dict a shape."""
    device = options.device
    ranks = tp.size if tp is not None else 1
    grid = measure_grid(options.model, options.shapes, device, per_row=True, cache_len=options.max_len,
                        min_reps=options.reps, tp=tp)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    slots = max(s.slots for s in options.shapes)
    # each request's context in whole blocks of 16
    step = LiveStep(options.model, options.vocab, options.max_len, device, kv_tokens=slots * (options.max_len + 16),
                    max_rows=slots, logits_dtype=torch.float32 if device == "cpu" else torch.bfloat16, tp=tp)
    rows = []
    for shape, measured in zip(options.shapes, grid, strict=True):
        row = dict(model=options.model.name, gpu=measured.gpu_device, tp=ranks, chunks=shape.chunks, new=shape.new,
                   rows=shape.rows, kv=shape.kv, max_len=options.max_len, grid_ms=measured.median_s * 1e3)
        for variant in VARIANTS:
            forward, duration = live_times(step, shape, variant == "live_ragged", options.reps)
            row[f"{variant}_ms"] = statistics.median(forward) * 1e3
            row[f"{variant}_step_ms"] = statistics.median(duration) * 1e3
        rows.append(row)
    return rows


def measure_tp(options: Options, ranks: int, timeout_s: float = 900.0) -> list[dict]:
    """:func:`measure` on ``ranks`` tensor-parallel rank processes (rank 0's times)."""
    from cdbench.harness.live.rank_procs import run_rank_processes

    if options.device == "cuda" and torch.cuda.device_count() < ranks:
        raise SystemExit(f"--tp {ranks}: each rank needs a GPU; this machine has {torch.cuda.device_count()}")
    return run_rank_processes(_measure_rank, ranks, (options, ranks, timeout_s), timeout_s,
                              name="cdbench-prefill-gap")[0]


def _measure_rank(rank: int, folder: Path, options: Options, ranks: int, timeout_s: float) -> None:
    """One rank of :func:`measure_tp`: join the group (NCCL on GPUs, gloo on the CPU), measure, hand back."""
    import datetime

    import torch.distributed as dist

    from cdbench.harness.live.rank_procs import deliver

    cuda = options.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder / 'store'}", rank=rank,
                            world_size=ranks, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        mine = Options(options.model, options.shapes, f"cuda:{rank}" if cuda else options.device, options.vocab,
                       options.max_len, options.reps)
        rows = measure(mine, TensorParallel(ranks, rank, None))
    finally:
        dist.destroy_process_group()
    deliver(folder, rank, rows)


def priced_ms(model: ForwardCostModel, shape: StepShape) -> float:
    """The forward cost model's price of ``shape`` (equal chunks), in milliseconds."""
    new = np.full(shape.chunks, shape.new)
    pairs = float(attention_pairs(new, np.zeros(shape.chunks)).sum())
    return model.step_s(float(new.sum()), pairs, shape.rows, shape.rows * shape.kv) * 1e3


def with_ratios(row: dict, model_ms: float | None) -> dict:
    """``row`` with each variant over the grid and, priced, the grid and each variant over the model."""
    out = dict(row)
    for variant in VARIANTS:
        out[f"{variant}_over_grid"] = row[f"{variant}_ms"] / row["grid_ms"]
    if model_ms is not None:
        out["model_ms"] = model_ms
        out["grid_over_model"] = row["grid_ms"] / model_ms
        for variant in VARIANTS:
            out[f"{variant}_over_model"] = row[f"{variant}_ms"] / model_ms
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b", help="a built-in model or a model spec file")
    parser.add_argument("--gpu", default=None, help="price each shape with this GPU's forward calibration")
    parser.add_argument("--tp", type=int, nargs="+", default=[1], help="tensor-parallel sizes to measure")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="CxN or CxN+RxK (see parse_shape)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--vocab", type=int, default=151_936, help="the sampled logits' width")
    parser.add_argument("--max-len", type=int, default=None,
                        help="live mode's slot length (default: the longest context a shape reaches)")
    parser.add_argument("--reps", type=int, default=20, help="timed steps of each shape and variant")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        shapes = tuple(parse_shape(s) for s in args.shapes)
    except ValueError as err:
        parser.error(str(err))
    if any(t < 1 for t in args.tp):
        parser.error("--tp sizes must be positive")
    longest = longest_context(shapes)
    max_len = args.max_len or longest
    if max_len < longest:
        parser.error(f"--max-len {max_len} is shorter than a shape's longest context ({longest} tokens)")
    options = Options(resolve_model(args.model), shapes, args.device, args.vocab, max_len, args.reps)
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for tp in dict.fromkeys(args.tp):
        measured = measure(options) if tp == 1 else measure_tp(options, tp)
        model = ForwardCostModel(options.model, args.gpu, tp=tp) if args.gpu else None
        for shape, row in zip(shapes, measured, strict=True):
            row = with_ratios(row, priced_ms(model, shape) if model is not None else None)
            rows.append(row)
            print(f"tp {tp} {shape.chunks} x {shape.new:5d}" + (f" + {shape.rows} x {shape.kv}" if shape.rows else "")
                  + f": grid {row['grid_ms']:.3f} ms, live {row['live_ms']:.3f} ({row['live_over_grid']:.3f}), "
                  f"ragged {row['live_ragged_ms']:.3f} ({row['live_ragged_over_grid']:.3f})"
                  + (f", model {row['model_ms']:.3f} ms" if model is not None else ""), flush=True)
        with args.out.open("w", newline="") as f:  # after each size: a later one cut short keeps these
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
