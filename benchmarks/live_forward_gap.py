"""Decode steps timed back to back (as ``cdbench calibrate`` times them) and one at a time after the GPU
has idled (as a serving loop launches a step after its host work, launch latency included).

``live`` mode's decode forwards run a few per cent slower than the calibration's measurements of the
same shapes; this measures how much of that is the GPU starting each step from idle. Usage (a CUDA host)::

    python benchmarks/live_forward_gap.py --model qwen3-8b --cache-len 2400 --out reports/live/forward_gap_h100.csv

Found (H100, reports/live/forward_gap_h100.csv): a decode graph launched after 0.5 or 2 ms of idle takes 0.0-0.7 %
longer than back to back: an idle GPU at launch is not why live decode forwards ran above the calibration
(reports/fidelity/live_vs_model.md).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from cdbench.harness.costs.hardware import resolve_model
from cdbench.harness.live.measure import StepShape, measure_grid

ROWS = (1, 2, 4, 8, 16, 32)
KV = (512, 1024)
IDLE_S = (0.0, 0.5e-3, 2e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--cache-len", type=int, default=2400, help="slot length (live: the longest context)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = resolve_model(args.model)
    shapes = [StepShape(rows=r, kv=kv) for r in ROWS for kv in KV]
    times = {idle: measure_grid(spec, shapes, per_row=True, cache_len=args.cache_len, idle_s=idle, min_reps=20)
             for idle in IDLE_S}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "gpu", "rows", "kv", "cache_len",
                         *(f"idle_{idle * 1e3:g}ms_ms" for idle in IDLE_S),
                         *(f"idle_{idle * 1e3:g}ms_over_back_to_back" for idle in IDLE_S[1:])])
        for i, shape in enumerate(shapes):
            ms = [times[idle][i].median_s * 1e3 for idle in IDLE_S]
            writer.writerow([spec.name, times[0.0][i].gpu_device, shape.rows, shape.kv, args.cache_len,
                             *(f"{x:.4f}" for x in ms), *(f"{x / ms[0]:.4f}" for x in ms[1:])])
            print(f"rows {shape.rows:3d} kv {shape.kv:5d}: " + "  ".join(
                f"idle {idle * 1e3:g} ms {x:7.3f}" for idle, x in zip(IDLE_S, ms, strict=True)), flush=True)


if __name__ == "__main__":
    main()
