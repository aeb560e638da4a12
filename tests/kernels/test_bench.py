"""`cdbench kernels --quick` on the CPU: runs, checks, writes its files, and refuses a CPU cost table."""

from __future__ import annotations

import gzip
import json
import shutil

import pandas as pd
import pytest
import typer
from typer.testing import CliRunner

from cdbench.cli.kernels import kernels_command
from cdbench.kernels.bench import gpu_short_name
from cdbench.kernels.bench_report import load_run, results_frame, summary_markdown
from cdbench.kernels.timing import rotation_count

app = typer.Typer()
app.command("kernels")(kernels_command)
app.command("unused")(lambda: None)  # two commands keep "kernels" as a subcommand name


def test_quick_run_on_cpu_writes_reports(tmp_path):
    out = tmp_path / "k"
    result = CliRunner().invoke(app, ["kernels", "--quick", "--batch", "2", "--dtype", "fp32", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "timing needs CUDA" in result.output
    frame = pd.read_csv(out / "results.csv")
    assert set(frame.variant) >= {"copy", "naive", "cdbench", "cdbench-argmax"}
    assert frame.exact.all() and (frame.timing == "wall").all()
    assert (out / "kernels.png").stat().st_size > 0
    assert json.loads((out / "env.json").read_text())["device"] == "cpu"
    results, copies, env = load_run(out)
    assert len(results) == len(frame) and copies == []
    assert summary_markdown(results_frame(results), copies, env) == (out / "summary.md").read_text()
    stored = tmp_path / "stored"  # a committed run keeps its results gzipped
    shutil.copytree(out, stored)
    (stored / "results.csv.gz").write_bytes(gzip.compress((stored / "results.csv").read_bytes()))
    (stored / "results.csv").unlink()
    assert load_run(stored) == (results, copies, env)
    (stored / "h2d.csv").unlink()  # a stored run that timed no copies may keep no file of them
    assert load_run(stored) == (results, [], env)
    # a second run does not write over the first unasked
    again = ["kernels", "--quick", "--batch", "1", "--dtype", "fp32", "--density", "sparse", "--out", str(out)]
    refused = CliRunner().invoke(app, again)
    assert refused.exit_code != 0 and "--overwrite" in refused.output
    assert len(pd.read_csv(out / "results.csv")) == len(frame)
    replaced = CliRunner().invoke(app, [*again, "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert len(pd.read_csv(out / "results.csv")) < len(frame)


def test_cost_table_needs_a_gpu_and_bad_options_are_named(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["kernels", "--quick", "--batch", "1", "--dtype", "fp32", "--density", "sparse",
                                 "--out", str(tmp_path), "--cost-table", str(tmp_path / "t.json")])
    assert result.exit_code != 0 and "needs GPU measurements" in result.output
    result = runner.invoke(app, ["kernels", "--quick", "--dtype", "fp64", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "fp64" in result.output
    result = runner.invoke(app, ["kernels", "--quick", "--variant", "nope", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "nope" in result.output


def test_helpers():
    assert gpu_short_name("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_short_name("NVIDIA H200") == "h200"
    assert rotation_count(600 << 20) == 2 and rotation_count(1 << 20) == 512


def test_target_stats_judge_small_batches_by_copy_and_large_ones_by_floor():
    from cdbench.kernels.bench import KernelResult
    from cdbench.kernels.bench_report import target_stats

    def result(batch, variant, timing, us, floor):
        return KernelResult(1000, batch, "bf16", "sparse", variant, "apply", timing, us, us, us, floor, True)

    frame = results_frame([
        result(4, "copy", "graph", 2.0, 1.0), result(4, "cdbench", "graph", 2.2, 1.0),
        result(64, "copy", "graph", 20.0, 15.0), result(64, "cdbench", "graph", 16.0, 15.0),
        result(64, "copy", "event", 22.0, 15.0), result(64, "cdbench", "event", 20.0, 15.0),
    ])
    stats = target_stats(frame)
    assert stats["graph_max_ratio_to_copy"] == pytest.approx(1.1)  # B = 64's 0.8 is not a small-batch row
    assert stats["graph_sparse_b64_min_pct_floor"] == pytest.approx(93.75)
    assert stats["sparse_b64_min_pct_floor"] == pytest.approx(75.0)
    assert stats["sparse_b64_min_pct_floor_bf16"] == pytest.approx(75.0)  # per dtype too
    assert stats["graph_sparse_b64_min_pct_floor_bf16"] == pytest.approx(93.75)
