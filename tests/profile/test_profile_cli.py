"""``cdbench profile`` end to end on a small corpus file, with the toy plugin backends."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from cdbench.cli.app import app

PLUGIN = str(Path(__file__).with_name("profile_backends.py"))
ITEMS = [
    {"id": "choice/colors", "kind": "choice", "spec": ["red", "green", "blue"]},
    {"id": "choice/answers", "kind": "choice", "spec": ["yes", "no", "maybe later"]},
    {"id": "regex/digits", "kind": "regex", "spec": "[0-9]{3}"},
]


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.jsonl"
    lines = [json.dumps({**item, "source": "tests", "license": "MIT"}) for item in ITEMS]
    path.write_text("\n".join(lines) + "\n{not json\n")
    return path


def test_help_shows_an_example():
    result = CliRunner().invoke(app, ["profile", "--help"])
    assert result.exit_code == 0
    assert "Example: cdbench profile --backends" in result.output


def test_profile_command_writes_every_output_and_resumes(tmp_path):
    corpus, out = _corpus(tmp_path), tmp_path / "out"
    args = ["profile", "--backends", "toy,toy_lenient", "--corpus", str(corpus), "--vocab", "cl100k",
            "--plugin", PLUGIN, "--out", str(out), "--no-progress", "--invalid-instances", "2"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "6 results (6 new)" in first.output
    assert "skipped" in first.output  # the broken line is reported, the rest profiled

    items = pd.read_parquet(out / "items.parquet")
    assert len(items) == 6
    by = items.set_index(["item_id", "backend"])
    # The toy backends only do choice: the regex item is unsupported, and counted.
    assert by.loc[("regex/digits", "toy"), "status"] == "unsupported"
    assert (by.loc[("choice/colors", "toy"), ["n_valid", "false_rejects", "false_accepts"]] == [1, 0, 0]).all()
    assert by.loc[("choice/colors", "toy_lenient"), "false_accepts"] == 2
    assert "1 corpus line(s) skipped" in (out / "report.md").read_text()
    for name in ("tokens.parquet", "profile_toy.parquet", "profile_toy_lenient.parquet", "report.md", "tbm_cdf.png"):
        assert (out / name).exists(), name

    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "6 results (0 new)" in again.output


def test_unknown_backend_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(
        app, ["profile", "--backends", "nosuch", "--corpus", str(_corpus(tmp_path)), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2
    assert "unknown backend(s) nosuch; available:" in result.output


@pytest.mark.slow  # a worker with the real engine
def test_engine_chatter_is_kept_per_item_with_one_summary_line(tmp_path, capfd):
    # xgrammar logs a warning on stderr when it drops minLength beside a pattern.
    corpus, out = tmp_path / "logging.jsonl", tmp_path / "out"
    corpus.write_text(json.dumps({"id": "len-and-pattern", "kind": "json_schema", "source": "tests", "license": "MIT",
                                  "spec": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2}}) + "\n")
    result = CliRunner().invoke(app, ["profile", "--backends", "xgrammar", "--corpus", str(corpus), "--vocab",
                                      "cl100k", "--out", str(out), "--no-progress", "--invalid-instances", "0"])
    assert result.exit_code == 0, result.output
    assert "json_schema_converter" not in capfd.readouterr().err
    warnings = pd.read_parquet(out / "items.parquet").warnings.iloc[0]
    assert "xgrammar logged: " in warnings and "ignoring minLength/maxLength" in warnings
    assert (f"engine: 1 line the engines logged while compiling (listed per item in {out / 'items.parquet'}, "
            "column warnings)") in result.output


def test_profile_refuses_another_commands_folder(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    result = CliRunner().invoke(app, ["profile", "--backends", "toy", "--corpus", str(_corpus(tmp_path)), "--vocab",
                                      "cl100k", "--plugin", PLUGIN, "--out", str(out), "--no-progress"])
    assert result.exit_code == 2 and result.output.startswith(f"error: --out {out} holds the results of `cdbench run`")
    assert (out / "summary.json").read_text() == "{}"
