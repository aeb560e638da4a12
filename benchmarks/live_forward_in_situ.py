"""A live run's decode forwards against the forward cost model, step by step.

Every decode step of a ``--mode live`` run records the forward's measured GPU time with its shape
(``decode_tokens``, ``context_tokens``); this prices the same shapes with the run's own forward model
(its calibration, padded to the policy's CUDA-graph sizes as the scheduler prices them, and unpadded)
and prints measured / modelled by decode batch size, the in-situ error of the calibration. Usage::

    python benchmarks/live_forward_in_situ.py RUN [RUN ...] --csv reports/live/forward_in_situ.csv
    python benchmarks/live_forward_in_situ.py reports/kv_capacity/bfcl_live.pack::kv_capacity_bfcl/sglang/bfcl-sglang-live-a

Found (H100): before the forward model's ``multi_token_s`` term, live forwards took 3.4-4.8 % longer than the model
in all 8 live-a runs (reports/live/forward_in_situ_h100.csv); after it, measured / model is 0.994-1.014 per decode
batch-size bucket and 1.007 over 724 decode steps (forward_in_situ_multi_token_h100.csv, reports/live/README.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from cdbench.harness.config import RunConfig
from cdbench.harness.policies import padded_decode
from cdbench.results.pack import open_run, split_ref

BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def priced(ref: str | Path) -> pd.DataFrame:
    """The run's decode steps (a run folder or ``PACK::RUN_ID``) with the model's padded and unpadded prices
    beside the measured forward."""
    run = open_run(ref)
    config = RunConfig.model_validate(run.config)
    forward = config.costs.build()
    sizes = config.scheduler_config().cuda_graph_sizes
    steps = run.steps[(run.steps["kind"] == "decode") & (run.steps["decode_tokens"] > 0)].copy()
    tokens, context = steps["decode_tokens"].to_numpy(), steps["context_tokens"].to_numpy()
    padded, padded_context = np.array([padded_decode(sizes, int(n), int(c)) for n, c in zip(tokens, context)]).T
    steps["padded_tokens"] = padded
    steps["model_padded_s"] = forward.step_s_array(0, 0, padded, padded_context)
    steps["model_unpadded_s"] = forward.step_s_array(0, 0, tokens, context)
    path, run_id = split_ref(ref)
    steps["run"] = Path(run_id).name if run_id is not None else path.name
    steps["calibration"] = forward.calibration_source
    return steps


def by_batch(steps: pd.DataFrame) -> pd.DataFrame:
    """Median measured / modelled per (run, decode batch size bucket)."""
    steps = steps.assign(
        bucket=pd.cut(steps["decode_tokens"], BUCKETS, right=True).astype(str),
        padded_ratio=steps["forward_s"] / steps["model_padded_s"],
        unpadded_ratio=steps["forward_s"] / steps["model_unpadded_s"],
    )
    grouped = steps.groupby(["run", "bucket"], sort=False)
    return grouped.agg(steps=("forward_s", "size"), measured_ms=("forward_s", lambda s: 1e3 * s.median()),
                       model_padded_ms=("model_padded_s", lambda s: 1e3 * s.median()),
                       padded_ratio=("padded_ratio", "median"),
                       unpadded_ratio=("unpadded_ratio", "median")).reset_index()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="live run folders or PACK::RUN_ID references")
    parser.add_argument("--csv", type=Path, default=None, help="write the per-bucket table here")
    args = parser.parse_args()
    steps = pd.concat([priced(folder) for folder in args.runs], ignore_index=True)
    table = by_batch(steps)
    with pd.option_context("display.width", 200, "display.max_rows", 200):
        print(table.round(4).to_string(index=False))
    total = steps.groupby("run").apply(
        lambda s: pd.Series({"steps": len(s), "measured / padded model (sum)": s["forward_s"].sum() / s["model_padded_s"].sum(),
                             "measured / unpadded model (sum)": s["forward_s"].sum() / s["model_unpadded_s"].sum()}),
        include_groups=False)
    print(total.round(4).to_string())
    if args.csv is not None:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        table.round(5).to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()
