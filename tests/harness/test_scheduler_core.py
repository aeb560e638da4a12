"""The discrete-event core, compile pools and cache, metrics, and determinism of whole runs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError
from scheduler_helpers import SPEC

from cdbench.harness.compile_service import CompilePools, GrammarCache
from cdbench.harness.costs.forward import ForwardCostModel
from cdbench.harness.costs.gpu import RooflineGpuCosts
from cdbench.harness.costs.grammar_profile import (
    CompileMeasurement,
    GrammarProfile,
    WalkMeasurement,
)
from cdbench.harness.costs.mask import MaskCost
from cdbench.harness.events import EventKind, EventQueue
from cdbench.harness.executors.model import ModelExecutor, ProfileGrammarCosts
from cdbench.harness.metrics import LogHistogram
from cdbench.harness.policies import policy
from cdbench.harness.records import REQUEST_COLUMNS, STEP_COLUMNS
from cdbench.harness.run import simulate
from cdbench.workloads.request import Request


def test_events_pop_by_time_then_kind_then_insertion():
    q = EventQueue()
    q.push(1.0, EventKind.ITERATION, "it")
    q.push(1.0, EventKind.ARRIVAL, "a1")
    q.push(0.5, EventKind.ITERATION, "early")
    q.push(1.0, EventKind.ARRIVAL, "a2")
    assert [q.pop()[2] for _ in range(4)] == ["early", "a1", "a2", "it"]
    assert q.now == 1.0
    with pytest.raises(ValueError, match="before the clock"):
        q.push(0.9, EventKind.ARRIVAL)


def test_compile_pool_is_fifo_over_its_threads():
    pools = CompilePools(ranks=2, threads=2, scale=(1.0, 3.0))
    rng = np.random.default_rng(0)
    ends = [pools.submit(0.0, 1.0, rng)[1] for _ in range(3)]
    assert [e.tolist() for e in ends] == [[1.0, 3.0], [1.0, 3.0], [2.0, 6.0]]


def test_cache_lru_capacity_and_negative_entries():
    cache = GrammarCache(True, "harvest", dedup=False, capacity=1, cache_failures=True)
    cache.submitted(1, np.array([0.1]), ok=True)
    assert cache.lookup(1, 5.0)[0] == "miss"  # finished but not harvested yet
    cache.harvested(1, ok=True)
    assert cache.lookup(1, 5.0)[0] == "hit"
    cache.timed_out(2)
    assert cache.lookup(2, 5.0)[0] == "invalid"
    assert cache.lookup(1, 5.0)[0] == "miss"  # evicted by the invalid entry (capacity 1)
    off = GrammarCache(False, "compile", dedup=True)
    off.submitted(1, np.array([0.1]), ok=True)
    assert off.lookup(1, 5.0)[0] == "miss"


def test_log_histogram_quantiles_within_a_bin():
    h = LogHistogram()
    values = np.random.default_rng(0).lognormal(-5, 1, 100_000)
    h.add(values)
    for q in (0.5, 0.9, 0.99):
        assert h.quantile(q) == pytest.approx(np.quantile(values, q), rel=0.015)
    assert h.mean() == pytest.approx(values.mean())


def test_log_histogram_sums_each_flush_in_its_kept_buffers_as_a_joined_array(monkeypatch):
    """Flushes of fewer values after larger ones (buffers kept, longer than the values) and weighted
    values count and sum exactly what binning each flush's values joined anew counts and sums."""
    monkeypatch.setattr(LogHistogram, "BUFFER", 1000)
    rng = np.random.default_rng(1)
    h, expected_counts, total, sq_total, weight = LogHistogram(), np.zeros(len(LogHistogram().counts)), 0.0, 0.0, 0.0
    for size in (1500, 300, 1200, 40):
        values, weights = rng.lognormal(-5, 1, size), rng.integers(1, 5, size)
        h.add(values[:size // 2])
        h.add(values[size // 2:])
        h._flush()
        h.add(values, weights)
        h._flush()
        bins = np.minimum(((np.log10(np.maximum(values, 1e-7)) + 7) * 200).astype(np.int64), len(h.counts) - 1)
        expected_counts += np.bincount(bins, minlength=len(h.counts)) + np.bincount(bins, weights,
                                                                                   minlength=len(h.counts))
        total += float(values.sum()) + float(np.add.reduce(values * weights))
        sq_total += float(np.add.reduce(values * values)) + float(np.add.reduce(values * values * weights))
        weight += size + float(weights.sum())
    assert (h.counts == expected_counts).all()
    assert (h.total, h.sq_total, h.weight) == (total, sq_total, weight)


def test_policy_overrides_are_validated():
    assert policy("vllm", compile_threads=3).compile_threads == 3
    with pytest.raises(KeyError, match="unknown scheduler policy 'tgi'"):
        policy("tgi")
    with pytest.raises(ValidationError, match="poll_intervall"):
        policy("sglang", poll_intervall=1)
    with pytest.raises(ValidationError, match="rank_compile_scale has 1 factors for 2 ranks"):
        policy("sglang", ranks=2, rank_compile_scale=(1.0,))


def _profile() -> GrammarProfile:
    rng = np.random.default_rng(1)
    compiles = [CompileMeasurement(f"c{i}", "regex", "ok" if i % 10 else "error", float(rng.lognormal(-4, 1)))
                for i in range(50)]
    walks = [WalkMeasurement(f"c{i}", "regex", fill_s=rng.lognormal(-11, 0.5, 50), accept_s=np.full(50, 2e-6),
                             rollback_s=np.full(5, 5e-6), forced_tokens=rng.integers(0, 3, 50)) for i in range(5)]
    return GrammarProfile.from_measurements("test", "cl100k", compiles, walks)


def _workload(seed: int, n: int = 300) -> list[Request]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(0.01, n))
    return [Request(i, float(arrivals[i]), int(rng.integers(50, 600)), int(rng.integers(5, 60)),
                    SPEC if i % 3 else None, f"c{rng.integers(0, 40)}" if i % 3 else None, None,
                    int(rng.integers(0, 30)) if i % 5 == 0 else 0, 10 if i % 10 == 0 else None)
            for i in range(n)]


def _model_run(name: str, seed: int):
    cfg = policy(name, ranks=2, rank_jitter=0.3, spec_tokens=2, jump_forward=True, strict_thinking=True,
                 max_running_requests=64, max_batched_tokens=2048)
    gpu = RooflineGpuCosts(ForwardCostModel("llama-3.1-8b", "h200"), MaskCost.for_gpu("h200", vocab_size=100_277))
    executor = ModelExecutor(ProfileGrammarCosts(_profile(), seed), alpha=0.7)
    return simulate(_workload(seed), cfg, executor, gpu, seed=seed, trace_steps=100)


def test_a_release_fill_scale_multiplies_every_fill_and_leaves_the_accepts():
    """``fill_scale`` (costs.grammar_fill_scale): the fills of a step of many rows, of a lone row, of a decode
    run and of drafted rows (less their drafts' accepts) times the scale; accepts as they were."""
    from cdbench.harness.executors.base import SpecKeys, StepRows

    requests = [Request(i, r.arrival_s, r.prompt_len, r.output_len, r.spec, r.spec_id)
                for i, r in enumerate(r for r in _workload(5, 120) if r.spec is not None)]
    n = len(requests)
    every, grammar, none = np.arange(n), np.ones(n, bool), np.zeros(n, np.int64)
    left = np.array([r.output_len for r in requests])
    work = {}
    for scale in (1.0, 3.0):
        executor = ModelExecutor(ProfileGrammarCosts(_profile(), 7, fill_scale=scale))
        executor.prepare(requests, SpecKeys.of(requests), n, drafts=True)
        for rid in every:
            executor.arrive(int(rid))
        rng = np.random.default_rng(0)
        many = executor.step(StepRows(every, grammar, none, left, none), rng)
        lone = executor.step(StepRows(every[:1], grammar[:1], none[:1], left[:1], none[:1]), rng)
        drafted = executor.step(StepRows(every, grammar, np.full(n, 2), left, none), rng)
        run = executor.decode_run(every, grammar, left, 4)
        work[scale] = many, lone, drafted, run
    (many1, lone1, drafted1, run1), (many3, lone3, drafted3, run3) = work[1.0], work[3.0]
    assert many1.fill_s.sum() > 0
    np.testing.assert_allclose(many3.fill_s, 3 * many1.fill_s, rtol=1e-12)
    np.testing.assert_allclose(lone3.fill_s, 3 * lone1.fill_s, rtol=1e-12)
    np.testing.assert_allclose(run3.fill_s, 3 * run1.fill_s, rtol=1e-12)
    np.testing.assert_array_equal(run3.accept_s, run1.accept_s)
    assert (many3.process_s, lone3.process_s, drafted3.process_s) == (many1.process_s, lone1.process_s,
                                                                      drafted1.process_s)
    np.testing.assert_array_equal(drafted3.mask_rows, drafted1.mask_rows)
    accepts = 2e-6 * (drafted1.mask_rows - 1)  # the profile's accept, once a valid draft
    assert (drafted1.mask_rows > 1).any()
    np.testing.assert_allclose(drafted3.fill_s - accepts, 3 * (drafted1.fill_s - accepts), rtol=1e-9)
    with pytest.raises(ValueError, match="fill_scale must be positive"):
        ProfileGrammarCosts(_profile(), 7, fill_scale=0.0)


@pytest.mark.parametrize("name", ["sglang", "vllm"])
def test_model_mode_is_deterministic_per_seed(name):
    a, b, c = _model_run(name, 7), _model_run(name, 7), _model_run(name, 8)
    pd.testing.assert_frame_equal(a.requests, b.requests)
    pd.testing.assert_frame_equal(a.steps, b.steps)
    assert a.summary == b.summary
    assert not a.requests["finish_s"].equals(c.requests["finish_s"])


@pytest.mark.parametrize("name", ["sglang", "vllm"])
def test_model_run_with_every_mechanism_accounts_for_every_request(name):
    result = _model_run(name, 3)
    frame, s = result.requests, result.summary
    assert list(frame.columns) == list(REQUEST_COLUMNS)
    assert list(result.steps.columns) == list(STEP_COLUMNS)
    done = frame["abort_reason"] == ""
    assert s.completed + s.failed == len(frame) == 300
    assert (frame.loc[done, "output_tokens"] == frame.loc[done, "output_len"] + frame.loc[done, "think_tokens"]).all()
    assert set(frame.loc[~done, "abort_reason"]) <= {"compile_error", "cached_invalid"}
    assert (frame.loc[done, "first_token_s"] >= frame.loc[done, "issued_s"]).all()
    assert (frame.loc[done, "finish_s"] >= frame.loc[done, "first_token_s"]).all()
    assert s.cache_hit_rate > 0 and s.jump_forward_tokens > 0 and 0 < s.rollback_rate < 1
    assert s.forced_think_ends == int(frame["forced_think_end"].sum()) > 0
    assert s.max_rank_skew_ms > 0
    assert 0 < s.mask_share < 1
    assert s.mean_itl_ms > 0 and s.p99_ttft_ms >= s.median_ttft_ms
    tracks = {span.track for span in result.timeline.spans}
    assert {"scheduler", "gpu", "rank0/compile0", "rank1/compile0"} <= tracks
