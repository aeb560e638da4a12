import json

import pandas as pd
import yaml
from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.results.config_files import builtin_config_path

runner = CliRunner()


def _sweep_file(tmp_path, grid):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "name": "t", "base": str(builtin_config_path("ci")), "overrides": {"workload.num_requests": 30},
        "grid": grid,
    }, sort_keys=False))
    return path


def test_sweep_runs_the_grid_resumes_and_plots(tmp_path):
    path = _sweep_file(tmp_path, {"workload.arrival.rate": [20, 60], "policy.name": ["sglang", "vllm"]})
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "4 run, 0 already done, 0 failed" in result.output
    table = pd.read_csv(out / "sweep.csv")
    assert sorted(table["point"]) == sorted(["rate=20,name=sglang", "rate=20,name=vllm", "rate=60,name=sglang",
                                             "rate=60,name=vllm"])
    assert (table["completed"] == 30).all()
    assert (out / "plots" / "p99_ttft_ms_vs_request_throughput.png").is_file()
    point = yaml.safe_load((out / "rate=60,name=vllm" / "config.yaml").read_text())
    assert point["workload"]["arrival"]["rate"] == 60 and point["policy"]["name"] == "vllm"

    again = runner.invoke(app, ["sweep", str(path), "--out", str(out)])
    assert again.exit_code == 0 and "0 run, 4 already done" in again.output


def test_sweep_with_a_bad_point_fails_before_running_anything(tmp_path):
    path = _sweep_file(tmp_path, {"policy.name": ["sglang", "trtllm"]})
    result = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "sweep point name=trtllm: policy.name = 'trtllm'" in result.output
    assert not (tmp_path / "o").exists()


def test_compare_policies_on_the_same_requests_then_compare_saved_folders(tmp_path):
    ci = str(builtin_config_path("ci"))
    out = tmp_path / "cmp"
    result = runner.invoke(app, ["compare", "--policies", "sglang,vllm", "--config", ci, "--requests", "30",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "vllm / sglang" in result.output
    text = (out / "comparison.md").read_text()
    assert "| metric | sglang | vllm | vllm / sglang |" in text
    assert (out / "plots" / "ttft_cdf.png").is_file() and (out / "plots" / "tpot_cdf.png").is_file()
    arrivals = [pd.read_parquet(out / p / "requests.parquet")["arrival_s"] for p in ("sglang", "vllm")]
    pd.testing.assert_series_equal(arrivals[0], arrivals[1])  # same workload, same seed
    completed = json.loads((out / "vllm" / "summary.json").read_text())["completed"]

    again = runner.invoke(app, ["compare", str(out / "vllm"), str(out / "sglang"), "--out", str(tmp_path / "c2")])
    assert again.exit_code == 0, again.output
    table = pd.read_csv(tmp_path / "c2" / "comparison.csv", index_col=0)
    assert list(table.columns) == ["vllm", "sglang", "sglang / vllm"]
    assert table.loc["completed", "vllm"] == completed


def test_compare_needs_something_to_compare(tmp_path):
    result = runner.invoke(app, ["compare", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "nothing to compare" in result.output
    both = runner.invoke(app, ["compare", str(tmp_path), "--backends", "a,b"])
    assert both.exit_code == 2 and "not both" in both.output


def test_a_point_failing_at_run_time_is_reported_and_the_rest_still_runs(tmp_path):
    path = _sweep_file(tmp_path, {"workload.corpus": [["embedded"], ["no-such-corpus"]]})
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(path), "--out", str(out)])
    assert result.exit_code == 1
    assert "1 run, 0 already done, 1 failed" in result.output
    assert "unknown corpus 'no-such-corpus'" in result.output
    table = pd.read_csv(out / "sweep.csv")
    assert table["status"].tolist() == ["done", "failed"]
    assert table["corpus"].tolist() == ['["embedded"]', '["no-such-corpus"]']
    assert len(list(out.glob("*/error.log"))) == 1


def test_compare_backends_in_model_mode_runs_each_backend_on_the_same_requests(tmp_path):
    out = tmp_path / "cmp"
    result = runner.invoke(app, ["compare", "--backends", "xgrammar,llguidance", "--mode", "model", "--requests", "20",
                                 "--set", "workload.corpus_limit=20", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "llguidance / xgrammar" in result.output
    configs = {b: yaml.safe_load((out / b / "config.yaml").read_text()) for b in ("xgrammar", "llguidance")}
    assert {b: c["backend"]["name"] for b, c in configs.items()} == {"xgrammar": "xgrammar", "llguidance": "llguidance"}
    assert configs["xgrammar"]["mode"] == "model"
    requests = [pd.read_parquet(out / b / "requests.parquet") for b in ("xgrammar", "llguidance")]
    for column in ("arrival_s", "prompt_len", "spec_key"):
        pd.testing.assert_series_equal(requests[0][column], requests[1][column])
    table = pd.read_csv(out / "comparison.csv", index_col=0)
    assert list(table.columns) == ["xgrammar", "llguidance", "llguidance / xgrammar"]
    # each model run says where its spec prices came from (the embedded sample: the shipped profiles)
    for backend in ("xgrammar", "llguidance"):
        assert f"{backend}: spec costs (measure, host " in result.output


def test_compare_validates_every_combination_before_running_any(tmp_path):
    out = tmp_path / "cmp"
    result = runner.invoke(app, ["compare", "--backends", "xgrammar,nope", "--mode", "model", "--out", str(out)])
    assert result.exit_code == 2
    assert result.output.startswith("error: built-in default config (nope): backend.name = 'nope': not a registered "
                                    "backend; registered: ")
    # other tests in this process may register backends of their own: only the built-in ones are checked
    registered = result.output.splitlines()[0].split("registered: ")[1].split(", ")
    assert {"llguidance", "none", "outlines", "reasoner", "xgrammar"} <= set(registered)
    assert not out.exists()  # xgrammar did not run first
    twice = runner.invoke(app, ["compare", "--backends", "xgrammar,xgrammar", "--out", str(out)])
    assert twice.exit_code == 2 and "'xgrammar' is listed twice" in twice.output
    no_profile = runner.invoke(app, ["compare", "--backends", "xgrammar,reasoner", "--mode", "model",
                                     "--out", str(out)])
    assert no_profile.exit_code == 2
    assert "backend.name = 'reasoner': model mode needs a grammar profile and none is shipped" in no_profile.output


def test_a_point_that_died_while_writing_its_report_is_run_again_on_resume(tmp_path, monkeypatch):
    import cdbench.cli.sweep as sweep_command

    path = _sweep_file(tmp_path, {"workload.arrival.rate": [20]})
    out = tmp_path / "out"
    real_build_report = sweep_command.build_report

    def dies_midway(run):
        (run.folder / "report.md").write_text("half")
        raise OSError("disk full")

    monkeypatch.setattr(sweep_command, "build_report", dies_midway)
    first = runner.invoke(app, ["sweep", str(path), "--out", str(out)])
    assert first.exit_code == 1 and "0 run, 0 already done, 1 failed" in first.output
    assert (out / "rate=20" / "steps.parquet").is_file() and not (out / "rate=20" / "summary.json").exists()

    monkeypatch.setattr(sweep_command, "build_report", real_build_report)
    again = runner.invoke(app, ["sweep", str(path), "--out", str(out)])
    assert again.exit_code == 0 and "1 run, 0 already done, 0 failed" in again.output
    assert (out / "rate=20" / "report.md").read_text().startswith("# cdbench run")


def test_sweeping_the_backend_over_fixed_grammar_costs_warns_that_it_changes_nothing(tmp_path):
    path = _sweep_file(tmp_path, {"backend.name": ["xgrammar", "llguidance"]})
    result = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert ("warning: grid parameter backend.name has no effect here (model mode with costs.fixed_grammar"
            in " ".join(result.output.split()))
    summaries = [(tmp_path / "o" / p / "summary.json").read_text() for p in ("name=xgrammar", "name=llguidance")]
    assert summaries[0] == summaries[1]  # what the warning is about


def test_sweep_and_compare_refuse_a_folder_they_would_mix_with(tmp_path):
    ci, run_dir = str(builtin_config_path("ci")), tmp_path / "run"
    assert runner.invoke(app, ["run", ci, "--requests", "10", "--out", str(run_dir)]).exit_code == 0
    sweep = _sweep_file(tmp_path, {"workload.arrival.rate": [20]})
    into_run = runner.invoke(app, ["sweep", str(sweep), "--out", str(run_dir)])
    assert into_run.exit_code == 2 and into_run.output.startswith(f"error: --out {run_dir} holds the results of "
                                                                  "`cdbench run`")
    compare = runner.invoke(app, ["compare", str(run_dir), str(run_dir), "--out", str(run_dir)])
    assert compare.exit_code == 2 and "holds the results of `cdbench run`" in compare.output
    compare = runner.invoke(app, ["compare", str(run_dir), str(run_dir), "--out", str(run_dir), "--overwrite"])
    assert compare.exit_code == 2 and "--overwrite would delete it" in compare.output
    assert (run_dir / "summary.json").is_file()

    out = tmp_path / "sweep"
    assert runner.invoke(app, ["sweep", str(sweep), "--out", str(out)]).exit_code == 0
    other = _sweep_file(tmp_path, {"workload.arrival.rate": [30]})
    refused = runner.invoke(app, ["sweep", str(other), "--out", str(out)])
    assert refused.exit_code == 2 and "made with other settings, so it cannot be resumed" in refused.output
    assert (out / "rate=20").is_dir()


def test_sweep_points_keep_engine_chatter_in_their_folders(tmp_path, capfd):
    # xgrammar logs a warning on stderr when it drops minLength beside a pattern.
    corpus = tmp_path / "logging.jsonl"
    corpus.write_text(json.dumps({"id": "len-and-pattern", "kind": "json_schema", "source": "test", "license": "MIT",
                                  "spec": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2}}) + "\n")
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "overrides": {"mode": "hybrid", "workload.num_requests": 3,
                                                               "workload.corpus": [str(corpus)]},
                                    "grid": {"workload.arrival.rate": [40, 50]}}))
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "json_schema_converter" not in capfd.readouterr().err
    logs = [out / point / "engine_log.txt" for point in ("rate=40", "rate=50")]
    assert all("ignoring minLength/maxLength" in log.read_text() for log in logs)
    total = sum(len(log.read_text().splitlines()) for log in logs)
    assert f"engine: {total} lines the grammar engine logged (listed in engine_log.txt of 2 runs in {out})" \
        in result.output
