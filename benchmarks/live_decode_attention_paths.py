"""Time a model's decode steps with dense attention and with the per-row decode-attention kernel.

Both paths run the same live forward (CUDA-graph replays, equal context per row, as the calibration
grid has them); the ratio says whether a calibration measured with dense attention also prices
``live`` mode's per-row decode. Usage (a CUDA host)::

    python benchmarks/live_decode_attention_paths.py --model qwen3-8b --out reports/live/decode_attention_h100.csv

Found (H100, qwen3-8b, reports/live/decode_attention_paths_h100.csv): the per-row kernel takes 0.71-1.00x the
dense path's time for the same shapes; small batches at long contexts gain most, 16+ rows agree within 2.5 %
(reports/calibration/README.md).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from cdbench.harness.costs.hardware import resolve_model
from cdbench.harness.live.measure import (
    DECODE_KV,
    DECODE_ROWS,
    MAX_DECODE_TOKENS,
    StepShape,
    measure_grid,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = resolve_model(args.model)
    shapes = [StepShape(rows=r, kv=kv) for r in DECODE_ROWS for kv in DECODE_KV if r * kv <= MAX_DECODE_TOKENS]
    dense = measure_grid(spec, shapes)
    per_row = measure_grid(spec, shapes, per_row=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "gpu", "rows", "kv", "dense_ms", "per_row_ms", "per_row_over_dense"])
        for shape, a, b in zip(shapes, dense, per_row, strict=True):
            ratio = b.median_s / a.median_s
            writer.writerow([spec.name, a.gpu_device, shape.rows, shape.kv, f"{a.median_s * 1e3:.4f}",
                             f"{b.median_s * 1e3:.4f}", f"{ratio:.4f}"])
            print(f"rows {shape.rows:4d} kv {shape.kv:5d}: dense {a.median_s * 1e3:8.3f} ms  "
                  f"per-row {b.median_s * 1e3:8.3f} ms  ratio {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
