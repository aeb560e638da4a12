"""Speed of ``model`` mode: simulate N requests (512 prompt + 200 output tokens) with every mechanism on.

Run from the repository root (one core)::

    taskset -c 0 python benchmarks/bench_scheduler.py --requests 100000

Mechanisms on: half the requests structured over 2,000 specs with Zipf
popularity (compile pool, cache with its policy's write/de-dup rules, failed
specs), SGLang's blocking poll with 2 ranks (jitter, all_gather) or vLLM's
checks, continuous batching with chunked prefill, overlap, speculative
decoding (k = 3, alpha = 0.7), thinking on a fifth of the requests with a
budget, strict thinking, and jump-forward. Grammar costs come from a backend
profile (``--profile``: a profile JSON; by default a synthetic lognormal
profile built here), GPU costs from the roofline model and the H200 mask table; with ``--spec-store DIR``,
each spec is priced from that spec-cost store as a model run prices it (measured on demand the first time:
the cold cost). Prints start-up time (building requests and the scheduler), simulation time
and the simulated throughput.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402

import numpy as np  # noqa: E402

from cdbench.backends.base import ConstraintSpec  # noqa: E402
from cdbench.harness.costs.forward import ForwardCostModel  # noqa: E402
from cdbench.harness.costs.gpu import RooflineGpuCosts  # noqa: E402
from cdbench.harness.costs.grammar_profile import (  # noqa: E402
    CompileMeasurement,
    GrammarProfile,
    WalkMeasurement,
)
from cdbench.harness.costs.mask import MaskCost  # noqa: E402
from cdbench.harness.costs.spec_costs import SpecCostSettings, price_specs  # noqa: E402
from cdbench.harness.executors.model import ModelExecutor, ProfileGrammarCosts  # noqa: E402
from cdbench.harness.policies import policy  # noqa: E402
from cdbench.harness.run import simulate  # noqa: E402
from cdbench.workloads.request import Request  # noqa: E402

IMPORT_S = time.perf_counter() - _T0


def synthetic_profile(seed: int = 0) -> GrammarProfile:
    """A profile with xgrammar-like magnitudes (compile ~tens of ms, fill ~tens of µs, heavy tail)."""
    rng = np.random.default_rng(seed)
    compiles = [CompileMeasurement(f"c{i}", "json_schema", "ok" if i % 50 else "error",
                                   float(rng.lognormal(np.log(0.03), 0.8))) for i in range(400)]
    walks = [WalkMeasurement(f"c{i}", "json_schema", fill_s=rng.lognormal(np.log(2e-5), 0.7, 200),
                             accept_s=rng.lognormal(np.log(3e-6), 0.3, 200),
                             rollback_s=rng.lognormal(np.log(8e-6), 0.3, 50),
                             forced_tokens=np.where(rng.random(200) < 0.1, rng.integers(1, 5, 200), 0))
             for i in range(40)]
    return GrammarProfile.from_measurements("synthetic", "cl100k", compiles, walks)


def workload(n: int, rate: float, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    structured = rng.random(n) < 0.5
    spec_ids = np.minimum(rng.zipf(1.2, n), 2000)
    thinking = rng.random(n) < 0.2
    think_len = np.where(thinking, rng.integers(20, 120, n), 0)
    specs = {k: ConstraintSpec("json_schema", {"type": "object", "title": f"schema-{k}"}) for k in np.unique(spec_ids)}
    return [Request(i, float(arrivals[i]), 512, 200, specs[spec_ids[i]] if structured[i] else None,
                    f"schema-{spec_ids[i]}" if structured[i] else None, None, int(think_len[i]),
                    64 if thinking[i] else None)
            for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=40.0,
                        help="Poisson arrivals per second (about 93 %% of the simulated server's capacity)")
    parser.add_argument("--policy", default="sglang", choices=["sglang", "vllm"])
    parser.add_argument("--profile", default=None, help="grammar profile JSON (default: synthetic)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spec-store", default=None,
                        help="price every spec from this spec-cost store as model runs do (xgrammar, cl100k), "
                             "measuring what it lacks; the pricing time is printed apart (cold: measuring)")
    args = parser.parse_args()

    t0 = time.perf_counter()
    requests = workload(args.requests, args.rate, args.seed)
    profile = GrammarProfile.load(args.profile) if args.profile else synthetic_profile(args.seed)
    cfg = policy(args.policy, ranks=2, rank_jitter=0.2, spec_tokens=3, strict_thinking=True, jump_forward=True,
                 max_running_requests=512, schedule_s=2e-4, process_row_s=2e-6)
    gpu = RooflineGpuCosts(ForwardCostModel("llama-3.1-8b", "h200"), MaskCost.for_gpu("h200", vocab_size=100_277))
    pricing = ""
    if args.spec_store:
        t_price = time.perf_counter()
        profile, coverage = price_specs(profile, "xgrammar", {}, "cl100k", requests,
                                        SpecCostSettings(spec_store=args.spec_store))
        pricing = (f"pricing_s={time.perf_counter() - t_price:.2f} (measured {coverage.measured_now} specs in "
                   f"{coverage.measure_wall_s:.1f} s) ")
    executor = ModelExecutor(ProfileGrammarCosts(profile, args.seed), alpha=0.7)
    startup = time.perf_counter() - t0

    t1, c1 = time.perf_counter(), time.process_time()
    result = simulate(requests, cfg, executor, gpu, seed=args.seed, trace_steps=0)
    elapsed, cpu = time.perf_counter() - t1, time.process_time() - c1
    s = result.summary
    print(f"policy={args.policy} requests={args.requests} rate={args.rate}/s")
    print(f"import_s={IMPORT_S:.2f} startup_s={startup:.2f} {pricing}simulate_s={elapsed:.2f} cpu_s={cpu:.2f} "
          f"({args.requests / elapsed:.0f} simulated requests per wall second)")
    print(f"steps={s.steps} idle_iterations={s.idle_iterations} completed={s.completed} failed={s.failed} "
          f"output_tokens={s.total_output_tokens}")
    print(f"virtual duration={s.duration:.1f}s request_throughput={s.request_throughput:.1f}/s "
          f"mean_ttft_ms={s.mean_ttft_ms:.1f} mean_tpot_ms={s.mean_tpot_ms:.2f} cache_hit_rate={s.cache_hit_rate:.3f} "
          f"rollback_rate={s.rollback_rate:.3f} jump_forward_tokens={s.jump_forward_tokens} "
          f"mask_share={s.mask_share:.3f}")


if __name__ == "__main__":
    main()
