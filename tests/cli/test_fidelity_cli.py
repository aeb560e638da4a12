import json
import shutil

import pytest
from typer.testing import CliRunner

from cdbench.cli.app import app

runner = CliRunner()


def _copy(simulated_run, tmp_path, name, scale=None, requests=('{"id":1}', '{"id":2}')):
    """A copy of the simulated run with a workload trace, its summary's metrics scaled by ``scale``."""
    folder = tmp_path / name
    shutil.copytree(simulated_run.folder, folder)
    summary = json.loads((folder / "summary.json").read_text())
    for metric, factor in (scale or {}).items():
        summary[metric] *= factor
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "workload.trace.jsonl").write_text(f'{{"type":"header","name":"{name}"}}\n' + "\n".join(requests) + "\n")
    return folder


@pytest.fixture
def runs(simulated_run, tmp_path):
    return {
        "hybrid": _copy(simulated_run, tmp_path, "hybrid"),
        "hybrid-b": _copy(simulated_run, tmp_path, "hybrid-b", {"median_ttft_ms": 1.08}),
        "close": _copy(simulated_run, tmp_path, "close", {"median_ttft_ms": 1.03, "p99_itl_ms": 0.95}),
        "far": _copy(simulated_run, tmp_path, "far", {"median_ttft_ms": 1.07}),
        "other": _copy(simulated_run, tmp_path, "other", requests=('{"id":1}', '{"id":9}')),
    }


def test_within_tolerance_exits_0_and_writes_the_report(runs, tmp_path):
    out = tmp_path / "fid"
    result = runner.invoke(app, ["fidelity", str(runs["hybrid"]), str(runs["close"]), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "fidelity passed" in result.output and "median_ttft_ms" in result.output
    assert "+3.0%" in result.output
    assert (out / "fidelity.md").is_file() and (out / "fidelity.csv").is_file()
    assert (out / "plots" / "ttft_cdf.png").is_file()


def test_beyond_tolerance_exits_1_and_a_tolerance_can_widen_the_bar(runs, tmp_path):
    args = ["fidelity", str(runs["hybrid"]), str(runs["close"]), str(runs["far"]), "--out", str(tmp_path / "f")]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "fidelity failed" in result.output and "median_ttft_ms (far)" in result.output
    assert "(close)" not in result.output.split("fidelity failed")[1]
    assert runner.invoke(app, [*args, "-t", "median_ttft_ms=8", "--overwrite"]).exit_code == 0


def test_the_noise_column_and_a_noise_floor_above_the_tolerance(runs, tmp_path):
    args = ["fidelity", str(runs["hybrid"]), str(runs["far"]), "--out", str(tmp_path / "f"),
            "--noise", str(runs["hybrid"]), str(runs["hybrid-b"])]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output  # +7 % is within the 8 % the two hybrid runs differ by
    assert "noise" in result.output and "8.0% (noise)" in result.output
    md = (tmp_path / "f" / "fidelity.md").read_text()
    assert "| metric | hybrid | far | far error | noise | bar |" in md
    assert "| +7.0% | 8.0% | 8.0% (noise) |" in md
    assert "`hybrid` and `noise hybrid-b` (same seed)" in md


def test_noise_run_adds_to_the_noise_set_measured_against_the_first_noise_run(runs, simulated_run, tmp_path):
    # against hybrid: hybrid-b +8 %, hybrid-c -12 % (hybrid-b against hybrid-c would be +22.7 %)
    hybrid_c = _copy(simulated_run, tmp_path, "hybrid-c", {"median_ttft_ms": 0.88})
    farther = _copy(simulated_run, tmp_path, "farther", {"median_ttft_ms": 1.11})
    args = ["fidelity", str(runs["hybrid"]), str(farther), "--noise", str(runs["hybrid"]), str(runs["hybrid-b"])]
    two = runner.invoke(app, [*args, "--out", str(tmp_path / "two")])
    assert two.exit_code == 1, two.output  # +11 % is beyond the 8 % floor of two runs
    result = runner.invoke(app, [*args, "--noise-run", str(hybrid_c), "--out", str(tmp_path / "three")])
    assert result.exit_code == 0, result.output
    md = (tmp_path / "three" / "fidelity.md").read_text()
    assert "| +11.0% | 12.0% | 12.0% (noise) |" in md
    assert "the largest |relative error| of `noise hybrid-b`, `noise hybrid-c` against `hybrid` (same seed)" in md


def test_bad_input_is_a_one_line_error_with_exit_2(runs, tmp_path):
    cases = [
        ([str(runs["hybrid"]), str(tmp_path / "missing")], "not a cdbench run folder"),
        ([str(runs["hybrid"]), str(tmp_path)], "not a cdbench run folder"),
        ([str(runs["hybrid"])], "at least two run folders"),
        ([str(runs["hybrid"]), str(runs["close"]), "-t", "p99_tft_ms=5"], "did you mean p99_ttft_ms"),
        ([str(runs["hybrid"]), str(runs["close"]), "--noise", str(runs["hybrid"]), str(runs["hybrid"])], "twice"),
        ([str(runs["hybrid"]), str(runs["close"]), "--noise", str(runs["hybrid"]), str(tmp_path / "missing")],
         "not a cdbench run folder"),
        ([str(runs["hybrid"]), str(runs["close"]), "--noise", str(runs["hybrid"]), str(runs["hybrid-b"]),
          "--noise-run", str(tmp_path / "missing")], "not a cdbench run folder"),
        ([str(runs["hybrid"]), str(runs["close"]), "--noise", str(runs["hybrid"]), str(runs["hybrid-b"]),
          "--noise-run", str(runs["far"]), "--noise-run", str(runs["far"])], f"name {runs['far']} twice"),
        ([str(runs["hybrid"]), str(runs["close"]), "--noise", str(runs["hybrid"]), str(runs["hybrid-b"]),
          "--noise-run", str(runs["hybrid"] / ".")], "twice"),
        ([str(runs["hybrid"]), str(runs["close"]), "--noise-run", str(runs["hybrid-b"])],
         "give --noise X Y as well"),
    ]
    for args, message in cases:
        result = runner.invoke(app, ["fidelity", *args, "--out", str(tmp_path / "f")])
        assert result.exit_code == 2, (args, result.output)
        assert result.output.startswith("error:") and message in result.output, result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 2


def test_runs_of_different_workloads_are_refused_unless_allowed(runs, tmp_path):
    args = ["fidelity", str(runs["hybrid"]), str(runs["other"]), "--out", str(tmp_path / "f")]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2
    assert "different workload" in refused.output and "--allow-different-workloads" in refused.output
    noise = runner.invoke(app, ["fidelity", str(runs["hybrid"]), str(runs["close"]), "--out", str(tmp_path / "f"),
                                "--noise", str(runs["hybrid"]), str(runs["other"])])
    assert noise.exit_code == 2 and "different workload" in noise.output
    third = runner.invoke(app, ["fidelity", str(runs["hybrid"]), str(runs["close"]), "--out", str(tmp_path / "f"),
                                "--noise", str(runs["hybrid"]), str(runs["hybrid-b"]), "--noise-run", str(runs["other"])])
    assert third.exit_code == 2 and "other has a different workload" in third.output
    allowed = runner.invoke(app, [*args, "--allow-different-workloads"])
    assert allowed.exit_code == 0, allowed.output  # same metrics, different requests


def _stopped(folder, where="summary.stopped.json"):
    """``folder``'s run as one that stopped early: its summary with a run_status, in ``where``."""
    summary = json.loads((folder / "summary.json").read_text())
    summary["run_status"] = {"status": "interrupted", "reason": "SIGINT", "requests_done": 1, "requests_total": 2}
    (folder / "summary.json").unlink()
    (folder / where).write_text(json.dumps(summary))
    return folder


def test_a_run_that_stopped_early_is_refused_from_a_folder_and_from_a_pack(runs, tmp_path):
    from cdbench.results.pack import pack_runs

    _stopped(runs["close"])
    result = runner.invoke(app, ["fidelity", str(runs["hybrid"]), str(runs["close"]), "--out", str(tmp_path / "f")])
    assert result.exit_code == 2 and result.output.startswith("error:")
    assert "holds a run that stopped early (interrupted (SIGINT) after 1 of 2 requests)" in " ".join(result.output.split())
    noise = runner.invoke(app, ["fidelity", str(runs["hybrid"]), str(runs["far"]),
                                "--noise", str(runs["hybrid"]), str(runs["close"]), "--out", str(tmp_path / "g")])
    assert noise.exit_code == 2 and "stopped early" in noise.output
    # a pack holds what its summary.json says: a run_status there is a stopped run too
    _stopped(runs["far"], where="summary.json")
    pack = pack_runs({"hybrid": runs["hybrid"], "far": runs["far"]}, tmp_path / "p.pack")
    packed = runner.invoke(app, ["fidelity", f"{pack}::hybrid", f"{pack}::far", "--out", str(tmp_path / "h")])
    assert packed.exit_code == 2 and f"{pack}::far holds a run that stopped early" in " ".join(packed.output.split())
    assert not any((tmp_path / name).exists() for name in ("f", "g", "h"))
