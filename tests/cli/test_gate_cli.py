import json

from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.reports.gate import Baseline

runner = CliRunner()


def test_update_then_pass_then_fail_on_a_regression(simulated_run, tmp_path):
    baseline = tmp_path / "baseline.json"
    result = runner.invoke(app, ["gate", str(simulated_run.folder), "--baseline", str(baseline), "--update",
                                 "--tolerance", "mean_ttft_ms=0.5"])
    assert result.exit_code == 0, result.output
    stored = Baseline.load(baseline)
    assert stored.metrics["completed"] == 20 and stored.tolerances_pct == {"mean_ttft_ms": 0.5}

    result = runner.invoke(app, ["gate", str(simulated_run.folder), "--baseline", str(baseline)])
    assert result.exit_code == 0, result.output
    assert "gate passed" in result.output and "mean_ttft_ms" in result.output

    data = json.loads(baseline.read_text())
    data["metrics"]["mean_ttft_ms"] *= 0.9  # the baseline was faster: the run regressed
    data["metrics"]["request_throughput"] *= 0.5  # the baseline was slower: the run improved
    baseline.write_text(json.dumps(data))
    result = runner.invoke(app, ["gate", str(simulated_run.folder), "--baseline", str(baseline)])
    assert result.exit_code == 1
    assert "regressed" in result.output and "improved" in result.output
    assert "gate failed" in result.output and "mean_ttft_ms" in result.output.split("gate failed")[1]

    loose = runner.invoke(app, ["gate", str(simulated_run.folder), "--baseline", str(baseline), "-t", "mean_ttft_ms=20"])
    assert loose.exit_code == 0, loose.output


def test_user_mistakes_are_one_line_errors(simulated_run, tmp_path):
    missing = runner.invoke(app, ["gate", str(simulated_run.folder), "--baseline", str(tmp_path / "none.json")])
    assert missing.exit_code == 2
    assert missing.output.strip().startswith("error:") and "does not exist" in missing.output
    assert "Traceback" not in missing.output
    not_a_run = runner.invoke(app, ["gate", str(tmp_path), "--baseline", str(tmp_path / "b.json")])
    assert not_a_run.exit_code == 2 and "not a cdbench run folder" in not_a_run.output
    bad_tol = runner.invoke(app, ["gate", str(simulated_run.folder), "--baseline", "x", "-t", "p99"])
    assert bad_tol.exit_code == 2 and "METRIC=PCT" in bad_tol.output


def test_a_misspelt_tolerance_fails_instead_of_passing_silently(simulated_run, tmp_path):
    baseline = tmp_path / "baseline.json"
    assert runner.invoke(app, ["gate", str(simulated_run.folder), "-b", str(baseline), "--update"]).exit_code == 0
    for extra in ([], ["--update"]):
        result = runner.invoke(app, ["gate", str(simulated_run.folder), "-b", str(baseline), "-t", "p99_tft_ms=5",
                                     *extra])
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error: --tolerance names a metric") and "'p99_tft_ms'" in result.output
        assert "did you mean p99_ttft_ms" in result.output
    assert "p99_tft_ms" not in baseline.read_text()  # the failed --update wrote nothing


def test_an_earlier_run_folder_or_its_summary_is_a_baseline(simulated_run, tmp_path):
    for baseline in (simulated_run.folder, simulated_run.folder / "summary.json"):
        result = runner.invoke(app, ["gate", str(simulated_run.folder), "--baseline", str(baseline)])
        assert result.exit_code == 0, result.output
        assert "gate passed" in result.output and "mean_ttft_ms" in result.output
    # A slower earlier run: the current one improved; a faster one: it regressed beyond the default 1 %.
    for factor, code, verdict in ((1.5, 0, "improved"), (0.9, 1, "regressed")):
        old = tmp_path / f"old{factor}"
        old.mkdir()
        summary = json.loads((simulated_run.folder / "summary.json").read_text())
        summary["mean_ttft_ms"] *= factor
        (old / "summary.json").write_text(json.dumps(summary))
        result = runner.invoke(app, ["gate", str(simulated_run.folder), "--baseline", str(old)])
        assert result.exit_code == code, result.output
        assert verdict in result.output and "1%" in result.output


def test_update_refuses_to_write_into_a_run(simulated_run):
    summary = simulated_run.folder / "summary.json"
    before = summary.read_text()
    for baseline in (simulated_run.folder, summary):
        result = runner.invoke(app, ["gate", str(simulated_run.folder), "--baseline", str(baseline), "--update"])
        assert result.exit_code == 2 and result.output.startswith("error: --update writes a baseline JSON file")
    assert summary.read_text() == before
