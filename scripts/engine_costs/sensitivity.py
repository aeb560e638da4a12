"""Sensitivity of model-mode throughput and TPOT to the engines' host costs, at saturation.

For each model, GPU and preset: overlap on/off × structured share 0 / 0.5 / 1 × fill threads
1 / 8, all with the same fixed output length (token_source=lengths), plus, at share 1 with
8 threads and either overlap setting, the bitmask sent to another process (``mask_transfer=ipc``) and the
measured host costs switched off (``HOST_COST_FIELDS`` = 0). Writes a CSV of every run.

    .venv/bin/python scripts/engine_costs/sensitivity.py --out reports/engine_costs/sensitivity.csv
"""

from __future__ import annotations

import argparse
import csv
import itertools
import time
from pathlib import Path

from cdbench.harness.config import RunConfig
from cdbench.harness.policies import HOST_COST_FIELDS
from cdbench.harness.run import run
from cdbench.results.config_files import (
    apply_overrides,
    builtin_config_path,
    read_yaml_mapping,
)

FIELDS = ["model", "gpu", "preset", "overlap", "share", "fill_threads", "variant", "request_throughput",
          "output_throughput", "mean_tpot_ms", "host_schedule_share", "host_grammar_share", "host_transfer_share",
          "host_process_share", "gpu_share", "mask_share"]


def one(model: str, gpu: str, preset: str, overlap: bool, share: float, threads: int, variant: str,
        requests: int, rate: float, corpus: str, seed: int) -> dict:
    sets = {"mode": "model", "seed": seed, "workload.seed": seed, "policy.name": preset, "costs.model": model,
            "costs.gpu": gpu, "workload.corpus": [corpus], "workload.num_requests": requests,
            "workload.arrival.rate": rate, "workload.token_source": "lengths", "workload.structured_ratio": share,
            "workload.output_len": {"dist": "fixed", "value": 256}, "scheduler.overlap": overlap,
            "scheduler.fill_threads": threads}
    if variant == "ipc":
        sets["scheduler.mask_transfer"] = "ipc"
    elif variant == "no_host_costs":
        sets.update({f"scheduler.{f}": 0.0 for f in HOST_COST_FIELDS})
    tree = apply_overrides(read_yaml_mapping(builtin_config_path("default")), sets)
    s = run(RunConfig.model_validate(tree)).summary
    return dict(model=model, gpu=gpu, preset=preset, overlap=overlap, share=share, fill_threads=threads,
                variant=variant, **{k: getattr(s, k) for k in FIELDS[7:]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="llama-3.1-8b,qwen3-8b")
    ap.add_argument("--gpus", default="h100-sxm,h200")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--corpus", default="jsonschemabench_glaiveai2k")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    grid = []
    for model, gpu, preset in itertools.product(args.models.split(","), args.gpus.split(","), ("vllm", "sglang")):
        for overlap, share, threads in itertools.product((True, False), (0.0, 0.5, 1.0), (1, 8)):
            grid.append((model, gpu, preset, overlap, share, threads, "base"))
        for overlap in (True, False):
            grid.append((model, gpu, preset, overlap, 1.0, 8, "ipc"))
            grid.append((model, gpu, preset, overlap, 1.0, 8, "no_host_costs"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for i, point in enumerate(grid):
            t0 = time.perf_counter()
            row = one(*point, args.requests, args.rate, args.corpus, args.seed)
            w.writerow(row)
            f.flush()
            print(f"[{i + 1}/{len(grid)}] {point}: {row['request_throughput']:.2f} req/s, "
                  f"TPOT {row['mean_tpot_ms']:.2f} ms ({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
