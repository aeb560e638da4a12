"""``cdbench host``: this host's record and the table of recorded hosts (the benchmark replaced by a constant)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.harness.costs import host as host_module
from cdbench.harness.costs.host import recorded_hosts

runner = CliRunner()


@pytest.fixture
def benchmark_calls(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    calls: list[float] = []

    def fake() -> float:
        calls.append(1.25)
        return 1.25

    monkeypatch.setattr(host_module, "run_benchmark", fake)
    return calls


def test_host_records_and_lists(tmp_path: Path, benchmark_calls: list[float]) -> None:
    result = runner.invoke(app, ["host", "--store", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (here,) = recorded_hosts(tmp_path)
    assert f"id: {here.id}" in result.output and "score: 1.25" in result.output
    assert f"{here.id} (this)" in result.output and "x1.000" in result.output
    assert runner.invoke(app, ["host", "--store", str(tmp_path)]).exit_code == 0 and len(benchmark_calls) == 1
    assert runner.invoke(app, ["host", "--store", str(tmp_path), "--rerun"]).exit_code == 0
    assert len(benchmark_calls) == 2


def test_a_bad_record_is_one_line(tmp_path: Path, benchmark_calls: list[float]) -> None:
    (tmp_path / "hosts").mkdir()
    (tmp_path / "hosts" / "broken.json").write_text("{")
    result = runner.invoke(app, ["host", "--store", str(tmp_path)])
    assert result.exit_code == 2 and result.output.startswith("error:") and "broken.json" in result.output


def test_help_has_an_example() -> None:
    result = runner.invoke(app, ["host", "--help"])
    assert result.exit_code == 0 and "Example" in result.output and "--rerun" in result.output
