"""The up-front estimate of what a run takes, from its request count."""

import pytest

import cdbench.harness.footprint as footprint
from cdbench.harness.config import RunConfig


def _config(mode: str = "model", **workload) -> RunConfig:
    return RunConfig.model_validate({"mode": mode, "workload": workload})


def test_a_streamed_model_run_grows_far_less_with_its_request_count_than_one_holding_them():
    small, large = footprint.estimate(_config(num_requests=1000)), footprint.estimate(_config(num_requests=10**7))
    assert large.memory_bytes == footprint.STREAMED_BYTES + 10**7 * footprint.STREAMED_BYTES_PER_REQUEST
    assert large.memory_bytes - small.memory_bytes < (10**7 - 1000) * footprint.BYTES_PER_REQUEST / 3
    assert large.seconds == pytest.approx(10**4 * small.seconds)


def test_a_run_holding_its_requests_grows_with_them():
    hybrid = footprint.estimate(_config("hybrid", num_requests=1000))
    # the workload and the scheduler's state of every request are held to the end of a hybrid run
    assert hybrid.memory_bytes == 1000 * (footprint.BYTES_PER_REQUEST + footprint.HELD_WORKLOAD_BYTES)
    assert hybrid.seconds is None
    assert "of CPU time" not in hybrid.describe()
    ranked = RunConfig.model_validate({"mode": "model", "workload": {"num_requests": 1000},
                                       "scheduler": {"ranks": 2, "parallel": "dp"}})
    assert footprint.estimate(ranked).memory_bytes == hybrid.memory_bytes  # data-parallel ranks hold them too


def test_a_replayed_trace_is_not_estimated(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    assert footprint.estimate(_config(trace=str(trace))) is None
    assert footprint.refusal(_config(trace=str(trace))) is None


def test_the_refusal_compares_the_estimate_with_the_available_memory(monkeypatch):
    config = _config("hybrid", num_requests=1000)
    held = 1000 * (footprint.BYTES_PER_REQUEST + footprint.HELD_WORKLOAD_BYTES)
    monkeypatch.setattr(footprint, "available_memory", lambda: held)
    assert footprint.refusal(config) is None
    monkeypatch.setattr(footprint, "available_memory", lambda: held - 1)
    assert "1,000 requests need about" in footprint.refusal(config)
    streamed = _config(num_requests=10**6)  # a streamed model run: its own estimate
    need = footprint.estimate(streamed).memory_bytes
    monkeypatch.setattr(footprint, "available_memory", lambda: need)
    assert footprint.refusal(streamed) is None
    monkeypatch.setattr(footprint, "available_memory", lambda: need - 1)
    assert "1,000,000 requests need about" in footprint.refusal(streamed)


def test_the_available_memory_is_the_machines():
    import psutil

    assert 0 < footprint.available_memory() <= psutil.virtual_memory().total
