"""How long a shipped grammar profile takes to load: the Parquet file against the JSON it replaced.

Run from the repository root (one core)::

    taskset -c 0 .venv/bin/python benchmarks/bench_profile_load.py --backend xgrammar --rounds 7

The JSON file is written from the shipped profile first (the indented JSON the
profiles were shipped as, value for value the same). Then, interleaved round by
round in one process (imports warm, as in a run, which has pandas and pyarrow
loaded already): ``json``, reading the JSON file (every spec and instance
decoded, the only way JSON reads); ``parquet``, opening the Parquet file (its
header decoded, every spec and instance left as a row); ``parquet + run``,
opening it and decoding as many specs and walked instances as a default
200-request run prices (drawn at random); ``parquet, all``, opening it and
decoding every row. Prints each variant's minimum and median seconds and both
files' sizes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from cdbench.harness.costs.grammar_profile import GrammarProfile, shipped_profiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="xgrammar")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--specs", type=int, default=200, help="specs (and instances) a run decodes")
    args = parser.parse_args()
    parquet = shipped_profiles()[args.backend]
    with tempfile.TemporaryDirectory() as tmp:
        json_path = Path(tmp) / f"{args.backend}.json"
        GrammarProfile.load(parquet).save(json_path)
        profile = GrammarProfile.load(parquet)
        rng = np.random.default_rng(0)
        spec_keys = rng.choice(sorted(profile.specs), min(args.specs, len(profile.specs)), replace=False)
        instance_keys = rng.choice(sorted(profile.instances), min(args.specs, len(profile.instances)), replace=False)

        def lazy() -> None:
            GrammarProfile.load(parquet)

        def run_share() -> None:
            p = GrammarProfile.load(parquet)
            for k in spec_keys:
                p.specs[k]
            for k in instance_keys:
                p.instances[k]

        def everything() -> None:
            p = GrammarProfile.load(parquet)
            for k in p.specs:
                p.specs[k]
            for k in p.instances:
                p.instances[k]

        variants = {"json": lambda: GrammarProfile.load(json_path), "parquet": lazy,
                    f"parquet + run ({args.specs} specs)": run_share, "parquet, all": everything}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, load in variants.items():
                start = time.perf_counter()
                load()
                times[name].append(time.perf_counter() - start)
        print(f"{args.backend}: {len(profile.specs)} specs, {len(profile.instances)} instances; "
              f"{parquet.stat().st_size / 1e6:.2f} MB Parquet, {json_path.stat().st_size / 1e6:.2f} MB JSON")
        for name, seconds in times.items():
            print(f"{name:28s} min {min(seconds) * 1e3:7.1f} ms  median {statistics.median(seconds) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
