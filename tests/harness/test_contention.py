"""Host CPU contention: compiles, fill threads and the scheduler loop sharing the host's cores."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_helpers import req, row, sim

from cdbench.harness.compile_service import CompilePools
from cdbench.harness.contention import HostCores, stretch
from cdbench.harness.executors.model import FixedGrammarCosts
from cdbench.harness.scheduler import Scheduler

hosts = st.builds(HostCores, cores=st.integers(1, 64), compile_cores=st.sampled_from([0.5, 1.0, 2.0, 8.0]),
                  loops=st.integers(1, 4))


@settings(max_examples=300, deadline=None)
@given(host=hosts, compiles=st.integers(0, 64), threads=st.integers(1, 16))
def test_stretch_is_one_within_the_cores_and_demand_over_cores_beyond(host, compiles, threads):
    demand = compiles * host.compile_cores + host.loops * threads
    got = host.stretch(compiles, threads)
    if demand <= host.cores:
        assert got == 1.0
    else:
        assert got == pytest.approx(demand / host.cores)
    assert host.can_exceed(compiles, threads) == (got > 1.0)


@settings(max_examples=300, deadline=None)
@given(host=hosts, compiles=st.integers(0, 64), threads=st.integers(1, 16), more=st.integers(0, 8))
def test_stretch_is_monotone_in_busy_compiles_and_fill_threads(host, compiles, threads, more):
    base = host.stretch(compiles, threads)
    assert host.stretch(compiles + more, threads) >= base
    assert host.stretch(compiles, threads + more) >= base


@settings(max_examples=200, deadline=None)
@given(cores=st.integers(1, 8), starts=st.lists(st.floats(0, 1), min_size=1, max_size=12))
def test_a_compile_never_runs_shorter_beside_more_running_compiles(cores, starts):
    """The same compile, submitted after more others (threads enough for all), took as long or longer,
    and never less than alone. (Its end need not: with fewer threads it may wait and start when fewer run.)"""
    durations = []
    for n in range(len(starts) + 1):
        pools = CompilePools(1, 16, host=HostCores(cores))
        for t in sorted(starts)[:n]:
            pools.submit_one(t, 0.5)
        begin, end, _ = pools.submit_one(1.0, 0.5)
        assert begin == 1.0
        durations.append(end - begin)
    assert durations[0] == pytest.approx(0.5 * max(1.0, 2 / cores))
    assert all(a <= b + 1e-12 for a, b in zip(durations, durations[1:]))


def test_stretch_function():
    assert stretch(2, 2) == 1.0
    assert stretch(5, 2) == 2.5


def test_ranks_share_the_host_and_each_counts_the_others_compiles():
    pools = CompilePools(ranks=2, threads=2, host=HostCores(cores=3, loops=2))
    rng = np.random.default_rng(0)
    first = pools.submit(0.0, 1.0, rng)[1]  # 2 compiles + 2 loops on 3 cores
    second = pools.submit(0.0, 1.0, rng)[1]  # 4 compiles + 2 loops
    assert first.tolist() == pytest.approx([4 / 3, 4 / 3])
    assert second.tolist() == pytest.approx([2.0, 2.0])
    assert pools.running(1.0) == 4 and pools.running(1.5) == 2 and pools.next_free(1.5) == pytest.approx(2.0)


def _three_compiles(**overrides):
    """vLLM on 2 host CPUs with 3 compile threads: one unconstrained request decodes while three specs compile."""
    requests = [req(0, 0.0, out=20, spec=None)] + [req(i, 0.0, out=2, spec=f"s{i}") for i in (1, 2, 3)]
    grammar = FixedGrammarCosts(compile_time_s=0.1, fill_time_s=0.0, accept_time_s=0.0, rollback_time_s=0.0)
    params = dict(host_cpus=2, compile_threads=3, overlap=False, check_timeout_s=0.0, schedule_s=0.001,
                  process_step_s=0.001, launch_s=0.0)
    return sim(requests, "vllm", grammar=grammar, **{**params, **overrides})


def test_hand_computed_three_compiles_on_two_cores():
    result = _three_compiles()
    # a compile starts beside those running and the loop: 1 + 1, 2 + 1, 3 + 1 threads on 2 cores
    assert [row(result, i)["compile_end_s"] for i in (1, 2, 3)] == pytest.approx([0.1, 0.15, 0.2])
    steps = result.steps[result.steps["kind"] != "idle"]
    # schedule and process (1 ms each) stretch by the running compiles and the loop over 2 cores; the
    # 10 ms forward does not: 3 compiles until 0.1 s, 2 until 0.15 s, then 1 (no stretch)
    expected = np.select([steps["start_s"] < 0.1, steps["start_s"] < 0.15], [2.0, 1.5], 1.0)
    np.testing.assert_allclose(steps["contention"], expected)
    np.testing.assert_allclose(steps["duration_s"], 0.010 + 0.002 * expected)
    np.testing.assert_allclose(steps["schedule_s"], 0.001 * expected)
    np.testing.assert_allclose(steps["process_s"], 0.001 * expected)
    assert steps["start_s"].iloc[:9].tolist() == pytest.approx([0.014 * k for k in range(8)] + [0.112])


def test_turning_contention_off_restores_the_uncontended_timings():
    off = _three_compiles(host_contention=False)
    roomy = _three_compiles(host_cpus=64, compile_threads=3)  # the same pools on cores enough for all
    pd.testing.assert_frame_equal(off.steps, roomy.steps)
    pd.testing.assert_frame_equal(off.requests, roomy.requests)
    assert (off.steps["contention"] == 1.0).all()
    assert [row(off, i)["compile_end_s"] for i in (1, 2, 3)] == pytest.approx([0.1, 0.1, 0.1])
    assert off.steps["duration_s"].iloc[0] == pytest.approx(0.012)


def test_parallel_fill_counts_its_pool_threads_instead_of_the_loop():
    requests = [req(i, 0.0, out=3, spec="s1") for i in range(40)] + [req(99, 0.0, out=2, spec="s2")]
    grammar = FixedGrammarCosts(compile_time_s=0.0, compile_by_key={"s2": 10.0}, fill_time_s=1e-3,
                                accept_time_s=0.0, rollback_time_s=0.0)
    params = dict(host_cpus=4, compile_threads=3, fill_parallel_threshold=8, fill_chunk=4, fill_threads=4,
                  overlap=False, fill_step_s=0.0)
    on, off = (sim(requests, "vllm", grammar=grammar, host_contention=c, **params) for c in (True, False))
    decode = lambda r: r.steps[(r.steps["kind"] == "decode") & (r.steps["grammar_rows"] == 40)]  # noqa: E731
    # the s2 compile runs throughout: 1 compile + 4 fill threads on 4 cores
    np.testing.assert_allclose(decode(on)["fill_s"], decode(off)["fill_s"] * 5 / 4)
    assert len(decode(on)) and (decode(on)["contention"] == 1.0).all()  # the loop alone: 1 + 1 <= 4


def _contended_run(seed: int):
    """SGLang on 2 host CPUs with two ranks (6 compile threads each) and jittered compiles."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(0.01, 200))
    requests = [req(i, float(arrivals[i]), out=int(rng.integers(5, 40)), spec=f"s{rng.integers(0, 60)}" if i % 4 else None)
                for i in range(200)]
    grammar = FixedGrammarCosts(compile_time_s=0.05, fill_time_s=2e-5, accept_time_s=1e-6, rollback_time_s=0.0)
    return sim(requests, "sglang", grammar=grammar, seed=seed, host_cpus=2, ranks=2, rank_jitter=0.3,
               schedule_s=2e-4, process_step_s=1e-4)


def test_model_mode_with_contention_is_deterministic():
    a, b = _contended_run(5), _contended_run(5)
    pd.testing.assert_frame_equal(a.steps, b.steps)
    pd.testing.assert_frame_equal(a.requests, b.requests)
    assert a.summary == b.summary
    assert (a.steps["contention"] > 1.0).any()


@pytest.mark.parametrize("case", ["waiting", "aborted"])
def test_idle_strides_change_with_the_stretch(monkeypatch, case):
    """Idle iterations taken in one stride end where those run one by one do, while the stretch changes:
    as the compiles of waiting requests end, and as one ends whose request timed out meanwhile."""
    # (times that never meet a compile's end exactly, where summing one by one rounds to either side)
    if case == "waiting":
        requests = [req(i, 0.0, out=3, spec=f"s{i}") for i in range(4)]
        grammar = FixedGrammarCosts(compile_time_s=0.1037, fill_time_s=0.0, accept_time_s=0.0, rollback_time_s=0.0)
    else:  # s0 times out after 50 polls and its compile runs on, beside s1's, until 0.7037 s
        requests = [req(0, 0.0, out=3, spec="s0"), req(1, 0.45, out=3, spec="s1")]
        grammar = FixedGrammarCosts(compile_by_key={"s0": 0.7037, "s1": 0.2037}, fill_time_s=0.0,
                                    accept_time_s=0.0, rollback_time_s=0.0)
    run = lambda: sim(requests, "sglang", grammar=grammar, host_cpus=2, schedule_s=0.0031,  # noqa: E731
                      max_poll_iterations=50)
    strided = run()
    assert (strided.steps["contention"] > 1.0).any()
    if case == "aborted":
        assert strided.requests["abort_reason"].tolist() == ["grammar_timeout", ""]
    monkeypatch.setattr(Scheduler, "_idle_repeats", lambda self, *args: 0)
    one_by_one = run()
    for column in ("compile_end_s", "grammar_ready_s", "first_token_s", "finish_s"):
        np.testing.assert_allclose(strided.requests[column], one_by_one.requests[column], rtol=1e-9)


def test_the_given_compile_time_is_rank_zeros_and_the_other_ranks_spread_about_it():
    """The time a profile gives is one rank's draw: rank 0 takes it as it is, each other rank that time
    times the ratio of two draws of the per-rank spread (sigma * sqrt(2)); one rank alone has no spread."""
    pools = CompilePools(2, 10_000, jitter=0.2)
    rng = np.random.default_rng(0)
    ends = np.array([pools.submit(0.0, 1.0, rng)[1] for _ in range(4000)])
    assert (ends[:, 0] == 1.0).all()
    assert np.log(ends[:, 1]).std() == pytest.approx(0.2 * np.sqrt(2), rel=0.05)
    assert CompilePools(1, 4, jitter=0.2).submit_one(0.0, 1.0)[1] == 1.0


def test_a_compiles_rank_spread_is_the_one_measured_at_its_size():
    """With spreads by size, a compile takes the sigma at its seconds (interpolated in log seconds, flat beyond
    the points) in place of the one jitter."""
    rng = np.random.default_rng(0)
    for seconds, sigma in ((0.0001, 0.05), (0.001, 0.05), (0.01, 0.15), (0.1, 0.25), (1.0, 0.25)):
        pools = CompilePools(2, 10_000, jitter=0.01, jitter_by_size=((0.001, 0.05), (0.1, 0.25)))
        ends = np.array([pools.submit(0.0, seconds, rng)[1] for _ in range(3000)])
        assert (ends[:, 0] == seconds).all()
        assert np.log(ends[:, 1] / seconds).std() == pytest.approx(sigma * np.sqrt(2), rel=0.06)
