"""MTP as a speculative-decoding drafter: its passes priced in each step's forward, configured from the workload."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cdbench.harness.config import RunConfig
from cdbench.harness.costs.forward import ForwardCostModel
from cdbench.harness.costs.gpu import FixedGpuCosts, RooflineGpuCosts
from cdbench.harness.costs.mask import MaskCost
from cdbench.harness.executors.model import FixedGrammarCosts, ModelExecutor
from cdbench.harness.policies import policy
from cdbench.harness.run import simulate
from cdbench.workloads.request import Request


def decode_forwards(drafter: str) -> list[float]:
    gpu = FixedGpuCosts(forward_base_s=0.01, draft_token_s=0.001)
    result = simulate([Request(0, 0.0, 10, 30)], policy("vllm", spec_tokens=2, spec_drafter=drafter, overlap=False),
                      ModelExecutor(FixedGrammarCosts(), alpha=0.5), gpu, seed=1, trace_steps=0)
    steps = result.steps[result.steps["kind"] == "decode"]
    assert len(steps) > 3
    return steps["forward_s"].tolist()


def test_mtp_drafting_adds_k_passes_over_the_rows_to_the_forward() -> None:
    assert set(decode_forwards("external")) == {0.01}  # drafts that cost the forward nothing
    mtp = decode_forwards("mtp")
    # one row drafting 2 tokens a step: 2 x 0.001 s on top (no drafts once the request is about to end)
    assert mtp.count(pytest.approx(0.012)) >= len(mtp) - 2
    assert all(f == pytest.approx(0.012) or f == pytest.approx(0.01) for f in mtp)


def test_roofline_prices_the_head() -> None:
    fwd = ForwardCostModel("qwen3.5-35b-a3b", "h200")
    gpu = RooflineGpuCosts(fwd, MaskCost.for_gpu("h200", 1000))
    assert gpu.draft_s(4, 3, 4000) == fwd.mtp_draft_s(4, 3, 4000) > 0


def test_config_takes_the_drafter_from_the_workload() -> None:
    base = {"mode": "model", "costs": {"model": "qwen3.5-35b-a3b", "gpu": "h200"},
            "workload": {"num_requests": 4, "spec_decode": {"k": 2, "alpha": 0.6, "drafter": "mtp"}}}
    cfg = RunConfig.model_validate(base)
    sched = cfg.scheduler_config(cfg.workload.spec_decode.k, cfg.workload.spec_decode.drafter)
    assert (sched.spec_tokens, sched.spec_drafter) == (2, "mtp")
    assert cfg.model_dump()["scheduler"]["spec_drafter"] == "mtp"
    with pytest.raises(ValidationError, match="has no MTP layer"):
        RunConfig.model_validate({**base, "costs": {"model": "llama-3.1-8b", "gpu": "h200"}})
    live = RunConfig.model_validate({**base, "mode": "live"})  # one GPU: the live forward runs the head
    assert live.workload.spec_decode.drafter == "mtp"
    with pytest.raises(ValidationError, match="live mode runs the MTP head on one GPU"):
        RunConfig.model_validate({**base, "mode": "live", "scheduler": {"ranks": 2}})
    with pytest.raises(ValidationError, match="costs.live_gpu's GPU steps run no MTP head"):
        RunConfig.model_validate({**base, "mode": "hybrid", "costs": {**base["costs"], "live_gpu": True}})
