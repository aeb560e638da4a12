"""Hybrid mode's own overhead: the share of wall time spent outside grammar-backend calls.

Run from the repository root::

    python benchmarks/bench_hybrid_overhead.py --requests 300 --vocab cl100k [--repeat 5]

Structured JSON requests (distinct instances of one schema, one compile) and a
quarter unconstrained ones, arriving at 200/s, through the real xgrammar
backend; prints wall time, time inside backend calls, output-validation time
and the share of wall time outside backend calls (validation counted as
outside: it is cdbench's work), for each policy, with and without speculative
decoding (k = 3, alpha = 0.6). A compile-free stress case: every step is
hundreds of sub-20 µs fills, so cdbench's own per-step and per-request work
weighs the most here.

``--default-run N`` instead runs the built-in default config (``cdbench run``:
hybrid, xgrammar, the embedded sample, Qwen3.6 vocabulary) with ``N`` requests
and prints the same numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

from cdbench.backends import create_backend
from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import load_vocab
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.hybrid import HybridExecutor
from cdbench.harness.policies import policy
from cdbench.harness.run import simulate
from cdbench.workloads.request import Request

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "cdbench" / "configs" / "default.yaml"
SCHEMA = {"type": "object", "required": ["id", "name", "tags", "address"],
          "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                                      "zip": {"type": "string"}}}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--vocab", default="cl100k")
    parser.add_argument("--default-run", type=int, default=None, metavar="N",
                        help="run the built-in default config with N requests instead")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each case (the median share is printed "
                        "too: the host's noise moves one run's share by a few points)")
    args = parser.parse_args()
    if args.default_run is not None:
        default_run(args.default_run)
        return
    vocab = load_vocab(args.vocab)
    backend = create_backend("xgrammar", vocab)
    eos = vocab.eos_token_ids[0]
    requests = []
    for i in range(args.requests):
        if i % 4 == 3:
            requests.append(Request(i, i / 200, 300, 60))
            continue
        text = json.dumps({"id": i, "name": f"item number {i}", "tags": ["a", f"tag {i % 7}"],
                           "address": {"city": f"City {i % 13}", "zip": f"{10000 + i}"}})
        tokens = tuple(vocab.encode(text)) + (eos,)
        requests.append(Request(i, i / 200, 300, len(tokens), ConstraintSpec("json_schema", SCHEMA), "item", tokens))
    shares: dict[str, list[float]] = {}
    for _ in range(args.repeat):  # cases interleaved, so a noisy spell of the host hits them alike
        for name in ("sglang", "vllm"):
            for k in (0, 3):
                result = simulate(requests, policy(name, spec_tokens=k), HybridExecutor(backend, alpha=0.6, seed=0),
                                  FixedGpuCosts(forward_base_s=0.02), seed=0, trace_steps=0)
                case = f"{name:6s} k={k}"
                shares.setdefault(case, []).append(result.outside_backend_share)
                print(f"{case} wall_s={result.wall_s:.3f} backend_s={result.backend_call_s:.3f} "
                      f"validation_s={result.validation_s:.3f} outside_share={result.outside_backend_share:.3f} "
                      f"valid={result.summary.validity_rate} steps={result.summary.steps}")
    if args.repeat > 1:
        for case, values in shares.items():
            print(f"{case} median outside_share={statistics.median(values):.3f} "
                  f"(runs: {', '.join(f'{v:.3f}' for v in values)})")


def default_run(n: int) -> None:
    from cdbench.harness.config import RunConfig
    from cdbench.harness.run import run

    config = RunConfig.model_validate(yaml.safe_load(DEFAULT_CONFIG.read_text()))
    config = config.model_copy(update={"workload": config.workload.model_copy(update={"num_requests": n})})
    result = run(config)
    s = result.summary
    print(f"default config, {n} requests: wall_s={result.wall_s:.3f} backend_s={result.backend_call_s:.3f} "
          f"validation_s={result.validation_s:.3f} outside_share={result.outside_backend_share:.3f} "
          f"valid={s.validity_rate} completed={s.completed} mask_row_p99_us={s.mask_row_p99_us:.0f}")


if __name__ == "__main__":
    main()
