"""Host identity and CPU score: a stable id, one benchmark per host, lookups, and the time scale between hosts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cdbench.harness.costs import host as host_module
from cdbench.harness.costs.host import (
    BENCHMARK_VERSION,
    HostError,
    HostInfo,
    load_host,
    recorded_hosts,
    run_benchmark,
    this_host,
    time_scale,
)


@pytest.fixture
def benchmark_calls(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """``run_benchmark`` replaced by one that returns 1.0, 2.0, ... and counts its calls."""
    calls: list[float] = []

    def fake() -> float:
        calls.append(float(len(calls) + 1))
        return calls[-1]

    monkeypatch.setattr(host_module, "run_benchmark", fake)
    return calls


def _record(store: Path, host_id: str, name: str, score: float, version: int = BENCHMARK_VERSION) -> HostInfo:
    host = HostInfo(id=host_id, name=name, cpu_model=name, cores=4, arch="x86_64", score=score,
                    benchmark_version=version, measured="2026-01-01")
    (store / "hosts").mkdir(parents=True, exist_ok=True)
    (store / "hosts" / f"{host_id}.json").write_text(host.model_dump_json())
    return host


def test_benchmark_is_a_positive_finite_score() -> None:
    score = run_benchmark()
    assert score > 0 and math.isfinite(score)


def test_this_host_is_benchmarked_once_and_cached(tmp_path: Path, benchmark_calls: list[float]) -> None:
    first = this_host(tmp_path)
    assert this_host(tmp_path) == first and benchmark_calls == [1.0]
    assert first.score == 1.0 and first.benchmark_version == BENCHMARK_VERSION and first.cores >= 1
    assert first.name == f"{first.cpu_model} ({first.cores} core{'s' if first.cores != 1 else ''})"
    assert [p.name for p in (tmp_path / "hosts").iterdir()] == [f"{first.id}.json"]  # no temp file left
    assert HostInfo.model_validate_json((tmp_path / "hosts" / f"{first.id}.json").read_text()) == first


def test_id_is_stable_and_independent_of_the_score(tmp_path: Path, benchmark_calls: list[float]) -> None:
    first = this_host(tmp_path)
    again = this_host(tmp_path, rerun=True)
    assert benchmark_calls == [1.0, 2.0] and again.score == 2.0 and again.id == first.id
    assert this_host(tmp_path / "elsewhere").id == first.id
    assert recorded_hosts(tmp_path) == [again]


def test_a_record_of_another_benchmark_version_is_measured_again(tmp_path: Path, benchmark_calls: list[float]) -> None:
    here = this_host(tmp_path)
    _record(tmp_path, here.id, here.name, 5.0, version=BENCHMARK_VERSION - 1)
    assert this_host(tmp_path).benchmark_version == BENCHMARK_VERSION and benchmark_calls == [1.0, 2.0]


def test_load_host_by_id_name_and_prefix(tmp_path: Path) -> None:
    a = _record(tmp_path, "abc123456789", "Alpha CPU (4 cores)", 1.0)
    b = _record(tmp_path, "abd987654321", "Beta CPU (4 cores)", 2.0)
    assert recorded_hosts(tmp_path) == [a, b]
    assert load_host(tmp_path, "abc123456789") == a and load_host(tmp_path, "Beta CPU (4 cores)") == b
    assert load_host(tmp_path, "abd") == b
    with pytest.raises(HostError, match="host 'ab' matches several hosts"):
        load_host(tmp_path, "ab")


def test_unknown_host_names_it_and_lists_the_recorded(tmp_path: Path) -> None:
    _record(tmp_path, "abc123456789", "Alpha CPU (4 cores)", 1.0)
    with pytest.raises(HostError) as err:
        load_host(tmp_path, "zzz")
    assert isinstance(err.value, ValueError)
    assert "'zzz' is not a recorded host" in str(err.value) and "abc123456789 (Alpha CPU (4 cores))" in str(err.value)
    with pytest.raises(HostError, match="recorded: none"):
        load_host(tmp_path / "empty", "zzz")


def test_a_bad_record_names_its_file(tmp_path: Path) -> None:
    _record(tmp_path, "abc123456789", "Alpha CPU (4 cores)", 1.0)
    bad = tmp_path / "hosts" / "abc123456789.json"
    bad.write_text(json.dumps({**json.loads(bad.read_text()), "score": -1}))
    with pytest.raises(HostError, match=r"abc123456789\.json: invalid host record field 'score'"):
        recorded_hosts(tmp_path)


def test_time_scale_is_the_score_ratio(tmp_path: Path) -> None:
    fast = _record(tmp_path, "f" * 12, "Fast", 2.0)
    slow = _record(tmp_path, "5" * 12, "Slow", 0.5)
    assert time_scale(fast, slow) == 4.0 and time_scale(slow, fast) == 0.25
    assert time_scale(fast, fast) == 1.0
    old = _record(tmp_path, "0" * 12, "Old", 1.0, version=BENCHMARK_VERSION + 1)
    with pytest.raises(HostError, match="benchmark versions"):
        time_scale(fast, old)
