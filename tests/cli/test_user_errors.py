"""Paths that are the wrong kind of thing, and run folders with malformed files: one `error:` line, exit 2."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from cdbench.cli.app import app

runner = CliRunner()


def _one_error_line(result, expected):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.output
    assert "Traceback" not in result.output


def test_a_directory_given_as_a_file(simulated_run, tmp_path):
    folder = tmp_path / "d1"
    folder.mkdir()
    _one_error_line(runner.invoke(app, ["run", str(folder)]), f"config file {folder} is a directory")
    _one_error_line(runner.invoke(app, ["sweep", str(folder)]), f"sweep file {folder} is a directory")
    # A folder as the baseline is an earlier run's folder.
    _one_error_line(runner.invoke(app, ["gate", str(simulated_run.folder), "--baseline", str(folder)]),
                    f"baseline {folder} is a folder but not a cdbench run folder (no summary.json)")
    _one_error_line(runner.invoke(app, ["gate", str(simulated_run.folder), "--baseline", str(folder), "--update"]),
                    f"--update writes a baseline JSON file; {folder} is a run")


@pytest.mark.parametrize(("name", "content", "kind"), [("summary.json", "[1, 2]", "list"),
                                                       ("summary.json", '"done"', "str"),
                                                       ("config.yaml", "- a\n- b\n", "list")])
def test_a_run_folder_whose_summary_or_config_is_not_a_mapping(simulated_run, tmp_path, name, content, kind):
    folder = tmp_path / "run"
    shutil.copytree(simulated_run.folder, folder)
    (folder / name).write_text(content)
    expected = f"run folder {folder}: {name} must hold a mapping of keys, not {kind}"
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"metrics": {"completed": 20}}))
    _one_error_line(runner.invoke(app, ["gate", str(folder), "--baseline", str(baseline)]), expected)
    _one_error_line(runner.invoke(app, ["report", str(folder)]), expected)
    _one_error_line(runner.invoke(app, ["compare", str(folder), str(simulated_run.folder),
                                        "--out", str(tmp_path / "cmp")]), expected)


def test_a_file_given_as_the_results_folder(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    ci = str(tmp_path / "ci.yaml")
    (tmp_path / "ci.yaml").write_text("mode: model\nworkload: {num_requests: 2}\n")
    (tmp_path / "s.yaml").write_text(f"base: {ci}\ngrid: {{seed: [1]}}\n")
    expected = f"--out {taken} is a file; it must be a folder"
    _one_error_line(runner.invoke(app, ["run", ci, "--out", str(taken)]), expected)
    _one_error_line(runner.invoke(app, ["sweep", str(tmp_path / "s.yaml"), "--out", str(taken)]), expected)
    _one_error_line(runner.invoke(app, ["compare", "--policies", "sglang,vllm", "-c", ci, "--out", str(taken)]), expected)
    assert taken.read_text() == "not a folder"
