"""Time decode steps with the per-row attention kernel in a cache as long as the step's context and in a
longer one, with and without the kernel's floor of keys per split.

``live`` mode's cache slots are as long as the workload's longest context, while the calibration grid
sizes each shape's cache to its own context; the kernel picks its splits from the cache length, so a
short row in a long cache was cut into chunks of one key block. This measures what that costs a whole
forward step, and that the floor (``MIN_KEYS_PER_SPLIT``) gives the long cache the tight cache's time.
Usage (a CUDA host)::

    python benchmarks/live_decode_split_floor.py --model qwen3-8b --cache-len 4096 --out reports/live/decode_split_floor_h100.csv

Found (H100, reports/live/decode_split_floor_h100.csv): decode steps in a 4096-token cache take the time they take
in a cache as long as their context, with the old one-key-block split and with the 256-key floor alike (ratios
0.99-1.02): the cache length is not why live decode forwards ran above the calibration
(reports/fidelity/live_vs_model.md).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from cdbench.harness.costs.hardware import resolve_model
from cdbench.harness.live.measure import StepShape, measure_grid
from cdbench.kernels import decode_attention as kernel

ROWS = (1, 4, 8, 16, 32, 64)  # 64 rows x a 4096-token cache: 2^18 tokens, 39 GB of KV for Qwen3-8B
KV = (512, 1024, 2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--cache-len", type=int, default=4096, help="the long cache's slot length")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = resolve_model(args.model)
    shapes = [StepShape(rows=r, kv=kv) for r in ROWS for kv in KV]
    floors = {"one_block": kernel.BLOCK_N, "floor": kernel.MIN_KEYS_PER_SPLIT}
    times = {}
    default_floor = kernel.MIN_KEYS_PER_SPLIT
    try:
        for name, floor in floors.items():
            # the kernel reads its default floor when a graph is captured; one key block is the old behaviour
            kernel.MIN_KEYS_PER_SPLIT = floor
            for cache_len in (None, args.cache_len):
                times[name, cache_len] = measure_grid(spec, shapes, per_row=True, cache_len=cache_len)
    finally:
        kernel.MIN_KEYS_PER_SPLIT = default_floor
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.writer(f)
        columns = [f"{name}_{'tight' if cache_len is None else cache_len}_ms" for name, cache_len in times]
        writer.writerow(["model", "gpu", "rows", "kv", *columns, "one_block_long_over_tight", "floor_long_over_tight"])
        for i, shape in enumerate(shapes):
            ms = [rows[i].median_s * 1e3 for rows in times.values()]
            tight_a, long_a, tight_b, long_b = ms
            writer.writerow([spec.name, times["floor", None][i].gpu_device, shape.rows, shape.kv,
                             *(f"{x:.4f}" for x in ms), f"{long_a / tight_a:.4f}", f"{long_b / tight_b:.4f}"])
            print(f"rows {shape.rows:4d} kv {shape.kv:5d}: one block {tight_a:7.3f} -> {long_a:7.3f} ms, "
                  f"floor {tight_b:7.3f} -> {long_b:7.3f} ms", flush=True)


if __name__ == "__main__":
    main()
