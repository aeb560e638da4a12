"""With two or more GPUs: ranks agree on readiness through a real NCCL all_gather, one GPU each."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cdbench.harness.collectives import RankAgreement, agree_sets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def test_nccl_ranks_reach_the_same_agreement_and_time_it() -> None:
    rng = np.random.default_rng(0)
    with RankAgreement(2, "nccl") as ranks:
        for _ in range(5):
            ready = [sorted(set(rng.integers(0, 30, 20).tolist())) for _ in range(2)]
            failed = [sorted(set(rng.integers(0, 30, 3).tolist())) for _ in range(2)]
            real = ranks.agree(ready, failed)
            assert (real.ready, real.failed) == agree_sets(ready, failed)
            assert 0 < real.seconds < 5
