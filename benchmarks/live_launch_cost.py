"""The host's launch of a live step: its measured wall time beyond the parts it timed, per step kind.

A ``--mode live`` step stages its inputs, launches the forward, and wakes when the sampled tokens are
out; none of that is in the timed GPU parts or the modelled host work, and the GPU waits for it. Runs
record it as ``launch_s`` in ``steps.parquet``; for runs made before the column existed, a step without
overlap gives it as its duration less its priced parts (the scheduler's overlap rules). Prints the
median per run and step kind; the policies' ``launch_s`` (decode) and ``launch_prefill_s`` (prefill) are
taken from it. Usage::

    python benchmarks/live_launch_cost.py RUN [RUN ...] [--csv reports/live/launch_h100.csv]

Found (H100, reports/live/launch_h100.csv): median 328 us a decode step over 724 steps and 162 us a prefill step over
86 (their graphs need no input staging); the presets' ``launch_s`` and ``launch_prefill_s`` are these medians.
Under vLLM's mixed batches the split holds (92-158 us prefill-only, 99-149 us mixed, 191-296 us decode;
reports/live/launch_h100_vllm_200req.csv).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from cdbench.harness.config import RunConfig
from cdbench.harness.step_time import step_time
from cdbench.results.pack import open_run


def launches(folder: str) -> pd.DataFrame:
    """The run's (a run folder or ``PACK::RUN``) non-idle steps with their launch seconds."""
    run = open_run(folder)
    steps = run.steps[run.steps["kind"] != "idle"].copy()
    if "launch_s" not in steps:
        if RunConfig.model_validate(run.config).scheduler_config().overlap:
            raise SystemExit(f"{folder}: no launch_s column, and with overlap it cannot be derived")
        pre = steps[["schedule_s", "poll_s", "sync_s", "check_s"]].sum(axis=1)
        parts = [step_time(True, True, p, 0.0, s.forward_s, s.fill_s, s.copy_s + s.transfer_s, s.apply_s,
                           s.sample_s, s.process_s)[0] for p, s in zip(pre, steps.itertuples(), strict=True)]
        steps["launch_s"] = steps["duration_s"] - parts
    steps["run"] = run.label
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders or PACK::RUN")
    parser.add_argument("--csv", type=Path, default=None, help="write the per-run table here")
    args = parser.parse_args()
    steps = pd.concat([launches(folder) for folder in args.runs])
    table = steps.groupby(["run", "kind"]).agg(
        steps=("launch_s", "size"), p25_us=("launch_s", lambda s: 1e6 * s.quantile(0.25)),
        median_us=("launch_s", lambda s: 1e6 * s.median()), p75_us=("launch_s", lambda s: 1e6 * s.quantile(0.75)))
    print(table.round(1).to_string())
    print(f"all runs, median: {1e6 * steps['launch_s'].median():.1f} us over {len(steps)} steps")
    if args.csv is not None:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        table.round(1).to_csv(args.csv)


if __name__ == "__main__":
    main()
