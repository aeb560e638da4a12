"""How steady is ``cdbench host``'s score? This host's record, then the benchmark run again N times.

Prints this host's :class:`~cdbench.harness.costs.host.HostInfo` as JSON (benchmarked and recorded in the
store if it is not yet), then the score of each fresh run and their min / median / max, and the load average
before and after (other processes on the machine are what moves the score).

    .venv/bin/python benchmarks/host_score_spread.py [--runs 5] [--store DIR]

Found (2-core AMD EPYC VM shared with other work; reports/spec_costs/host_benchmark.md): within one load level
five runs stay within 4-7 % of each other, but load moves the score more: from about 1.0 near idle to about
0.92 at a load average of 7-8, so a host recorded under load is priced about 8 % slow while its record is kept.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from cdbench._env import cache_dir
from cdbench.harness.costs.host import run_benchmark, this_host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh benchmark runs (default 5)")
    parser.add_argument("--store", type=Path, default=cache_dir() / "spec_costs", help="host record store")
    args = parser.parse_args()

    print(this_host(args.store).model_dump_json(indent=1))
    print("load average before (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    scores = []
    for i in range(args.runs):
        start = time.perf_counter()
        scores.append(run_benchmark())
        print(f"run {i + 1}: score {scores[-1]:.4f} ({time.perf_counter() - start:.2f} s wall)")
    print("load average after (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    low, mid, high = min(scores), statistics.median(scores), max(scores)
    print(f"score over {args.runs} runs: min {low:.4f}, median {mid:.4f}, max {high:.4f} "
          f"(spread (max - min) / median {(high - low) / mid:.1%})")


if __name__ == "__main__":
    main()
