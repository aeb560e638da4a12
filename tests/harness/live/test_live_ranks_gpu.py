"""On two CUDA devices: tensor- and data-parallel rank processes, one GPU each (NCCL in the step graphs)."""

from __future__ import annotations

import pytest
import torch

from cdbench.harness.costs.hardware import ModelSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

SMALL = ModelSpec(name="small", params_total=1e7, n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=2,
                  head_dim=64, vocab_size=1000, intermediate_size=1024, qk_norm=True)


@pytest.mark.parametrize("parallel", ["tp", "dp"])
def test_rank_processes_on_two_gpus(parallel) -> None:
    from test_live_ranks import _requests

    from cdbench.backends.vocab import load_vocab
    from cdbench.harness.costs.gpu import FixedGpuCosts
    from cdbench.harness.live.ranks import (
        HybridExecutors,
        LiveSpec,
        RankJob,
        simulate_ranks,
    )
    from cdbench.harness.policies import policy
    from cdbench.harness.run import max_context

    requests = _requests()
    live = LiveSpec(SMALL, load_vocab("cl100k").size, max_context(requests), "cuda", kv_tokens=64 * 1024,
                    max_rows=64, graph_sizes=(1, 2, 4, 8), block_size=1)  # sglang's pages
    job = RankJob(parallel, requests, policy("sglang", ranks=2, parallel=parallel),
                  HybridExecutors("xgrammar", {}, "cl100k", 0.0, 0, {}, 1), FixedGpuCosts(), live, seed=1,
                  timeout_s=300)
    result = simulate_ranks(job)
    assert result.summary.completed == len(requests)
    info = result.live.ranks
    assert len(info.devices) == 2 and info.devices[0] != "cpu"
    steps = result.steps[result.steps["kind"] != "idle"]
    assert (steps["forward_s"] > 0).all()
    if parallel == "tp":
        assert info.all_gather_s.count > 0 and sorted(info.all_reduce_s) == [1, 16, 128, 1024, 8192]
    else:
        assert sorted(set(result.requests["rank"])) == [0, 1]
