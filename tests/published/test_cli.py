"""``cdbench published list|run``: the table, the files it writes, and one-line errors."""

from __future__ import annotations

import pandas as pd
from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.published.registry import load_registry
from cdbench.published.report import markdown_table
from cdbench.published.runner import run_entry


def test_list_names_every_entry():
    result = CliRunner().invoke(app, ["published", "list"])
    assert result.exit_code == 0, result.output
    for entry in load_registry().entries:
        assert entry.id in result.output


def test_run_prints_the_table_and_writes_results_table_and_plot(tmp_path):
    out = tmp_path / "pub"
    result = CliRunner().invoke(app, ["published", "run", "--entry", "vllm-26866-structured-cost", "--entry",
                                      "vllm-24300", "--scale", "small", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "vllm-26866-structured-cost" in result.output and "-32.8 %" in result.output
    assert "vllm-24300 (missed): the pace of the published run" in result.output
    frame = pd.read_csv(out / "results.csv")
    assert frame["id"].tolist() == ["vllm-26866-structured-cost", "vllm-24300"]
    assert set(frame["verdict"]) <= {"reproduced", "missed", "not reproducible"}
    assert (out / "effects.png").stat().st_size > 10_000
    assert (out / "table.md").read_text().count("\n") == 4


def test_bad_input_is_one_line():
    result = CliRunner().invoke(app, ["published", "run", "--entry", "nope"])
    assert result.exit_code == 2 and "no registry entry 'nope'" in result.output
    result = CliRunner().invoke(app, ["published", "run", "--scale", "huge"])
    assert result.exit_code == 2 and "--scale 'huge': choose full or small" in result.output


def test_the_markdown_table_has_a_row_an_entry_with_its_ratio():
    reg = load_registry()
    result = run_entry(reg, reg.entry("vllm-26866-structured-cost"), "small")
    row = markdown_table([result]).splitlines()[2]
    assert row.startswith("| vllm-26866-structured-cost | request_throughput | -32.8 % |")
    assert f"| {result.ratio:.2f} | {result.verdict} |" in row


def test_v0s_entries_are_reproduced_with_its_gpu_launches_priced():
    # vLLM V0's blocking per-row copy and its grammar's cost: reproduced once the launches a GPU adds to V0's sampler
    # and per-row path (the vllm-0.6 preset's sample_launch_s, row_launch_s) are priced; missed without them
    reg = load_registry()
    for name in ("vllm-12563", "vllm-10835"):
        assert run_entry(reg, reg.entry(name), "small").verdict == "reproduced", name


def test_sweep_prints_a_row_a_value_beside_the_published_effects_and_writes_the_csv(tmp_path):
    csv = tmp_path / "sweep.csv"
    result = CliRunner().invoke(app, ["published", "sweep", "workload.prompt_len.value", "100", "600", "--entry",
                                      "vllm-24300", "--scale", "small", "--csv", str(csv)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("|")]
    assert lines[0] == "| workload.prompt_len.value | vllm-24300 | reproduced |"
    assert lines[2].startswith("| published | +31.5 % |")
    assert [line.split(" | ")[0] for line in lines[3:]] == ["| 100", "| 600"]
    frame = pd.read_csv(csv)
    assert frame["workload.prompt_len.value"].tolist() == [100, 600]
    assert frame["predicted_effect"].nunique() == 2
