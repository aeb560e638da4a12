"""A run whose estimated memory is beyond what the machine has is refused up front, in one line with the estimate."""

import pytest
import yaml
from typer.testing import CliRunner

import cdbench.harness.footprint as footprint
from cdbench.cli.app import app
from cdbench.results.config_files import builtin_config_path

runner = CliRunner()
CI = str(builtin_config_path("ci"))


def _nothing_run(folder):
    """A refused run is refused before its folder is claimed: nothing is left behind."""
    return not folder.exists()


def _refused(result, requests: int, available: str):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    # (the configs here are streamed model runs)
    memory = footprint._bytes(footprint.STREAMED_BYTES + requests * footprint.STREAMED_BYTES_PER_REQUEST)
    assert f"{requests:,} requests need about {memory} of memory" in lines[0], lines[0]
    assert f"this machine has {available} available" in lines[0] and "Traceback" not in result.output


@pytest.fixture
def one_megabyte_free(monkeypatch):
    monkeypatch.setattr(footprint, "available_memory", lambda: 1_000_000)


def test_an_absurd_request_count_is_refused_with_its_memory_and_time_estimate(tmp_path, monkeypatch):
    monkeypatch.setattr(footprint, "available_memory", lambda: 16 * 10**9)
    out = tmp_path / "absurd"
    result = runner.invoke(app, ["run", "--mode", "model", "--requests", "1000000000", "--out", str(out)])
    _refused(result, 10**9, "16.0 GB")
    assert "GB of memory" in result.output and "days of CPU time" in result.output
    assert _nothing_run(out)


def test_a_run_beyond_the_available_memory_is_refused_before_it_starts(tmp_path, one_megabyte_free):
    out = tmp_path / "run"
    _refused(runner.invoke(app, ["run", CI, "--requests", "1000", "--out", str(out)]), 1000, "1.0 MB")
    assert _nothing_run(out)


def test_compare_and_sweep_go_through_the_same_check(tmp_path, one_megabyte_free):
    result = runner.invoke(app, ["compare", "--policies", "sglang,vllm", "-c", CI, "--requests", "1000",
                                 "--out", str(tmp_path / "cmp")])
    _refused(result, 1000, "1.0 MB")
    assert _nothing_run(tmp_path / "cmp")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"name": "t", "base": CI, "overrides": {"workload.num_requests": 1000},
                                     "grid": {"seed": [1, 2]}}))
    result = runner.invoke(app, ["sweep", str(sweep), "--out", str(tmp_path / "sw")])
    _refused(result, 1000, "1.0 MB")
    assert "sweep point seed=1" in result.output and _nothing_run(tmp_path / "sw")


def test_a_run_that_fits_still_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(footprint, "available_memory",
                        lambda: footprint.STREAMED_BYTES + 40 * footprint.STREAMED_BYTES_PER_REQUEST)
    result = runner.invoke(app, ["run", CI, "--requests", "40", "--out", str(tmp_path / "ok")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "ok" / "summary.json").is_file()
