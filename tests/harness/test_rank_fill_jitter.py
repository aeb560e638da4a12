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


def _table_run(table, seed: int = 1):
    requests = [req(i, 0.0, out=30, spec=f"s{i % 3}") for i in range(8)]
    grammar = FixedGrammarCosts(compile_time_s=1e-3, fill_time_s=FILL_S, accept_time_s=0.0, rollback_time_s=0.0)
    return sim(requests, "sglang", gpu=FixedGpuCosts(forward_base_s=1e-4), grammar=grammar, seed=seed, ranks=2,
               parallel="tp", rank_fill_ratios=table, rank_fill_jitter=5.0, host_contention=False, all_gather_s=0.0)


def test_measured_fill_ratios_are_read_from_the_steps_of_about_the_same_fill():
    # short measured fills waited 3x rank 0's, long ones not at all: a priced step takes the ratio of its own size
    short = tuple((1e-2 * (1 + i / 100), 3.0) for i in range(20))
    long = tuple((10.0 * (1 + i / 100), 1.0) for i in range(20))
    assert (_factors(_table_run(short + long)).round(9) == 3.0).all()  # every fill (5-40 ms) is near 10 ms
    swapped = tuple((f, 1.0) for f, _ in short) + tuple((f, 3.0) for f, _ in long)
    # the table replaces the lognormal spread (jitter 5 set beside it)
    assert (_factors(_table_run(swapped)).round(9) == 1.0).all()


def test_measured_fill_ratios_are_drawn_among_the_nearest_steps_and_the_seed_fixes_the_draw():
    table = tuple((FILL_S * (1 + i / 1000), 1.0 + i) for i in range(8))  # eight neighbours, eight ratios
    one, again, other = _table_run(table), _table_run(table), _table_run(table, seed=2)
    factors = _factors(one).round(9)
    assert set(factors) <= {1.0 + i for i in range(8)} and factors.nunique() > 3
    assert _factors(again).tolist() == _factors(one).tolist()
    assert _factors(other).tolist() != _factors(one).tolist()
