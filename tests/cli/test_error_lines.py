"""Error lines carry the message, never the exception's class (``error: ValueError: ...`` is noise to a user)."""

import re

import pytest
import torch
import yaml
from typer.testing import CliRunner

from cdbench.cli.app import app

runner = CliRunner()

CLASS_PREFIX = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception): ")


def _error_line(result, code: int) -> str:
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.startswith(("error:", "failed "))]
    assert len(lines) == 1, result.output
    assert not CLASS_PREFIX.search(lines[0]), lines[0]
    return lines[0]


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="live mode would run here; its refusal on a CPU host "
                                                               "is the error checked")


@NO_GPU
def test_a_run_that_fails_names_the_reason_not_the_class(tmp_path):
    out = tmp_path / "live"
    line = _error_line(runner.invoke(app, ["run", "--mode", "live", "-n", "2", "--out", str(out)]), 1)
    assert line.startswith("error: mode 'live' runs every step on a CUDA GPU; this machine has none")
    assert f"details in {out / 'run.log'}" in line
    assert "ValueError" in (out / "run.log").read_text()  # the class stays in the log, for whoever debugs it


@NO_GPU
def test_a_failing_collective_names_the_reason_not_the_class(tmp_path):
    out = tmp_path / "nccl"
    result = runner.invoke(app, ["run", "--mode", "hybrid", "-n", "2", "--set", "scheduler.ranks=2",
                                 "--set", "scheduler.collectives=nccl", "--out", str(out)])
    assert _error_line(result, 1).startswith("error: collectives 'nccl' puts each of the 2 ranks on its own GPU")


@NO_GPU
def test_a_failed_sweep_point_names_the_reason_not_the_class(tmp_path):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({"base": "ci", "overrides": {"workload.num_requests": 2},
                                     "grid": {"mode": ["live"]}}))
    line = _error_line(runner.invoke(app, ["sweep", str(sweep), "--out", str(tmp_path / "out")]), 1)
    assert line.startswith("failed mode=live: mode 'live' runs every step on a CUDA GPU")
