"""Benchmark: expanding a 100,000-request workload over the JSONSchemaBench files.

    taskset -c 0 python benchmarks/bench_workload_generation.py [--requests 100000] [--repeat 3]
    pytest benchmarks/bench_workload_generation.py --benchmark-enable

The first pass fills the instance-pool cache (reported separately); the timed
passes then measure generation with cached pools: corpus loading, spec
choice, arrivals, lengths and request construction. Needs the shared corpus.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cdbench.backends.vocab import load_vocab
from cdbench.workloads.config import WorkloadConfig
from cdbench.workloads.corpora import known_corpora
from cdbench.workloads.generator import generate


def jsonschemabench_config(requests: int) -> WorkloadConfig:
    names = [n for n in known_corpora() if n.startswith("jsonschemabench_")]
    if not names:
        raise SystemExit("the shared JSONSchemaBench corpora are not found (set CDBENCH_CORPORA)")
    return WorkloadConfig(num_requests=requests, seed=0, corpus=names, structured_ratio=1.0,
                          arrival={"process": "poisson", "rate": 100.0},
                          prompt_len={"dist": "lognormal", "median": 500, "sigma": 0.5})


def test_generate_100k_cached(benchmark):
    import pytest

    if not [n for n in known_corpora() if n.startswith("jsonschemabench_")]:
        pytest.skip("shared corpora absent")
    vocab = load_vocab("qwen3.6")
    config = jsonschemabench_config(100_000)
    generate(config, vocab, progress=False)  # fills the pool cache
    workload = benchmark.pedantic(generate, args=(config, vocab), kwargs={"progress": False}, rounds=3)
    assert len(workload.requests) == 100_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--vocab", default="qwen3.6")
    args = parser.parse_args()
    vocab = load_vocab(args.vocab)
    config = jsonschemabench_config(args.requests)
    start = time.perf_counter()
    warm = generate(config, vocab)
    print(f"first pass (fills the pool cache where empty): {time.perf_counter() - start:.1f} s; "
          f"{len(warm.requests)} requests, {len(warm.failures)} specs without a valid instance")
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        workload = generate(config, vocab, progress=False)
        times.append(time.perf_counter() - start)
    assert workload.requests == warm.requests, "cached pass differs from the first pass"
    print(f"cached passes ({args.requests} requests, vocab {args.vocab}): "
          f"median {statistics.median(times):.2f} s, min {min(times):.2f} s, max {max(times):.2f} s")


if __name__ == "__main__":
    main()
