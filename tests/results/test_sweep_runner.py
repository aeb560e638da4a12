"""The sweep runner's machinery (pools, Ray, resume, failure isolation) with a tiny point runner."""

import importlib.util
import json
from pathlib import Path

import pytest

from cdbench.results.sweep import SweepSpec, run_sweep, sweep_table


def write_summary(tree, folder):
    """A point runner: fails for rate 3, else writes a summary derived from the config."""
    if tree["workload"]["rate"] == 3:
        return "ConfigError: rate 3 is not allowed here"
    Path(folder).mkdir(parents=True, exist_ok=True)
    Path(folder, "summary.json").write_text(json.dumps({"request_throughput": tree["workload"]["rate"] * 0.9}))
    return None


SPEC = SweepSpec(name="t", grid={"workload.rate": [1, 2, 3], "backend.name": ["a", "b"]})
BASE = {"workload": {"rate": 0}, "backend": {"name": "x"}}


def _check(outcomes, tmp_path):
    assert [o.point.index for o in outcomes] == list(range(6))
    assert [o.status for o in outcomes] == ["done"] * 4 + ["failed"] * 2
    table = sweep_table(SPEC, outcomes)
    assert table["request_throughput"].tolist()[:4] == pytest.approx([0.9, 0.9, 1.8, 1.8])
    assert table["error"].tolist()[4] == "ConfigError: rate 3 is not allowed here"


def test_in_process_run_then_resume_skips_finished_points(tmp_path):
    seen = []
    outcomes = run_sweep(SPEC, BASE, tmp_path, runner=write_summary, on_outcome=seen.append)
    _check(outcomes, tmp_path)
    assert len(seen) == 6
    again = run_sweep(SPEC, BASE, tmp_path, runner=write_summary)
    assert [o.status for o in again] == ["skipped"] * 4 + ["failed"] * 2
    assert json.loads((tmp_path / "sweep.json").read_text())["name"] == "t"


def test_process_pool_gives_the_same_results(tmp_path):
    _check(run_sweep(SPEC, BASE, tmp_path, workers=2, runner=write_summary), tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install -e '.[ray]')")
def test_sweep_on_a_local_ray_instance_matches_local_processes(tmp_path):
    """``cdbench sweep --ray local`` end to end: real points on Ray workers, the same files as a local run.

    Run with: pip install -e '.[ray]' && pytest -m slow tests/cli/test_sweep_runner.py
    """
    import ray
    import yaml
    from typer.testing import CliRunner

    from cdbench.cli.app import app
    from cdbench.results.config_files import builtin_config_path

    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump({
        "name": "ray", "base": str(builtin_config_path("ci")), "overrides": {"workload.num_requests": 20},
        # The unknown corpus passes validation and fails inside the worker: failure isolation on Ray too.
        "grid": {"workload.arrival.rate": [20, 60], "workload.corpus": [["embedded"], ["no-such-corpus"]]},
    }))
    runner = CliRunner()
    local = runner.invoke(app, ["sweep", str(sweep_file), "--out", str(tmp_path / "local")])
    try:
        on_ray = runner.invoke(app, ["sweep", str(sweep_file), "--ray", "local", "--out", str(tmp_path / "ray")])
    finally:
        ray.shutdown()
    for result in (local, on_ray):
        assert result.exit_code == 1, result.output
        assert "2 run, 0 already done, 2 failed" in result.output and "unknown corpus 'no-such-corpus'" in result.output
    done = sorted(p.parent.name for p in (tmp_path / "local").glob("*/summary.json"))
    assert len(done) == 2 and all("embedded" in point for point in done)
    for point in done:
        for name in ("summary.json", "config.yaml"):
            assert (tmp_path / "ray" / point / name).read_text() == (tmp_path / "local" / point / name).read_text()
        assert (tmp_path / "ray" / point / "report.md").is_file()
    # Same table, once the failed points' log paths (which name the sweep folder) are aligned.
    ray_csv = (tmp_path / "ray" / "sweep.csv").read_text().replace(str(tmp_path / "ray"), str(tmp_path / "local"))
    assert ray_csv == (tmp_path / "local" / "sweep.csv").read_text()
