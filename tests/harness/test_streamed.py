"""A run's records streamed to disk give the summary the in-memory tables give, value for value; the
exact streamed statistics equal numpy's; time windows add up to the whole run."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scheduler_helpers import SPEC

from cdbench.harness import streamed
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.model import FixedGrammarCosts, ModelExecutor
from cdbench.harness.metrics import SLO
from cdbench.harness.policies import policy
from cdbench.harness.run import simulate
from cdbench.harness.streamed import (
    Column,
    _Chunks,
    count,
    median,
    order_statistics,
    pairwise_sum,
    percentiles,
)
from cdbench.harness.windows import time_windows
from cdbench.results.stopped_run import RecordSpill
from cdbench.workloads.request import Request


def _column(values: np.ndarray, size: int) -> Column:
    return Column(_Chunks(values, size), "t", ("v",), lambda chunk: chunk["v"].to_numpy())


@pytest.mark.parametrize("n", [1, 2, 3, 8, 129, 1000, 70_001, 300_017])
@pytest.mark.parametrize("size", [1, 997, 1 << 16])
def test_streamed_sums_and_quantiles_equal_numpys_bit_for_bit(n, size, monkeypatch):
    if size == 1 and n > 1000:
        pytest.skip("one value a chunk: slow and covered by the smaller sizes")
    monkeypatch.setattr(streamed, "LEAF", 1 << 10)  # several levels of numpy's pairwise tree above the leaves
    rng = np.random.default_rng(n)
    values = np.round(rng.lognormal(0, 2, n), 3)  # rounded: ties, so ranks fall inside runs of equal values
    values[: n // 3] *= -1
    column = _column(values, size)
    assert count(column) == n
    assert pairwise_sum(column, n) == np.add.reduce(values)
    assert pairwise_sum(column, n, lambda v: v * v) == np.add.reduce(values * values)
    assert percentiles(column, n, (0, 50, 90, 99, 99.9, 100)) == list(np.percentile(values, [0, 50, 90, 99, 99.9, 100]))
    assert median(column, n) == np.median(values)


def test_order_statistics_narrow_a_crowded_prefix_over_several_passes(monkeypatch):
    monkeypatch.setattr(streamed, "SELECT_LIMIT", 100)  # every rank needs passes beyond the first 16 bits
    values = 1.0 + np.random.default_rng(0).random(50_000) * 1e-9  # one exponent: the top bits all agree
    ranks = [0, 1, 24_999, 49_999]
    found = order_statistics(_column(values, 4096), len(values), ranks)
    assert [found[r] for r in ranks] == np.sort(values)[ranks].tolist()


def _requests(n: int) -> list[Request]:
    rng = np.random.default_rng(3)
    arrivals = np.cumsum(rng.exponential(0.05, n))
    out = rng.integers(1, 60, n)
    return [Request(i, float(arrivals[i]), int(rng.integers(10, 400)), int(out[i]),
                    SPEC if i % 3 else None, f"s{i % 40}" if i % 3 else None) for i in range(n)]


def _run(tmp_path, records: RecordSpill | None, engine: str = "sglang", **overrides):
    grammar = FixedGrammarCosts(compile_time_s=0.03, failing_keys=["s7"], fill_time_s=4e-5)
    return simulate(_requests(3000), policy(engine, spec_tokens=2, **overrides), ModelExecutor(grammar, alpha=0.6),
                    FixedGpuCosts(forward_base_s=0.008), slo=SLO(ttft_ms=60, tpot_ms=12), trace_steps=0,
                    records=records)


def test_a_streamed_run_writes_the_in_memory_tables_and_summary(tmp_path):
    in_memory = _run(tmp_path, None)
    spill = RecordSpill(tmp_path, interval_s=0.0)  # a hand-over every few hundred iterations
    streamed_run = _run(tmp_path, spill)
    assert streamed_run.tables_written and spill.parts > 2
    # (JSON: NaN as null, so equal values compare equal)
    assert streamed_run.summary.model_dump_json() == in_memory.summary.model_dump_json()
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "requests.parquet"), in_memory.requests)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "steps.parquet"), in_memory.steps)
    assert not (tmp_path / "requests.partial").exists() and not (tmp_path / "steps.partial").exists()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_streamed_run_under_kv_pressure_has_the_in_memory_kv_figures(tmp_path, engine):
    """Preemptions, retractions, recomputed tokens, utilisation and waits for memory, summed from the streamed
    tables, equal the in-memory summary's."""
    in_memory = _run(tmp_path, None, engine, kv_tokens=700)
    assert in_memory.summary.kv_preemptions + in_memory.summary.kv_retractions > 0
    streamed_run = _run(tmp_path, RecordSpill(tmp_path, interval_s=0.0), engine, kv_tokens=700)
    assert streamed_run.summary.model_dump_json() == in_memory.summary.model_dump_json()


def test_time_windows_add_up_to_the_whole_run(tmp_path):
    result = _run(tmp_path, None)
    summary, windows = result.summary, result.summary.time_windows
    assert windows is not None and windows.window_s == 60.0 and len(windows.windows) > 1
    rows = windows.windows
    assert sum(w.requests for w in rows) == len(result.requests)
    assert sum(w.completed for w in rows) == summary.completed
    assert sum(w.failed for w in rows) == summary.failed
    assert sum(w.output_tokens for w in rows) == summary.total_output_tokens
    assert sum(w.good for w in rows) == pytest.approx(summary.request_goodput * summary.duration)
    # each window's latency is exact over its own requests
    done = result.requests[result.requests["abort_reason"] == ""]
    first = done[done["issued_s"] < 60.0]
    assert rows[0].p99_ttft_ms == np.percentile((first["first_token_s"] - first["issued_s"]) * 1e3, 99)


def test_windows_are_hours_past_six_hours():
    frame = pd.DataFrame({"issued_s": [10.0, 7 * 3600.0], "first_token_s": [11.0, 7 * 3600.0 + 1],
                          "finish_s": [12.0, math.nan], "output_tokens": [4, 0],
                          "abort_reason": pd.Categorical(["", "compile_error"])})
    windows = time_windows(frame)
    assert windows.window_s == 3600.0
    assert [(w.start_s, w.completed, w.failed, w.p99_ttft_ms) for w in windows.windows] == [
        (0.0, 1, 0, 1000.0), (7 * 3600.0, 0, 1, None)]
