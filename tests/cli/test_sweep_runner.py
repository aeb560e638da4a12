"""The sweep runner's machinery (pools, Ray, resume, failure isolation) with a tiny point runner."""

import importlib.util
import json
from pathlib import Path

import pytest

from cdbench.harness.sweep import SweepSpec, run_sweep, sweep_table


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
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'cdbench[ray]')")
def test_local_ray_instance_gives_the_same_results(tmp_path):
    import ray

    try:
        _check(run_sweep(SPEC, BASE, tmp_path, ray_address="local", runner=write_summary), tmp_path)
    finally:
        ray.shutdown()
