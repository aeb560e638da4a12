"""The up-front estimate of what a run takes, from its request count."""

import pytest

import cdbench.harness.footprint as footprint
from cdbench.harness.config import RunConfig


def _config(mode: str = "model", **workload) -> RunConfig:
    return RunConfig.model_validate({"mode": mode, "workload": workload})


def test_the_estimate_grows_with_the_request_count_and_times_model_mode_only():
    small, large = footprint.estimate(_config(num_requests=1000)), footprint.estimate(_config(num_requests=10**6))
    assert large.memory_bytes == 1000 * small.memory_bytes == 10**6 * footprint.BYTES_PER_REQUEST
    assert large.seconds == pytest.approx(1000 * small.seconds)
    hybrid = footprint.estimate(_config("hybrid", num_requests=1000))
    # the workload is held to the end of a hybrid run; a model run lets it go once its tables are built
    assert hybrid.memory_bytes == 1000 * (footprint.BYTES_PER_REQUEST + footprint.HELD_WORKLOAD_BYTES)
    assert hybrid.seconds is None
    assert "of CPU time" not in hybrid.describe()


def test_a_replayed_trace_is_not_estimated(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    assert footprint.estimate(_config(trace=str(trace))) is None
    assert footprint.refusal(_config(trace=str(trace))) is None


def test_the_refusal_compares_the_estimate_with_the_available_memory(monkeypatch):
    config = _config(num_requests=1000)
    monkeypatch.setattr(footprint, "available_memory", lambda: 1000 * footprint.BYTES_PER_REQUEST)
    assert footprint.refusal(config) is None
    monkeypatch.setattr(footprint, "available_memory", lambda: 1000 * footprint.BYTES_PER_REQUEST - 1)
    assert "1,000 requests need about" in footprint.refusal(config)


def test_the_available_memory_is_the_machines():
    import psutil

    assert 0 < footprint.available_memory() <= psutil.virtual_memory().total
