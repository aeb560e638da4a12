"""Live GPU costs: each step's GPU parts run for real (here a tiny model on the CPU) and are timed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scheduler_helpers import req, sim

from cdbench.harness.config import RunConfig
from cdbench.harness.costs.hardware import ModelSpec
from cdbench.harness.live.gpu import DECODE_BUCKET, KVCapacityError, LiveGpuCosts

TINY = ModelSpec(name="tiny", params_total=1e5, n_layers=2, hidden_size=64, n_heads=8, n_kv_heads=2, head_dim=16,
                 vocab_size=50, intermediate_size=96)


@pytest.fixture(scope="module")
def live() -> LiveGpuCosts:
    return LiveGpuCosts(TINY, vocab_size=1000, device="cpu", kv_tokens=8192, max_rows=64,
                        logits_dtype=torch.float32, dtype=torch.float32)


def test_each_part_is_run_and_timed(live: LiveGpuCosts) -> None:
    assert live.forward_s(np.zeros(0), np.zeros(0), 0, 0) == 0.0
    before = live.steps
    assert live.forward_s(np.array([16, 8]), np.array([0, 32]), 4, 4 * 100) > 0
    assert live.forward_s(np.zeros(0), np.zeros(0), 8, 8 * 300) > 0
    assert live.steps == before + 2
    assert live.copy_s(8, True) > 0 and live.copy_s(8, False) > 0 and live.copy_s(0, True) == 0.0
    assert live.apply_s(8) > 0 and live.apply_s(0) == 0.0
    assert live.sample_s(8) > 0 and live.sample_s(0) == 0.0
    assert live.apply_s(8) == live.apply_s(8)  # measured once per row count, then reused
    # apply really masked: only token 0 of each 32 is allowed, so the rest of the first 8 rows is -inf
    assert torch.isinf(live.logits[:8, 1:32]).all() and not torch.isinf(live.logits[:8, 0]).any()


def test_capacity_and_row_limits_are_named(live: LiveGpuCosts) -> None:
    with pytest.raises(KVCapacityError, match="needs 16 x 1025 KV tokens; the live GPU holds 8192"):
        live.forward_s(np.zeros(0), np.zeros(0), 16, 16 * 1000)
    with pytest.raises(ValueError, match="65 rows in one step"):
        live.apply_s(65)
    assert DECODE_BUCKET == 256


def test_a_run_prices_its_steps_with_measured_gpu_times(live: LiveGpuCosts) -> None:
    result = sim([req(i, 0.002 * i, out=4, prompt=40) for i in range(4)], "sglang", overlap=True, gpu=live)
    assert result.summary.completed == 4
    forward = result.steps.loc[result.steps["kind"] != "idle", "forward_s"].to_numpy()
    assert len(forward) >= 4 and (forward > 0).all()
    assert len(set(forward.tolist())) > 1  # measured per step, not a constant


def test_config_refuses_live_gpu_in_model_mode() -> None:
    with pytest.raises(ValueError, match="live_gpu measures the GPU parts in hybrid mode; model mode prices them"):
        RunConfig.model_validate({"mode": "model", "costs": {"live_gpu": True}})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            RunConfig.model_validate({"costs": {"live_gpu": True}}).costs.gpu_costs()
