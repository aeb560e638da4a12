import json

import yaml
from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.results.config_files import builtin_config_path

runner = CliRunner()


def test_model_run_writes_every_artifact_and_is_deterministic(tmp_path):
    ci = str(builtin_config_path("ci"))
    first = runner.invoke(app, ["run", ci, "--requests", "40", "--seed", "7", "--out", str(tmp_path / "a")])
    assert first.exit_code == 0, first.output
    assert "Latency (ms)" in first.output and "results:" in first.output
    folder = tmp_path / "a"
    for name in ("config.yaml", "requests.parquet", "steps.parquet", "summary.json", "report.md", "trace.json",
                 "plots/ttft_cdf.png", "plots/step_breakdown.png", "plots/compile_time.png"):
        assert (folder / name).is_file(), name
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert config["seed"] == 7 and config["workload"]["seed"] == 7 and config["workload"]["num_requests"] == 40
    assert config["scheduler"] is not None and config["policy"]["name"] == "sglang"  # resolved, defaults filled
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["completed"] + summary["failed"] == 40
    trace = json.loads((folder / "trace.json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"])

    again = runner.invoke(app, ["run", ci, "--requests", "40", "--seed", "7", "--out", str(tmp_path / "b")])
    assert again.exit_code == 0
    assert (tmp_path / "b" / "summary.json").read_text() == (folder / "summary.json").read_text()
    other = runner.invoke(app, ["run", ci, "--requests", "40", "--seed", "8", "--set", "trace_steps=5",
                                "--out", str(tmp_path / "c")])
    assert (tmp_path / "c" / "summary.json").read_text() != (folder / "summary.json").read_text()
    assert "trace capped: only the first 5 of" in (tmp_path / "c" / "report.md").read_text()


def test_config_mistakes_are_one_line_errors_naming_key_value_and_choices(tmp_path):
    ci = str(builtin_config_path("ci"))
    cases = [
        (["run", ci, "--policy", "trtllm"], "policy.name = 'trtllm': Input should be 'sglang', 'vllm', 'vllm-0.10' or 'vllm-0.6'"),
        (["run", ci, "--set", "workload.rte=3"], "unknown key 'workload.rte' (value 3); allowed keys here: arrival"),
        (["run", ci, "--mode", "replay"], "mode = 'replay': Input should be 'model', 'hybrid' or 'live'"),
        (["run", str(tmp_path / "missing.yaml")], "missing.yaml does not exist"),
        (["run", ci, "--set", "nonsense"], "is not PATH=VALUE"),
    ]
    for args, expected in cases:
        result = runner.invoke(app, [*args, "--out", str(tmp_path / "x")])
        assert result.exit_code == 2, (args, result.output)
        assert result.output.startswith("error: ") and expected in result.output, result.output
        assert "Traceback" not in result.output


def test_unknown_corpus_fails_cleanly_with_the_known_names(tmp_path):
    result = runner.invoke(app, ["run", str(builtin_config_path("ci")), "--corpus", "nope", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown corpus 'nope'" in result.output and "embedded" in result.output


def test_broken_yaml_names_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: model\nworkload: {num_requests: [\n")
    result = runner.invoke(app, ["run", str(bad)])
    assert result.exit_code == 2 and "not valid YAML (line" in result.output


def test_small_hybrid_run_with_the_real_backend(tmp_path):
    result = runner.invoke(app, ["run", "--requests", "6", "--rate", "50", "--set", "workload.corpus_limit=6",
                                 "--set", "workload.kinds=[regex, choice]", "--out", str(tmp_path / "h")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "h" / "summary.json").read_text())
    assert summary["completed"] + summary["failed"] == 6
    assert summary["validated"] > 0 and summary["validity_rate"] == 1.0
    # The default config carries SLOs, so goodput is measured (not "-"): at most every request meets them.
    assert 0 <= summary["request_goodput"] <= summary["request_throughput"]


def test_a_failure_that_is_not_a_user_mistake_is_one_line_with_its_traceback_in_run_log(tmp_path, monkeypatch):
    import cdbench.harness.run as run_module

    def broken_simulate(*args, **kwargs):
        raise RuntimeError("scheduler invariant broken")

    monkeypatch.setattr(run_module, "simulate", broken_simulate)
    out = tmp_path / "crashed"
    result = runner.invoke(app, ["run", str(builtin_config_path("ci")), "--requests", "5", "--out", str(out)])
    assert result.exit_code == 1
    assert result.output.strip() == (f"error: scheduler invariant broken (details in {out / 'run.log'}; 0 requests "
                                     f"finished; they and their summary are in {out}/)")
    assert "Traceback" not in result.output
    log = (out / "run.log").read_text()
    assert log.startswith("Traceback") and "broken_simulate" in log
    assert not (out / "summary.json").exists()  # an unfinished run is not mistaken for a finished one


def test_engine_chatter_goes_to_the_run_folder_with_one_summary_line(tmp_path, capfd):
    # xgrammar logs a warning on stderr when it drops minLength beside a pattern.
    corpus = tmp_path / "logging.jsonl"
    corpus.write_text(json.dumps({"id": "len-and-pattern", "kind": "json_schema", "source": "test", "license": "MIT",
                                  "spec": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2}}) + "\n")
    out = tmp_path / "h"
    result = runner.invoke(app, ["run", "--requests", "3", "--rate", "50", "--corpus", str(corpus),
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "json_schema_converter" not in capfd.readouterr().err
    logged = (out / "engine_log.txt").read_text().splitlines()
    assert logged and all("ignoring minLength/maxLength" in line for line in logged)
    lines = [line for line in result.output.splitlines() if line.startswith("engine:")]
    assert lines == [(f"engine: {len(logged)} line{'s' if len(logged) > 1 else ''} the grammar engine logged "
                      f"(listed in {out / 'engine_log.txt'})")]


def test_a_second_run_never_silently_replaces_the_first(tmp_path):
    ci, out = str(builtin_config_path("ci")), tmp_path / "keep"
    first = runner.invoke(app, ["run", ci, "--mode", "model", "--requests", "20", "--out", str(out)])
    assert first.exit_code == 0, first.output
    kept = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    second = runner.invoke(app, ["run", ci, "--mode", "model", "--requests", "30", "--seed", "9", "--out", str(out)])
    assert second.exit_code == 2
    assert second.output == (f"error: --out {out} already holds the results of `cdbench run`; give another --out, "
                             "or --overwrite to replace them\n")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == kept
    replaced = runner.invoke(app, ["run", ci, "--mode", "model", "--requests", "30", "--seed", "9", "--out", str(out),
                                   "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert json.loads((out / "summary.json").read_text())["completed"] == 30


def test_a_mismatched_profile_is_refused_before_the_folder_is_made(tmp_path):
    """The profile of another backend: refused in one line, and no folder (not even a stopped run's) is left."""
    from cdbench.harness.costs.grammar_profile import shipped_profiles

    out = tmp_path / "mismatch"
    result = runner.invoke(app, ["run", "--mode", "model", "--backend", "llguidance", "--requests", "10",
                                 "--set", f"costs.grammar_profile={shipped_profiles()['xgrammar']}", "--out", str(out)])
    assert result.exit_code == 2 and result.output.startswith("error: ")
    assert "the run uses llguidance" in result.output and "costs.allow_mismatched_profile=true" in result.output
    assert not out.exists()
