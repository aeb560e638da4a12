"""scheduler.rank_fill_jitter and rank_fill_offset: each tensor-parallel rank fills its own masks, and a step waits
for the slowest; the grammar costs price rank 0's fill, so a step pays max(1, another rank's fill over rank 0's)."""

from __future__ import annotations

import pytest
from scheduler_helpers import req, sim

from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.model import FixedGrammarCosts

FILL_S = 5e-3


def _fill_bound_run(jitter: float, ranks: int = 2, parallel: str = "tp", seed: int = 1, offset: float = 0.0):
    # fills far longer than the forward: a step's time is its (slowest rank's) fill
    requests = [req(i, 0.0, out=30, spec=f"s{i % 3}") for i in range(8)]
    grammar = FixedGrammarCosts(compile_time_s=1e-3, fill_time_s=FILL_S, accept_time_s=0.0, rollback_time_s=0.0)
    return sim(requests, "sglang", gpu=FixedGpuCosts(forward_base_s=1e-4), grammar=grammar, seed=seed, ranks=ranks,
               parallel=parallel, rank_fill_jitter=jitter, rank_fill_offset=offset, host_contention=False,
               all_gather_s=0.0)


def _factors(run):
    busy = run.steps[run.steps["grammar_rows"] > 0]
    return busy["fill_s"] / (busy["grammar_rows"] * FILL_S)


def test_tensor_parallel_steps_wait_for_the_slowest_ranks_fill():
    plain, jittered = _fill_bound_run(0.0), _fill_bound_run(1.0)
    factor = _factors(jittered)
    # max(1, lognormal(0, 1)): rank 0 (the priced fill) is the slower in about half the steps, a new draw each step
    assert (factor >= 1.0).all() and (factor == 1.0).mean() == pytest.approx(0.5, abs=0.15)
    assert factor[factor > 1.0].nunique() == (factor > 1.0).sum()
    assert (plain.steps.loc[plain.steps["grammar_rows"] > 0, "fill_s"]
            == plain.steps.loc[plain.steps["grammar_rows"] > 0, "grammar_rows"] * FILL_S).all()
    assert jittered.summary.duration > 1.4 * plain.summary.duration
    again = _fill_bound_run(1.0)
    assert again.steps["fill_s"].tolist() == jittered.steps["fill_s"].tolist()  # the seed fixes the draws


@pytest.mark.parametrize("ranks,parallel", [(1, "tp"), (2, "dp")])
def test_ranks_that_do_not_wait_for_each_other_pay_no_fill_spread(ranks, parallel):
    plain, jittered = _fill_bound_run(0.0, ranks, parallel), _fill_bound_run(1.0, ranks, parallel)
    assert jittered.steps["fill_s"].tolist() == plain.steps["fill_s"].tolist()


def test_a_rank_that_fills_faster_than_rank_zero_costs_the_step_nothing():
    # the profile prices rank 0's fill; the other rank's is always shorter: the step waits for rank 0 alone
    faster = _fill_bound_run(0.1, offset=-3.0)
    assert (_factors(faster) == 1.0).all()


def test_a_rank_that_fills_slower_sets_the_step_and_more_ranks_wait_longer():
    slower = _factors(_fill_bound_run(0.0, offset=0.5))
    assert slower.to_numpy() == pytest.approx(1.6487, rel=1e-4)  # exp(0.5): no spread, a fixed slower rank
    two, four = _factors(_fill_bound_run(0.5)), _factors(_fill_bound_run(0.5, ranks=4))
    assert four.mean() > two.mean() > 1.0  # the slowest of three other ranks against one
