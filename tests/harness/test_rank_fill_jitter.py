"""scheduler.rank_fill_jitter: each tensor-parallel rank fills its own masks, and a step waits for the slowest."""

from __future__ import annotations

import pytest
from scheduler_helpers import req, sim

from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.model import FixedGrammarCosts

FILL_S = 5e-3


def _fill_bound_run(jitter: float, ranks: int = 2, parallel: str = "tp", seed: int = 1):
    # fills far longer than the forward: a step's time is its (slowest rank's) fill
    requests = [req(i, 0.0, out=30, spec=f"s{i % 3}") for i in range(8)]
    grammar = FixedGrammarCosts(compile_time_s=1e-3, fill_time_s=FILL_S, accept_time_s=0.0, rollback_time_s=0.0)
    return sim(requests, "sglang", gpu=FixedGpuCosts(forward_base_s=1e-4), grammar=grammar, seed=seed, ranks=ranks,
               parallel=parallel, rank_fill_jitter=jitter, host_contention=False, all_gather_s=0.0)


def test_tensor_parallel_steps_wait_for_the_slowest_ranks_fill():
    plain, jittered = _fill_bound_run(0.0), _fill_bound_run(1.0)
    busy = jittered.steps[jittered.steps["grammar_rows"] > 0]
    factor = busy["fill_s"] / (busy["grammar_rows"] * FILL_S)
    # the slowest of two lognormal(0, 1) factors: median exp(0.545) = 1.72, a new draw each step
    assert factor.median() == pytest.approx(1.72, rel=0.2) and factor.nunique() > len(busy) // 2
    assert (plain.steps.loc[plain.steps["grammar_rows"] > 0, "fill_s"]
            == plain.steps.loc[plain.steps["grammar_rows"] > 0, "grammar_rows"] * FILL_S).all()
    assert jittered.summary.duration > 1.4 * plain.summary.duration
    again = _fill_bound_run(1.0)
    assert again.steps["fill_s"].tolist() == jittered.steps["fill_s"].tolist()  # the seed fixes the draws


@pytest.mark.parametrize("ranks,parallel", [(1, "tp"), (2, "dp")])
def test_ranks_that_do_not_wait_for_each_other_pay_no_fill_spread(ranks, parallel):
    plain, jittered = _fill_bound_run(0.0, ranks, parallel), _fill_bound_run(1.0, ranks, parallel)
    assert jittered.steps["fill_s"].tolist() == plain.steps["fill_s"].tolist()
