"""The up-front estimate of what a run takes, from its request count."""

import pytest
from rich.filesize import decimal as _bytes

import cdbench.harness.footprint as footprint
from cdbench.harness.config import RunConfig


def _config(mode: str = "model", **workload) -> RunConfig:
    return RunConfig.model_validate({"mode": mode, "workload": workload})


def test_a_streamed_model_run_takes_the_same_memory_whatever_its_request_count():
    small, large = footprint.estimate(_config(num_requests=1000)), footprint.estimate(_config(num_requests=10**7))
    assert small.memory_bytes == large.memory_bytes == footprint.STREAMED_BYTES
    assert large.seconds == pytest.approx(10**4 * small.seconds)  # its time still grows
    assert large.describe().startswith(f"about {_bytes(footprint.STREAMED_BYTES)} of memory (whatever the "
                                       "request count) and ")


def test_a_run_holding_its_requests_grows_with_them():
    hybrid = footprint.estimate(_config("hybrid", num_requests=1000))
    # the workload and the scheduler's state of every request are held to the end of a hybrid run
    assert hybrid.memory_bytes == 1000 * (footprint.BYTES_PER_REQUEST + footprint.HELD_WORKLOAD_BYTES)
    assert hybrid.seconds is None
    assert hybrid.describe() == f"about {_bytes(hybrid.memory_bytes)} of memory ({_bytes(hybrid.memory_bytes // 1000)} a request)"
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
    # a streamed model run: refused only where the machine cannot give its bound, at any request count
    monkeypatch.setattr(footprint, "available_memory", lambda: footprint.STREAMED_BYTES)
    assert footprint.refusal(_config(num_requests=10**9)) is None
    monkeypatch.setattr(footprint, "available_memory", lambda: footprint.STREAMED_BYTES - 1)
    assert "1,000 requests need about" in footprint.refusal(_config(num_requests=1000))


def test_the_available_memory_is_the_machines():
    import psutil

    assert 0 < footprint.available_memory() <= psutil.virtual_memory().total
