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


def _refused(result, requests: int, available: str, memory: int = footprint.STREAMED_BYTES):
    """``memory``: the estimate (by default a streamed model run's, as the configs here are)."""
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert f"{requests:,} requests need about {footprint._bytes(memory)} of memory" in lines[0], lines[0]
    assert f"this machine has {available} available" in lines[0] and "Traceback" not in result.output


@pytest.fixture
def one_megabyte_free(monkeypatch):
    monkeypatch.setattr(footprint, "available_memory", lambda: 1_000_000)


def test_an_absurd_request_count_is_refused_with_its_memory_estimate(tmp_path, monkeypatch):
    """A hybrid run holds its requests (a streamed model run's memory does not grow with their count)."""
    monkeypatch.setattr(footprint, "available_memory", lambda: 16 * 10**9)
    out = tmp_path / "absurd"
    result = runner.invoke(app, ["run", "--mode", "hybrid", "--requests", "1000000000", "--out", str(out)])
    _refused(result, 10**9, "16.0 GB", 10**9 * (footprint.BYTES_PER_REQUEST + footprint.HELD_WORKLOAD_BYTES))
    assert "TB of memory (2.3 kB a request)" in result.output
    assert _nothing_run(out)


def test_a_run_beyond_the_available_memory_is_refused_before_it_starts(tmp_path, one_megabyte_free):
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", CI, "--requests", "1000", "--out", str(out)])
    _refused(result, 1000, "1.0 MB")
    assert "of memory (whatever the request count) and " in result.output and " of CPU time" in result.output
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
    monkeypatch.setattr(footprint, "available_memory", lambda: footprint.STREAMED_BYTES)
    result = runner.invoke(app, ["run", CI, "--requests", "40", "--out", str(tmp_path / "ok")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "ok" / "summary.json").is_file()


@pytest.fixture
def one_megabyte_of_disk(monkeypatch):
    monkeypatch.setattr(footprint, "free_disk", lambda folder: 1_000_000)


def _refused_for_disk(result, needed: int):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert f"the run folders need about {footprint._bytes(needed)} of disk" in lines[0], lines[0]
    assert "has 1.0 MB free" in lines[0] and "Traceback" not in result.output


def test_a_run_whose_folder_would_not_fit_on_the_disk_is_refused_before_it_starts(tmp_path, one_megabyte_of_disk):
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", CI, "--requests", "1000", "--out", str(out)])
    _refused_for_disk(result, 1000 * footprint.FOLDER_BYTES_PER_REQUEST)
    assert _nothing_run(out)
    small = runner.invoke(app, ["run", CI, "--requests", "100", "--out", str(tmp_path / "small")])
    assert small.exit_code == 0, small.output  # 160 kB fit


def test_compare_and_sweep_check_the_disk_their_runs_need_together(tmp_path, one_megabyte_of_disk):
    result = runner.invoke(app, ["compare", "--policies", "sglang,vllm", "-c", CI, "--requests", "400",
                                 "--out", str(tmp_path / "cmp")])
    _refused_for_disk(result, 2 * 400 * footprint.FOLDER_BYTES_PER_REQUEST)
    assert _nothing_run(tmp_path / "cmp")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"name": "t", "base": CI, "overrides": {"workload.num_requests": 400},
                                     "grid": {"seed": [1, 2]}}))
    result = runner.invoke(app, ["sweep", str(sweep), "--out", str(tmp_path / "sw")])
    _refused_for_disk(result, 2 * 400 * footprint.FOLDER_BYTES_PER_REQUEST)
    assert _nothing_run(tmp_path / "sw")


def test_the_free_disk_is_read_where_the_folder_will_be(tmp_path):
    assert footprint.free_disk(tmp_path / "not" / "yet") == footprint.free_disk(tmp_path) > 0


def test_a_resumed_sweep_asks_disk_for_the_points_it_still_has_to_run(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"name": "t", "base": CI, "overrides": {"workload.num_requests": 400},
                                     "grid": {"seed": [1, 2]}}))
    out = tmp_path / "sw"
    first = runner.invoke(app, ["sweep", str(sweep), "--out", str(out)])
    assert first.exit_code == 0, first.output
    (out / "seed=2" / "summary.json").unlink()  # one point left to run: 400 requests' folder
    monkeypatch.setattr(footprint, "free_disk", lambda folder: 1_000_000)
    resumed = runner.invoke(app, ["sweep", str(sweep), "--out", str(out)])
    assert resumed.exit_code == 0, resumed.output  # 640 kB fit where both points (1.3 MB) would not
    assert "1 run, 1 already done" in resumed.output
    again = runner.invoke(app, ["sweep", str(sweep), "--out", str(out), "--overwrite"])
    _refused_for_disk(again, 2 * 400 * footprint.FOLDER_BYTES_PER_REQUEST)  # overwriting runs both again

