"""The scheduler's running batch (struct of arrays) and its per-request counters summed in bulk."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scheduler_helpers import SPEC

from cdbench.harness import tallies
from cdbench.harness.batch import RunningBatch
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.model import FixedGrammarCosts, ModelExecutor
from cdbench.harness.policies import policy
from cdbench.harness.run import simulate
from cdbench.workloads.request import Request


def _batch(n: int = 6) -> RunningBatch:
    entry = np.zeros((len(RunningBatch.INTS), n), np.int64)
    entry[0], entry[1], entry[3] = np.arange(n), 100 + np.arange(n), 10 * np.arange(n)
    return RunningBatch(entry)


def test_append_adds_rows_in_the_given_order_with_their_entry_columns():
    batch = _batch()
    batch.append(np.array([4, 1]))
    batch.append(np.array([2]))
    assert len(batch) == 3
    assert batch.rid.tolist() == [4, 1, 2]
    assert batch.prefill_left.tolist() == [104, 101, 102]
    assert batch.gen_left.tolist() == [40, 10, 20]
    assert batch.cached.tolist() == [0, 0, 0]
    assert np.isnan(batch.last_tok).all()


def test_keep_drops_rows_and_keeps_order_and_last_token_times_exactly():
    batch = _batch()
    batch.append(np.array([5, 0, 3, 2]))
    times = np.array([0.1, 1 / 3, np.nan, 2.5e-7])
    batch.last_tok[:] = times
    batch.cached[:] = [7, 8, 9, 10]
    batch.keep(np.array([1, 2, 3]))
    assert batch.rid.tolist() == [0, 3, 2]
    assert batch.cached.tolist() == [8, 9, 10]
    np.testing.assert_array_equal(batch.last_tok, times[1:])
    assert batch.last_tok.dtype == np.float64


def test_columns_are_views_of_the_batch_and_leave_the_entry_columns_alone():
    batch = _batch()
    batch.append(np.array([1, 2]))
    batch.gen_left[1:] -= 5
    batch.last_tok[0] = 0.5
    batch.keep(np.array([0, 1]))  # a copy of the rows: it must carry the writes above
    assert batch.gen_left.tolist() == [10, 15]
    assert batch.last_tok[0] == 0.5
    batch.append(np.array([2]))  # entered again: as it entered the first time
    assert batch.gen_left.tolist() == [10, 15, 20]
    assert np.isnan(batch.last_tok[2])


def _run(name: str):
    requests = [Request(i, 0.002 * i, 50 + 7 * (i % 5), 3 + i % 11, SPEC if i % 3 else None, "s1" if i % 3 else None,
                        think_len=6 if i % 4 == 0 else 0) for i in range(60)]
    cfg = policy(name, spec_tokens=2, jump_forward=True, max_running_requests=16, cache_hit_s=0.0)
    executor = ModelExecutor(FixedGrammarCosts(compile_time_s=0.005, forced_tokens=1), alpha=0.6)
    return simulate(requests, cfg, executor, FixedGpuCosts(forward_base_s=0.01), seed=1, trace_steps=0)


@pytest.mark.parametrize("name", ["sglang", "vllm"])
def test_counters_summed_every_step_or_once_give_the_same_run(name, monkeypatch):
    once = _run(name)
    monkeypatch.setattr(tallies, "ROWS", 1)
    every_step = _run(name)
    pd.testing.assert_frame_equal(once.requests, every_step.requests, check_exact=True)
    assert once.summary == every_step.summary
    frame = once.requests
    done = frame["abort_reason"] == ""
    assert done.all()
    assert (frame["output_tokens"] == frame["output_len"] + frame["think_tokens"]).all()
    assert frame["drafted"].sum() > 0 and frame["accepted"].sum() > 0 and frame["rolled_back"].sum() > 0
    assert frame["jump_forward_tokens"].sum() > 0
    assert frame["drafted"].sum() == sum(once.summary.drafted_by_position)
