"""Where a live decode step's forward time parts from the calibration's measurement of the same shape.

``live`` mode's decode forwards run a few per cent slower than ``cdbench calibrate`` measured the same
shapes. This times, on one GPU and in one process, the same decode shapes four ways:

- ``grid``: as the calibration does (``measure_grid``: a graph replayed back to back, its own small cache);
- ``live_equal``: through :class:`~cdbench.harness.live.step.LiveStep` (a slotted cache as live mode's, graphs at
  the policy's sizes, inputs staged, the bitmask copy, apply and sampling after it), every row as long;
- ``live_ragged``: the same, row lengths spread uniformly over a quarter to 1.75 times the mean;
- ``live_busy``: ``live_equal`` with the launching thread busy while the GPU runs (overlap's host work);
- ``live_long_last`` / ``live_long_first`` (with ``--long-rows`` > 0): that many rows ``--long-factor`` times the mean long and the
  others shorter, the same total context, the long rows at the batch's end / its start (a saturated batch's
  newest requests, at its end, can be its longest; a decode-attention kernel that launches its programs in row
  order starts them last, and they finish after the rest);

each live variant under every ``--launch`` of the decode-attention kernel's rows: ``longest_first`` (live mode's:
the rows sorted by length, :mod:`cdbench.kernels.decode_attention`) and ``in_order`` (the rows as batched, the
kernel before it balanced ragged batches), alternated A,B,B,A in one process (one CSV row a shape and launch;
the grid, of equal rows, is measured once with live mode's launch). The live cache holds ``max(--rows)`` slots of
``--max-len``, so any ``--rows`` up to live mode's slot count fits (live mode's cache fills the GPU's memory; a
step reads only its rows' slots).

Then holds the GPU busy with live steps of one shape for ``--sustain-s`` seconds and prints the forward's
median per second (clocks settling under sustained load). Usage (a CUDA host)::

    python benchmarks/live_step_gap.py --model qwen3-8b --max-len 2400 --out reports/live/step_gap_h100.csv
    python benchmarks/live_step_gap.py --max-len 2595 --rows 64 96 128 147 --kv 512 700 --sustain-s 0 \
        --long-rows 8 --out reports/kv_capacity/step_gap_balanced_h100.csv   # the held-out BFCL case's batches

Found (H100, reports/live/step_gap_h100.csv): the live forwards are 0.0-0.9 % above the grid; ragged lengths and a
busy thread change nothing measurable; under 25 s of sustained steps the forward stayed at 8.94-8.98 ms and the
SM clock at 1980 MHz. The step's wall time holds 150-340 us more than its forward and sampling: the launch
(reports/live/README.md). At the held-out BFCL case's batches (H100, the kernel launching rows in order, before
``--launch``; its 148-row shapes failed for a cache of 147 slots, before the cache was sized to ``--rows``:
reports/kv_capacity/step_gap_large_h100.csv), 8 long rows at the batch's end made the forward 0.9-5.9 % slower
than the grid, at its start -0.3 to +1.2 %, equal rows 0.2-0.4 %, uniformly ragged 0.5-1.9 %.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from cdbench.harness.costs.hardware import resolve_model
from cdbench.harness.live.measure import StepShape, measure_grid
from cdbench.harness.live.step import LiveStep
from cdbench.harness.policies import policy

ROWS = (1, 2, 4, 8, 16, 32)
KV = (512, 1024)
STEPS = 40
BUSY_S = 4e-3
VARIANTS = ("live_equal", "live_ragged", "live_busy", "live_long_last", "live_long_first")
LAUNCHES = {"longest_first": True, "in_order": False}  # --launch: LiveStep.balance_decode


def lengths(rows: int, kv: int, variant: str, rng: np.random.Generator, long_rows: int = 8,
            long_factor: float = 3.5) -> np.ndarray:
    """One step's row lengths for ``variant`` (mean ``kv``).

    >>> lengths(4, 100, "live_long_last", np.random.default_rng(0), long_rows=1, long_factor=2.5).tolist()
    [50, 50, 50, 250]
    """
    if variant == "live_ragged":
        return rng.integers(kv // 4, kv * 7 // 4 + 1, size=rows).astype(np.int64)
    if variant not in ("live_long_last", "live_long_first") or rows < 2:
        return np.full(rows, kv, dtype=np.int64)
    long = int(kv * long_factor)
    # as many long rows as leave the others at least one token each: the total stays rows x kv
    n_long = min(long_rows, rows - 1, (rows * kv - rows) // max(long - 1, 1))
    if n_long <= 0:
        return np.full(rows, kv, dtype=np.int64)
    short = max(1, (rows * kv - n_long * long) // (rows - n_long))
    lens = np.array([short] * (rows - n_long) + [long] * n_long, dtype=np.int64)
    return lens if variant == "live_long_last" else lens[::-1].copy()


def run_steps(step: LiveStep, rows: int, kv: int, variant: str, n: int, rng: np.random.Generator,
              long_rows: int = 8, long_factor: float = 3.5) -> list:
    empty = np.zeros(0, dtype=np.int64)
    busy = variant == "live_busy"
    times = []
    for _ in range(n + 3):
        lens = lengths(rows, kv, variant, rng, long_rows, long_factor)
        step.begin(lens, np.zeros(rows, dtype=np.int64), empty, empty, sync=not busy, host_s=BUSY_S if busy else 0.0)
        times.append(step.end(rows, rows, 0.0, sync=True))
    return times[3:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--max-len", type=int, default=2400, help="live mode's slot length (the longest context)")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--policy", default="sglang", help="whose CUDA-graph sizes the live step captures")
    parser.add_argument("--sustain-s", type=float, default=30.0)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="decode rows of the shapes")
    parser.add_argument("--kv", type=int, nargs="+", default=list(KV), help="mean cached tokens a row")
    parser.add_argument("--long-rows", type=int, default=0,
                        help="long rows of the live_long_last/live_long_first variants (0: those variants not run)")
    parser.add_argument("--long-factor", type=float, default=3.5, help="their length over the mean")
    parser.add_argument("--launch", nargs="+", choices=list(LAUNCHES), default=list(LAUNCHES),
                        help="the decode-attention kernel's row orders to compare")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = resolve_model(args.model)
    variants = VARIANTS if args.long_rows > 0 else VARIANTS[:3]
    if args.long_rows > 0 and max(int(kv * args.long_factor) for kv in args.kv) >= args.max_len:
        parser.error(f"--long-factor x --kv reaches --max-len {args.max_len}: the long rows do not fit a slot")
    shapes = [StepShape(rows=r, kv=kv) for r in args.rows for kv in args.kv]
    grid = measure_grid(spec, shapes, per_row=True, cache_len=args.max_len, min_reps=20)
    torch.cuda.empty_cache()
    step = LiveStep(spec, args.vocab, args.max_len, kv_tokens=max(args.rows) * (args.max_len + 16),  # whole blocks
                    graph_sizes=policy(args.policy).cuda_graph_sizes)
    rng = np.random.default_rng(0)
    launches = list(dict.fromkeys(args.launch))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "gpu", "rows", "kv", "max_len", "launch", "grid_ms",
                         *(f"{v}_ms" for v in variants), *(f"{v}_over_grid" for v in variants),
                         "live_equal_duration_ms", "live_equal_sample_ms"])
        for shape, measured in zip(shapes, grid, strict=True):
            times = {(v, launch): [] for v in variants for launch in launches}
            for variant in variants:
                # A,B then B,A: a drift of the GPU's clock over the shape weighs on both launches alike
                for half in (launches, launches[::-1]):
                    for launch in half:
                        step.balance_decode = LAUNCHES[launch]
                        times[variant, launch] += run_steps(step, shape.rows, shape.kv, variant, STEPS // 2, rng,
                                                            args.long_rows, args.long_factor)
            grid_ms = measured.median_s * 1e3
            for launch in launches:
                forward = {v: statistics.median(t.forward_s for t in times[v, launch]) * 1e3 for v in variants}
                equal = times["live_equal", launch]
                duration = statistics.median(t.duration for t in equal) * 1e3
                sample = statistics.median(t.copy_s + t.apply_s + t.sample_s for t in equal) * 1e3
                writer.writerow([spec.name, measured.gpu_device, shape.rows, shape.kv, args.max_len, launch,
                                 f"{grid_ms:.4f}", *(f"{forward[v]:.4f}" for v in variants),
                                 *(f"{forward[v] / grid_ms:.4f}" for v in variants), f"{duration:.4f}",
                                 f"{sample:.4f}"])
                print(f"rows {shape.rows:3d} kv {shape.kv:5d} {launch:13s}: grid {grid_ms:.3f} ms, "
                      + ", ".join(f"{v} {forward[v]:.3f}" for v in variants) + f", step {duration:.3f} ms",
                      flush=True)
    start = time.perf_counter()
    second, window = 0, []
    while time.perf_counter() - start < args.sustain_s:
        window += [t.forward_s for t in run_steps(step, 8, 1024, "live_ragged", 10, rng)]
        if time.perf_counter() - start >= second + 1:
            print(f"sustained {second:3d}-{second + 1:3d} s: forward median {statistics.median(window) * 1e3:.3f} ms "
                  f"({len(window)} steps of 8 rows, ragged around 1024)", flush=True)
            second, window = second + 1, []


if __name__ == "__main__":
    main()
