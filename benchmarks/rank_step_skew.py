"""What each rank of a live run of several rank processes spent on its own steps (its ``rank_steps.parquet``).

A tensor-parallel run: per step, the slowest rank's own time minus the ranks' median (the skew the step
paid), how much of it the slowest rank's mask fill explains, which rank was slowest, the ranks' waits and
exchanges, and the fill spread the model's ``rank_fill_jitter`` takes (``costs.rank_costs=live-run:<run>``).
A data-parallel run: each rank's own steps (its ranks wait for no one). Usage::

    python benchmarks/rank_step_skew.py /tmp/rk/default-tp2-live-a [more runs or PACK::RUN ...] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pandas as pd

from cdbench.harness.live.rank_steps import RANK_STEPS_FILE, fill_spread, step_skew
from cdbench.results.pack import open_run

QUANTILES = (0.5, 0.9, 0.99)


def quantiles_ms(values: pd.Series) -> dict[str, float]:
    """The median, p90, p99 and max of ``values`` (seconds) in milliseconds.

    >>> quantiles_ms(pd.Series([0.001, 0.002, 0.003]))
    {'p50_ms': 2.0, 'p90_ms': 2.8, 'p99_ms': 2.98, 'max_ms': 3.0}
    """
    out = {f"p{round(q * 100)}_ms": round(float(values.quantile(q)) * 1e3, 4) for q in QUANTILES}
    out["max_ms"] = round(float(values.max()) * 1e3, 4)
    return out


def summarize(ref: str) -> list[dict]:
    """One row a measured quantity (``quantity``, quantiles) of the run ``ref``'s rank records."""
    run = open_run(ref)
    data = run.read_file(RANK_STEPS_FILE)
    if data is None:
        raise SystemExit(f"{ref}: no {RANK_STEPS_FILE} (a run of one rank, or from before the ranks' records)")
    own = pd.read_parquet(io.BytesIO(data))
    parallel = (run.config.get("scheduler") or {}).get("parallel", "tp")
    rows = []
    if parallel == "tp":
        skew = step_skew(own)
        rows.append(dict(quantity="skew: slowest rank minus the median", **quantiles_ms(skew["skew_s"])))
        rows.append(dict(quantity="its fill part: slowest rank's fill minus the median",
                         **quantiles_ms(skew["fill_skew_s"])))
        for rank, part in own.groupby("rank"):
            rows.append(dict(quantity=f"rank {rank}: wait for the slowest", **quantiles_ms(part["wait_s"])))
            rows.append(dict(quantity=f"rank {rank}: exchange of durations", **quantiles_ms(part["agree_s"])))
        slowest = skew["slowest"].value_counts(normalize=True).sort_index()
        print(f"{ref}: {len(skew)} steps of {own['rank'].nunique()} ranks; slowest rank's share of steps "
              + ", ".join(f"rank {r} {share:.0%}" for r, share in slowest.items())
              + "; the other ranks' fill over rank 0's (the model's rank_fill_offset, rank_fill_jitter) "
              + f"{fill_spread(own)}")
    else:
        print(f"{ref}: {parallel} run, {own['rank'].nunique()} ranks (no agreement: each rank's own steps)")
    for rank, part in own.groupby("rank"):
        for column in ("local_s", "forward_s", "fill_s", "launch_s"):
            rows.append(dict(quantity=f"rank {rank}: {column.removesuffix('_s')}", **quantiles_ms(part[column])))
    return [dict(run=ref, **row) for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders or PACK::RUN references")
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args()
    table = pd.DataFrame([row for ref in args.runs for row in summarize(ref)])
    print(table.drop(columns="run").to_string(index=False) if len(args.runs) == 1 else table.to_string(index=False))
    if args.csv is not None:
        table.to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()
