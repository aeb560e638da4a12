"""Ranks agree on readiness through a real all_gather among local processes (gloo: no GPU; nccl: a GPU each)."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_helpers import req, row, sim

from cdbench.harness.collectives import CollectiveError, RankAgreement, agree_sets
from cdbench.harness.config import RunConfig
from cdbench.harness.executors.model import FixedGrammarCosts


def test_agreement_is_intersection_of_ready_minus_union_of_failed() -> None:
    assert agree_sets([[1, 2, 3, 4], [2, 3, 4, 9]], [[4], []]) == ((2, 3), (4,))
    assert agree_sets([[5], [5], [5]], [[], [], []]) == ((5,), ())


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("backend", [
    "gloo",
    pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices")]),
])
def test_rank_processes_reach_the_same_agreement_and_time_it(backend) -> None:
    rng = np.random.default_rng(0)
    with RankAgreement(2, backend) as ranks:
        for _ in range(5):
            ready = [sorted(set(rng.integers(0, 30, 20).tolist())) for _ in range(2)]
            failed = [sorted(set(rng.integers(0, 30, 3).tolist())) for _ in range(2)]
            real = ranks.agree(ready, failed)
            assert (real.ready, real.failed) == agree_sets(ready, failed)
            assert 0 < real.seconds < 5


def test_a_collective_needs_two_ranks_and_a_known_backend() -> None:
    with pytest.raises(ValueError, match="at least 2 ranks"):
        RankAgreement(1)
    with pytest.raises(ValueError, match="unknown collectives backend 'mpi'"):
        RankAgreement(2, "mpi")


def test_nccl_needs_a_gpu_per_rank() -> None:
    gpus = _gpus()
    ranks = max(2, gpus + 1)
    with pytest.raises(CollectiveError, match=f"each of the {ranks} ranks on its own GPU; this machine has {gpus}"):
        RankAgreement(ranks, "nccl")


def test_scheduler_with_gloo_ranks_times_out_on_the_slow_rank_and_pays_measured_syncs() -> None:
    # As the modelled case in test_scheduler_semantics: rank 1 (100x slower) never gets ready within
    # 3 polls, so the union of failed sets aborts the request on both ranks, and the spec is cached invalid.
    grammar = FixedGrammarCosts(compile_time_s=0.010, fill_time_s=0, accept_time_s=0)
    result = sim([req(0, 0.0), req(1, 0.5)], "sglang", overlap=False, ranks=2, rank_compile_scale=(1.0, 100.0),
                 max_poll_iterations=3, collectives="gloo", grammar=grammar)
    assert row(result, 0)["abort_reason"] == "grammar_timeout"
    assert row(result, 1)["abort_reason"] == "cached_invalid"
    syncs = result.steps["sync_s"].to_numpy()
    polled = syncs[syncs > 0]
    assert len(polled) == 3  # one real all_gather per poll, none fast-forwarded
    assert len(set(polled.tolist())) == 3 and 150e-6 not in polled  # measured, not the constant


def test_scheduler_with_gloo_ranks_releases_after_the_slowest_rank() -> None:
    grammar = FixedGrammarCosts(compile_time_s=0.010, fill_time_s=0, accept_time_s=0)
    result = sim([req(0, 0.0)], "sglang", overlap=False, ranks=2, rank_compile_scale=(1.0, 2.0),
                 collectives="gloo", grammar=grammar)
    r = row(result, 0)
    assert r["abort_reason"] == ""
    assert r["grammar_ready_s"] >= 0.020  # rank 1's compile ends at 20 ms: ready means ready on both
    assert r["first_token_s"] > r["grammar_ready_s"]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_model_mode_refuses_real_collectives(backend) -> None:
    with pytest.raises(ValueError, match=f"collectives '{backend}' runs real collectives in hybrid mode"):
        RunConfig.model_validate({"mode": "model", "scheduler": {"ranks": 2, "collectives": backend}})
    assert RunConfig.model_validate({"scheduler": {"ranks": 2, "collectives": "gloo"}}).mode == "hybrid"
