"""The scheduler iteration's phases on their own: readiness, batch forming, tallies (and their examples)."""

from __future__ import annotations

import doctest
import importlib
import math
from collections import deque

import numpy as np
import pytest

from cdbench.harness.admission import BatchFormer
from cdbench.harness.batch import RunningBatch
from cdbench.harness.policies import policy
from cdbench.harness.readiness import blocking_poll, blocking_poll_one_rank
from cdbench.harness.records import DraftPositionCounts, RequestTable
from cdbench.harness.tallies import ROWS, StepTallies


@pytest.mark.parametrize("name", ["readiness", "tallies"])
def test_module_examples_run(name):
    module = importlib.import_module(f"cdbench.harness.{name}")
    assert doctest.testmod(module).failed == 0


@pytest.mark.parametrize("early_exit, expected_s", [(True, 0.003), (False, 0.004)])
def test_blocking_poll_leaves_at_the_check_that_sees_every_rank_done(early_exit, expected_s):
    cfg = policy("sglang", poll_interval_s=0.004, poll_naps=4, ranks=2, poll_early_exit=early_exit)
    # request 0 done on both ranks by the third check; request 1's second rank only after the poll
    poll_s, seen = blocking_poll(np.array([[0.0015, 0.0025], [0.001, 0.009]]), 0.0, cfg)
    assert seen.tolist() == [[True, True], [True, False]]
    assert poll_s == pytest.approx(0.004)  # a rank that never saw one waits the whole interval
    poll_s, _ = blocking_poll(np.array([[0.0015, 0.0025]]), 0.0, cfg)
    assert poll_s == pytest.approx(expected_s)


@pytest.mark.parametrize("early_exit", [True, False])
def test_a_one_rank_poll_in_python_scalars_is_the_poll_of_arrays_bit_for_bit(early_exit):
    """The scheduler polls a queue of a few requests on one rank in Python scalars: the same seconds and sightings,
    for compiles done before the poll (just before: numpy's ceil gives -0.0 there), during it, after it, never."""
    cfg = policy("sglang", poll_interval_s=0.005, poll_naps=10, poll_early_exit=early_exit)
    rng = np.random.default_rng(3)
    for trial in range(3000):
        q = int(rng.integers(1, 9))
        t0 = float(rng.random() * 100)
        done = t0 + rng.choice([-1.0, 1.0], q) * rng.random(q) * rng.choice([1e-4, 1e-3, 1e-2], q)
        if trial % 7 == 0:
            done[0] = t0 - 0.0005 * rng.random()
        if trial % 11 == 0:
            done[-1] = math.inf
        poll_s, seen = blocking_poll(done[:, None], t0, cfg)
        scalar_s, scalar_seen = blocking_poll_one_rank(done.tolist(), t0, cfg)
        assert np.float64(scalar_s).tobytes() == np.float64(poll_s).tobytes()
        assert scalar_seen == seen[:, 0].tolist()


def test_tallies_sum_every_step_across_flushes():
    table = RequestTable(4)
    positions = DraftPositionCounts(2)
    tallies = StepTallies(table, positions, jump_forward=True)
    rng = np.random.default_rng(0)
    expected = np.zeros((5, 4), np.int64)
    rows_added = 0
    while rows_added < ROWS + 100:  # past one flush
        rid = rng.integers(0, 4, 500)
        drafted = rng.integers(0, 3, 500)
        accepted = np.minimum(drafted, rng.integers(0, 3, 500))
        counters = [rid, accepted + 1, drafted, accepted, drafted - accepted, rng.integers(0, 2, 500)]
        tallies.add(counters, len(rid))
        for column, values in zip(expected, counters[1:]):
            np.add.at(column, rid, values)
        rows_added += len(rid)
    tallies.flush()
    got = [table.output_tokens, table.drafted, table.accepted, table.rolled_back, table.jump_forward_tokens]
    assert np.array_equal(np.array(got), expected)
    assert positions.rows == rows_added


def _former(prompts: list[int], ready_at: list[float], **overrides) -> tuple[BatchFormer, deque[int], RequestTable]:
    n = len(prompts)
    cfg = policy("vllm", schedule_row_s=0.0, **overrides)
    rec = RequestTable(n)
    rec.prompt_len[:] = prompts
    rec.output_len[:] = 4
    rec.structured[:] = True
    entry = np.zeros((len(RunningBatch.INTS), n), np.int64)
    entry[0], entry[1], entry[3] = np.arange(n), rec.prompt_len, 4
    waiting = deque(range(n))

    def check(rid: int, t: float) -> tuple[bool, float]:
        return (ready_at[rid] <= t, 0.0)

    def release(rid: int, t: float) -> bool:
        rec.grammar_ready_s[rid] = t
        return True

    return BatchFormer(cfg, rec, RunningBatch(entry), waiting, check, release), waiting, rec


def test_admission_chunks_the_prompt_the_budget_reaches_and_passes_an_unready_grammar():
    former, waiting, rec = _former([300, 300, 500], [0.0, math.inf, 0.0], max_batched_tokens=600)
    plan = former.form(1.0, 1.0, 0.0, 0.0, 0.0, 0.0)
    assert plan.runs and plan.pf_chunks.tolist() == [300, 300]  # request 2's prompt runs a chunk of 300
    assert former.batch.rid.tolist() == [0, 2]
    assert list(waiting) == [1]  # kept its place, passed by request 2
    assert plan.first_rows.tolist() == [0]  # only request 0's prompt completes: it alone samples
    assert plan.s_rid.tolist() == [0]
    assert rec.admitted_s[[0, 2]].tolist() == [1.0, 1.0]


def test_nothing_to_run_forms_an_idle_plan_with_the_loop_time():
    former, waiting, _ = _former([100], [math.inf])
    plan = former.form(0.0, 2.0, 0.001, 0.002, 0.0, 0.0)
    assert not plan.runs and plan.pre == pytest.approx(0.003) and list(waiting) == [0]
