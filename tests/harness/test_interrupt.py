"""A run that stops early keeps what it finished: Ctrl-C, SIGTERM, an error, even SIGKILL."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.harness.scheduler import Scheduler
from cdbench.results.config_files import builtin_config_path
from cdbench.results.stopped_run import (
    PARTIAL_REQUESTS_DIR,
    PARTIAL_STEPS_DIR,
    STOPPED_SUMMARY_FILE,
)

runner = CliRunner()


def _start_run(out: Path, requests: int = 3000) -> subprocess.Popen:
    """A real hybrid run in its own process, with the signals' default handling (Ctrl-C raises KeyboardInterrupt)."""
    return subprocess.Popen([sys.executable, "-m", "cdbench", "run", "--mode", "hybrid", "-n", str(requests),
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_spilled_requests(run: subprocess.Popen, out: Path, timeout_s: float = 240) -> None:
    """Until the run has written finished requests as it goes (so it is simulating and some requests ended)."""
    deadline = time.monotonic() + timeout_s
    while not list((out / PARTIAL_REQUESTS_DIR).glob("part-*.parquet")):
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline, "no finished requests were written"
        time.sleep(0.2)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_saves_its_finished_requests_and_a_summary_marked_interrupted(tmp_path, signum):
    out = tmp_path / "run"
    run = _start_run(out)
    _wait_for_spilled_requests(run, out)
    run.send_signal(signum)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 128 + signum, (stdout, stderr)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"interrupted ({signum.name}): "), stderr
    summary = json.loads((out / STOPPED_SUMMARY_FILE).read_text())
    status = summary["run_status"]
    assert status["status"] == "interrupted" and status["reason"] == signum.name
    assert status["requests_total"] == 3000 and 0 < status["requests_done"] < 3000
    assert f"{status['requests_done']} of 3000 requests finished; they and their summary are in {out}/" in lines[0]
    requests = pd.read_parquet(out / "requests.parquet")
    assert len(requests) == status["requests_done"] and requests["finish_s"].notna().all()
    assert summary["completed"] + summary["failed"] == len(requests)
    assert not (out / "summary.json").exists() and not (out / PARTIAL_REQUESTS_DIR).exists()
    assert "**This run interrupted" in (out / "report.md").read_text()

    report = runner.invoke(app, ["report", str(out), "--quiet"])
    assert report.exit_code == 0 and "this run interrupted" in report.output
    gate = runner.invoke(app, ["gate", str(out), "--baseline", "ci/baseline.json"])
    assert gate.exit_code == 2 and "stopped early" in gate.output


def test_a_run_killed_outright_leaves_its_finished_requests_readable(tmp_path):
    out = tmp_path / "run"
    run = _start_run(out)
    _wait_for_spilled_requests(run, out)
    run.send_signal(signal.SIGKILL)
    run.communicate(timeout=60)
    finished = pd.read_parquet(out / PARTIAL_REQUESTS_DIR)
    assert len(finished) > 0 and finished["finish_s"].notna().all()
    assert finished["request_id"].is_unique
    # handed over in the run's order (issue order), as they join into requests.parquet at a run's end
    assert finished["issued_s"].is_monotonic_increasing
    steps = pd.read_parquet(out / PARTIAL_STEPS_DIR)  # the steps so far, likewise
    assert len(steps) > 0 and steps["start_s"].is_monotonic_increasing
    report = runner.invoke(app, ["report", str(out)])
    assert report.exit_code == 2
    assert f"the requests it finished are in {out / PARTIAL_REQUESTS_DIR}/" in report.output


def test_a_run_failing_mid_way_saves_what_it_finished_and_compare_labels_it(tmp_path, monkeypatch):
    iterate = Scheduler._iterate
    calls = {"n": 0}

    def failing(self, t):
        calls["n"] += 1
        if calls["n"] == 300:
            raise RuntimeError("simulated fault in step 300")
        return iterate(self, t)

    ci = str(builtin_config_path("ci"))
    whole = tmp_path / "whole"
    assert runner.invoke(app, ["run", ci, "--out", str(whole)]).exit_code == 0
    monkeypatch.setattr(Scheduler, "_iterate", failing)
    out = tmp_path / "broken"
    result = runner.invoke(app, ["run", ci, "--out", str(out)])
    assert result.exit_code == 1
    status = json.loads((out / STOPPED_SUMMARY_FILE).read_text())["run_status"]
    assert status["status"] == "failed" and status["reason"] == "simulated fault in step 300"
    total = status["requests_total"]
    assert 0 < status["requests_done"] < total
    line = result.output.strip()
    assert line == (f"error: simulated fault in step 300 (details in {out / 'run.log'}; {status['requests_done']} of "
                    f"{total} requests finished; they and their summary are in {out}/)")
    # the finished requests' rows are the complete run's rows for the same requests (outputs unchecked)
    done = pd.read_parquet(out / "requests.parquet").set_index("request_id").drop(columns="valid")
    reference = pd.read_parquet(whole / "requests.parquet").set_index("request_id").drop(columns="valid")
    pd.testing.assert_frame_equal(done, reference.loc[done.index])

    monkeypatch.undo()
    compared = runner.invoke(app, ["compare", str(whole), str(out), "--out", str(tmp_path / "cmp")])
    assert compared.exit_code == 0, compared.output
    assert f"`broken (failed, {status['requests_done']} of {total} done)`" in (tmp_path / "cmp" / "comparison.md").read_text()
