"""Steps of several whole-prompt prefill chunks: the live forward against the calibrated forward model.

A busy engine's mixed steps carry a dozen prompt chunks (chunked prefill fills the token budget with whole
prompts), and the live forward attends chunk by chunk. This times, as the calibration does (graph replays,
``measure_grid``), the calibration grid's steps of 2-16 chunks (``chunk_grid``) and one chunk of the same
prompt tokens, alone and beside decode rows, and prints each against the shipped calibration's price. Run
against a calibration fitted without several-chunk steps (``chunk_layer_s`` 0), it shows the live forward's
cost growing with the chunk count where the model's does not (``reports/live/multi_chunk_h100.csv``).
Usage (a CUDA host)::

    python benchmarks/live_multi_chunk.py --model qwen3-8b --gpu h100-sxm --out reports/live/multi_chunk_h100.csv

Found (H100, reports/live/multi_chunk_h100.csv, against a calibration without several-chunk steps): measured /
model goes from 0.94 to 1.26 (1024 prompt tokens, no decode rows) and from 1.07 to 1.33 (beside 64 rows) as the
chunks go from 1 to 16; the calibration grid then gained several-chunk shapes and ``chunk_layer_s``
(reports/calibration/README.md).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

from cdbench.harness.costs.forward import ForwardCostModel, attention_pairs
from cdbench.harness.costs.hardware import resolve_model
from cdbench.harness.live.measure import (
    CHUNK_DECODE,
    CHUNK_TOKENS,
    StepShape,
    chunk_grid,
    measure_grid,
)


def shapes() -> list[StepShape]:
    """The calibration grid's several-chunk steps, after one chunk of the same tokens as their reference."""
    single = [StepShape(rows=rows, kv=kv, chunks=1, new=total) for total in CHUNK_TOKENS for rows, kv in CHUNK_DECODE]
    return single + chunk_grid()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--gpu", default="h100-sxm", help="the GPU whose shipped calibration prices the steps")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = resolve_model(args.model)
    model = ForwardCostModel(spec, args.gpu)
    grid = shapes()
    rows = []
    for shape, m in zip(grid, measure_grid(spec, grid, per_row=True)):
        new = np.full(shape.chunks, shape.new)
        priced = model.step_s(float(new.sum()), float(attention_pairs(new, np.zeros(shape.chunks)).sum()),
                              shape.rows, shape.rows * shape.kv)
        rows.append(dict(decode_rows=shape.rows, decode_kv=shape.kv, chunks=shape.chunks, new=shape.new,
                         measured_ms=round(m.median_s * 1e3, 4), model_ms=round(priced * 1e3, 4),
                         ratio=round(m.median_s / priced, 4), device=m.gpu_device, torch=m.torch_version))
        print(f"rows {shape.rows:3d} chunks {shape.chunks:2d} x {shape.new:5d}: {m.median_s * 1e3:8.3f} ms, "
              f"model {priced * 1e3:8.3f} ms, ratio {m.median_s / priced:.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
