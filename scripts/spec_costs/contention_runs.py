"""Host contention in whole runs: hybrid and model mode, with and without the contention model.

For each policy: two hybrid runs without contention (their spread is the noise floor), one with it, and
model runs priced from the first hybrid run's own profile, with and without it; then ``cdbench fidelity``
of each model run against the hybrid run of the same pricing. Every run simulates this machine as the
engine host (``policy.host_cpus`` = its CPUs). Prints markdown tables: the runs' latency figures and their
steps' stretch, and, in the hybrid runs without contention, the measured host CPU per step against the
number of compiles the simulated pool was running when the step started (hybrid compiles each spec once,
before the steps that follow, so no real compile runs beside a measured step).

    .venv/bin/python scripts/spec_costs/contention_runs.py OUT [--corpus PATH] [-n 300] [--rate 100]
        [--policies sglang,vllm] [--compile-cores 1,2.5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

CDBENCH = str(Path(sys.executable).with_name("cdbench"))
CORPUS = Path(__file__).resolve().parents[2].parent / "shared/corpora/jsonschemabench_kubernetes_sampled.jsonl"
FIGURES = ("median_tpot_ms", "mean_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms", "request_throughput")


def cdbench(*args: str) -> None:
    print("$ cdbench " + " ".join(args), file=sys.stderr, flush=True)
    subprocess.run([CDBENCH, *args], check=True, stdout=subprocess.DEVNULL)


def running_compiles(requests: pd.DataFrame, starts: np.ndarray) -> np.ndarray:
    """Compiles of the simulated pool running at each of ``starts`` (one per compiled miss)."""
    miss = requests[requests["cache"] == "miss"]
    begin, end = np.sort(miss["compile_start_s"].to_numpy()), np.sort(miss["compile_end_s"].to_numpy())
    return np.searchsorted(begin, starts, side="right") - np.searchsorted(end, starts, side="right")


def markdown(frame: pd.DataFrame) -> str:
    """``frame`` as a markdown table (numbers to 3 decimals)."""
    cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row] for row in frame.itertuples(index=False)]
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def run_row(folder: Path) -> dict:
    summary = json.loads((folder / "summary.json").read_text())
    steps = pd.read_parquet(folder / "steps.parquet")
    busy = steps[steps["kind"] != "idle"]
    return {"run": folder.name, **{f: summary[f] for f in FIGURES},
            "mean stretch": float(busy["contention"].mean()), "stretched steps": float((busy["contention"] > 1).mean())}


def by_compiles(folder: Path) -> pd.DataFrame:
    """Per step with grammar rows: measured fill and processing per grammar row, by compiles running."""
    requests, steps = pd.read_parquet(folder / "requests.parquet"), pd.read_parquet(folder / "steps.parquet")
    steps = steps[(steps["kind"] == "decode") & (steps["grammar_rows"] > 0)].copy()
    steps["compiles"] = np.minimum(running_compiles(requests, steps["start_s"].to_numpy()), 3)
    steps["fill_us_per_row"] = steps["fill_s"] / steps["grammar_rows"] * 1e6
    steps["process_us_per_row"] = steps["process_s"] / steps["grammar_rows"] * 1e6
    return steps.groupby("compiles").agg(steps=("start_s", "size"), rows=("grammar_rows", "mean"),
                                         fill_us_per_row=("fill_us_per_row", "median"),
                                         process_us_per_row=("process_us_per_row", "median"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("-n", type=int, default=300, help="requests")
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second")
    parser.add_argument("--policies", default="sglang,vllm")
    parser.add_argument("--compile-cores", default="1,2.5", help="scheduler.compile_cores of the runs with contention")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cpus = os.cpu_count()
    print(f"host: {cpus} CPUs; load average before (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    common = ["--corpus", str(args.corpus), "-n", str(args.n), "--rate", str(args.rate), "--set", f"policy.host_cpus={cpus}",
              "--set", "scheduler.overlap=false", "--overwrite"]
    cores = args.compile_cores.split(",")
    for name in args.policies.split(","):
        out = args.out / name
        rows, checks = [], []
        for copy in ("a", "b"):
            cdbench("run", "--mode", "hybrid", "--policy", name, *common, "--set", "scheduler.host_contention=false",
                    "--out", str(out / f"hybrid-off-{copy}"))
        profile = str(out / "hybrid-off-a" / "grammar_profile.json")
        for k in cores:
            cdbench("run", "--mode", "hybrid", "--policy", name, *common, "--set", f"scheduler.compile_cores={k}",
                    "--out", str(out / f"hybrid-on-k{k}"))
        model = [*common, "--set", f"costs.grammar_profile={profile}"]
        cdbench("run", "--mode", "model", "--policy", name, *model, "--set", "scheduler.host_contention=false",
                "--out", str(out / "model-off"))
        checks.append(("hybrid-off-a", "model-off"))
        for k in cores:
            cdbench("run", "--mode", "model", "--policy", name, *model, "--set", f"scheduler.compile_cores={k}",
                    "--out", str(out / f"model-on-k{k}"))
            checks.append((f"hybrid-on-k{k}", f"model-on-k{k}"))
        for reference, checked in checks:
            result = subprocess.run([CDBENCH, "fidelity", str(out / reference), str(out / checked), "--noise",
                                     str(out / "hybrid-off-a"), str(out / "hybrid-off-b"), "--out",
                                     str(out / f"fidelity-{checked}")], capture_output=True, text=True)
            print(f"cdbench fidelity {reference} {checked}: exit {result.returncode}", file=sys.stderr)
        for folder in sorted(p for p in out.iterdir() if (p / "summary.json").exists()):
            rows.append(run_row(folder))
        print(f"\n### {name}: runs ({args.n} requests at {args.rate:g}/s, overlap off, host_cpus {cpus})\n")
        print(markdown(pd.DataFrame(rows)))
        for copy in ("a", "b"):
            print(f"\n{name} hybrid-off-{copy}: decode steps with grammar rows, measured CPU per grammar row "
                  "(median) by compiles running (3: three or more)\n")
            print(markdown(by_compiles(out / f"hybrid-off-{copy}").reset_index()))
    print("\nload average after (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
