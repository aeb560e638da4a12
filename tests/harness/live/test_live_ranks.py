"""Rank processes of ``live`` mode (tensor and data parallel) on the CPU: gloo carries the forward's
collectives and the grammar agreement, a tiny model stands in for the GPU forward."""

from __future__ import annotations

import json
import multiprocessing as mp
from functools import partial

import numpy as np
import pytest
import torch.distributed as dist

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import load_vocab
from cdbench.harness.collectives import CollectiveError, PeerAgreement
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.costs.hardware import ModelSpec
from cdbench.harness.executors.model import FixedGrammarCosts, ModelExecutor
from cdbench.harness.live.forward import shard
from cdbench.harness.live.ranks import (
    HybridExecutors,
    LiveSpec,
    RankJob,
    compile_sigma,
    deal,
    model_parameters,
    simulate_ranks,
)
from cdbench.harness.policies import policy
from cdbench.harness.run import max_context, simulate
from cdbench.workloads.request import Request

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed for rank processes")

TINY = ModelSpec(name="tiny", params_total=1e5, n_layers=2, hidden_size=64, n_heads=8, n_kv_heads=4, head_dim=16,
                 vocab_size=50, intermediate_size=96)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
VOCAB = "cl100k"


def _requests(n: int = 8) -> tuple[Request, ...]:
    vocab = load_vocab(VOCAB)
    eos = vocab.eos_token_ids[0]
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append(Request(i, 0.002 * i, 24, 4))  # unconstrained
            continue
        schema = dict(SCHEMA, title=f"P{i % 4}")  # a few distinct specs: misses and cache hits
        tokens = tuple(vocab.encode(json.dumps({"name": f"P{i}", "age": i}))) + (eos,)
        out.append(Request(i, 0.002 * i, 24, len(tokens), ConstraintSpec("json_schema", schema), f"p{i % 4}", tokens))
    return tuple(out)


def _job(parallel: str, ranks: int, requests, live: bool = True, executor=None, **overrides) -> RankJob:
    vocab_size = load_vocab(VOCAB).size
    spec = LiveSpec(TINY, vocab_size, max_context(requests), "cpu", kv_tokens=16 * max_context(requests),
                    max_rows=64, logits_dtype="float32", block_size=1) if live else None  # sglang's pages
    executor = executor or HybridExecutors("xgrammar", {}, VOCAB, 0.0, 0, {}, 1)
    return RankJob(parallel, requests, policy("sglang", ranks=ranks, parallel=parallel, **overrides), executor,
                   FixedGpuCosts(forward_base_s=0.01), spec, seed=1, timeout_s=120)


def test_a_tensor_parallel_shard_divides_heads_and_mlp_or_says_why_not() -> None:
    assert shard(TINY, 2).n_heads == 4 and shard(TINY, 2).n_kv_heads == 2 and shard(TINY, 2).intermediate_size == 48
    with pytest.raises(ValueError, match="n_heads 8 does not divide among 3 tensor-parallel ranks"):
        shard(TINY, 3)


@pytest.mark.parametrize("parallel,ranks", [("tp", 2), ("dp", 2)])
def test_rank_processes_run_live_steps_and_merge_into_one_run(parallel, ranks) -> None:
    requests = _requests()
    result = simulate_ranks(_job(parallel, ranks, requests))
    frame = result.requests
    assert result.summary.completed == len(requests)
    assert frame.loc[frame["structured"], "valid"].all()
    info = result.live.ranks
    assert info.parallel == parallel and info.ranks == ranks and info.devices == ["cpu"] * ranks
    if parallel == "tp":
        assert set(frame["rank"]) == {0} and info.requests == [len(requests)] * ranks
        # every rank ran the same steps; their durations were agreed through the real collective
        assert info.steps[0] == info.steps[1] == len(result.steps)
        assert info.all_gather_s.count > 0 and 0 < info.all_gather_s.p50 < 1
        assert info.step_agree_s.count >= len(result.steps[result.steps["kind"] != "idle"]) * ranks
        assert info.step_skew_s.count > 0 and info.step_skew_s.p50 >= 0
        assert info.compile_skew_s.count > 0  # each rank compiled each spec itself
        assert sorted(info.all_reduce_s) == [1, 16, 128, 1024, 8192]
        misses = frame["cache"] == "miss"
        assert (frame.loc[misses, "rank_skew_s"] >= 0).all() and frame.loc[misses, "rank_skew_s"].max() > 0
        params = model_parameters(info)
        assert params["all_gather_s"] == info.all_gather_s.p50 and params["rank_jitter"] == info.compile_sigma
        # each rank's own records: the same busy steps, each rank's own time and its wait for the slowest
        own = result.rank_steps
        busy = result.steps.index[result.steps["kind"] != "idle"]
        for rank in range(ranks):
            mine = own[own["rank"] == rank]
            assert mine["step"].tolist() == busy.tolist()
            assert mine["duration_s"].tolist() == result.steps.loc[busy, "duration_s"].tolist()
        assert (own["wait_s"] >= 0).all() and (own["agree_s"] > 0).all()
        assert (own["local_s"] + own["wait_s"]).to_numpy() == pytest.approx(own["duration_s"].to_numpy())
        assert (own.groupby("step")["wait_s"].min() == 0).all()  # the slowest rank waited for no one
        assert info.step_lag_s.count == len(busy) and info.step_lag_s.p99 >= 0
        assert info.fill_sigma is not None and params["rank_fill_jitter"] == info.fill_sigma
    else:
        # round robin in arrival order: rank 0 has requests 0, 2, 4, ...
        assert frame.set_index("request_id")["rank"].to_dict() == {i: i % 2 for i in range(len(requests))}
        assert info.requests == [4, 4] and info.all_gather_s is None
        assert sorted(set(result.steps["rank"])) == [0, 1]
        assert result.summary.completed == sum(info.requests)
        # a data-parallel rank's own records are its busy steps, with nothing waited for
        own = result.rank_steps
        assert len(own) == int((result.steps["kind"] != "idle").sum())
        assert (own["wait_s"] == 0).all() and (own["local_s"] == own["duration_s"]).all()
        assert info.fill_sigma is None and info.step_lag_s is None
        # each rank measured its own requests' specs: the run's profile joins them
        structured = {r.spec_id for r in requests if r.spec is not None}
        assert set(result.grammar_profile.compile_by_spec) == structured


def test_four_data_parallel_ranks_with_the_model_executor_match_four_separate_runs() -> None:
    # the model executor in each rank process: each rank's records are a run of its dealt requests alone
    requests = _requests(12)
    grammar = FixedGrammarCosts(compile_time_s=0.004, fill_time_s=1e-5, accept_time_s=1e-6)
    job = _job("dp", 4, requests, live=False, executor=partial(ModelExecutor, grammar))
    result = simulate_ranks(job)
    for rank, part in enumerate(deal(requests, 4)):
        alone = simulate(part, policy("sglang"), ModelExecutor(grammar), FixedGpuCosts(forward_base_s=0.01), seed=1)
        mine = result.requests[result.requests["rank"] == rank].set_index("request_id")
        expected = alone.requests.set_index("request_id")
        assert mine["first_token_s"].to_numpy() == pytest.approx(expected["first_token_s"].to_numpy())
        assert mine["finish_s"].to_numpy() == pytest.approx(expected["finish_s"].to_numpy())


def test_four_tensor_parallel_processes_agree_on_every_step() -> None:
    requests = _requests(6)
    result = simulate_ranks(_job("tp", 4, requests))
    assert result.summary.completed == len(requests)
    info = result.live.ranks
    assert info.steps == [info.steps[0]] * 4 and info.all_gather_s.count > 0


def test_vllm_tensor_parallel_ranks_are_refused_by_name() -> None:
    requests = _requests(3)
    job = RankJob("tp", requests, policy("vllm", ranks=2), HybridExecutors("xgrammar", {}, VOCAB, 0.0, 0, {}, 1),
                  FixedGpuCosts(), None)
    with pytest.raises(ValueError, match="agree at SGLang's poll of its grammar queue"):
        simulate_ranks(job)


def test_a_failing_rank_ends_the_run_with_its_name() -> None:
    requests = _requests(3)
    job = _job("tp", 2, requests, executor=HybridExecutors("no-such-backend", {}, VOCAB, 0.0, 0, {}, 1))
    with pytest.raises(CollectiveError, match="rank [01] failed: .*no-such-backend"):
        simulate_ranks(job)


def test_compile_sigma_is_the_spread_among_ranks() -> None:
    rng = np.random.default_rng(0)
    base = rng.lognormal(-4, 1, 400)
    seconds = base * rng.lognormal(0, 0.2, (2, 400))
    assert compile_sigma(seconds) == pytest.approx(0.2, rel=0.15)
    assert compile_sigma(np.full((2, 3), np.nan)) is None


def _check_same_rank(rank: int, store: str, state: tuple, errors) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        PeerAgreement(2).check_same(state, "the test's state")
        errors.put((rank, ""))
    except CollectiveError as exc:
        errors.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


def _answers_of_two_ranks(target, args_of_rank) -> dict:
    """Run ``target(rank, *args, queue)`` in two spawned processes (``args_of_rank(rank)``); what each put on
    the queue, by rank."""
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, *args_of_rank(rank), answers)) for rank in range(2)]
    for proc in procs:
        proc.start()
    seen = dict(answers.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join()
    return seen


@pytest.mark.parametrize("states,diverged", [((("t", 1), ("t", 1)), False), ((("t", 1), ("t", 2)), True)])
def test_ranks_that_drift_apart_say_so_instead_of_waiting(tmp_path, states, diverged) -> None:
    answers = _answers_of_two_ranks(_check_same_rank, lambda rank: (str(tmp_path / "store"), states[rank]))
    if diverged:
        assert all("the ranks diverged: the test's state, by rank: [('t', 1), ('t', 2)]" in answers[r] for r in (0, 1))
    else:
        assert answers == {0: "", 1: ""}


def test_a_model_run_of_data_parallel_ranks_deals_its_workload() -> None:
    from cdbench.harness.config import RunConfig
    from cdbench.harness.run import run

    config = RunConfig.model_validate({
        "mode": "model", "workload": {"num_requests": 6}, "trace_steps": 0,
        "scheduler": {"ranks": 2, "parallel": "dp"},
        "costs": {"fixed_grammar": {"compile_time_s": 0.002}, "fixed_gpu": {"forward_base_s": 0.01}}})
    result = run(config)
    assert result.summary.completed == 6
    assert result.requests.groupby("rank").size().to_dict() == {0: 3, 1: 3}
    assert sorted(set(result.steps["rank"])) == [0, 1]


def _barrier_rank(rank: int, store: str, marker: str, answers) -> None:
    import time
    from pathlib import Path

    import torch

    from cdbench.harness.live.forward import TensorParallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        if rank == 1:  # the late rank: what it does before the barrier is done when the other leaves it
            time.sleep(0.5)
            Path(marker).write_text("late rank was here")
        TensorParallel(2, rank, None).barrier(torch.device("cpu"))
        answers.put((rank, Path(marker).exists()))
    finally:
        dist.destroy_process_group()


def test_a_barrier_holds_every_rank_until_the_last_arrives(tmp_path) -> None:
    """The wait after a graph capture: no rank starts its clock while another still captures."""
    seen = _answers_of_two_ranks(_barrier_rank, lambda rank: (str(tmp_path / "store"), str(tmp_path / "marker")))
    assert seen == {0: True, 1: True}
