"""``cdbench calibrate``: fit stored measurements anywhere; measure a tiny model on the CPU."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.harness.costs.calibration import ForwardCalibration, read_measurements

REPO = Path(__file__).resolve().parents[2]
TINY = """name: tiny-gqa
params_total: 200000
n_layers: 2
hidden_size: 64
n_heads: 8
n_kv_heads: 2
head_dim: 16
vocab_size: 100
intermediate_size: 96
"""


def test_fit_stored_measurements(tmp_path: Path) -> None:
    csv = REPO / "reports/calibration/llama-3.1-8b__h100-sxm.csv"
    out = tmp_path / "cal.json"
    result = CliRunner().invoke(app, ["calibrate", "--model", "llama-3.1-8b", "--gpu-name", "h100", "--out",
                                      str(out), "--measurements", str(csv), "--report", str(tmp_path / "fit.md")])
    assert result.exit_code == 0, result.output
    cal = ForwardCalibration.load(out)
    assert cal.gpu == "h100-sxm" and cal.gpu_device == "NVIDIA H100 80GB HBM3"
    assert "| decode 512x512 |" in result.output and "max |error|" in result.output
    assert (tmp_path / "fit.md").read_text().startswith("# Forward calibration: llama-3.1-8b on h100-sxm")


def test_measure_tiny_model_on_cpu(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    out = tmp_path / "tiny.json"
    result = CliRunner().invoke(app, ["calibrate", "--model", str(spec), "--gpu-name", "h100", "--out", str(out),
                                      "--grid", "tiny", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    rows = read_measurements(out.with_suffix(".csv"))
    assert {r.kind for r in rows} == {"decode", "prefill", "mixed"}
    assert all(r.gpu_device == "cpu" and not r.graph and r.median_s > 0 for r in rows)
    assert ForwardCalibration.load(out).model == "tiny-gqa"


def test_measure_tensor_parallel_ranks_on_cpu(tmp_path: Path) -> None:
    """Two gloo ranks time their shards in step; the fit is marked tp=2 and prices only tp=2 runs."""
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    out = tmp_path / "tiny_tp2.json"
    result = CliRunner().invoke(app, ["calibrate", "--model", str(spec), "--gpu-name", "h100", "--out", str(out),
                                      "--grid", "tiny", "--device", "cpu", "--tp", "2"])
    assert result.exit_code == 0, result.output
    assert "2 tensor-parallel ranks" in result.output
    rows = read_measurements(out.with_suffix(".csv"))
    assert {r.tp for r in rows} == {2} and all(r.reps == 3 and r.median_s > 0 for r in rows)
    cal = ForwardCalibration.load(out)
    assert cal.tp == 2
    assert "at tp=2" in result.output
    # refitting the stored rows keeps their rank count
    refit = tmp_path / "refit.json"
    result = CliRunner().invoke(app, ["calibrate", "--model", str(spec), "--gpu-name", "h100", "--out", str(refit),
                                      "--measurements", str(out.with_suffix(".csv"))])
    assert result.exit_code == 0, result.output
    assert ForwardCalibration.load(refit).tp == 2


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["calibrate", "--model", "no-such-model", "--gpu-name", "h100", "--out",
                                      str(tmp_path / "x.json"), "--measurements", "x.csv"])
    assert result.exit_code == 2 and "unknown model 'no-such-model'" in result.output
    result = CliRunner().invoke(app, ["calibrate", "--model", "llama-3.1-8b", "--gpu-name", "h100", "--out",
                                      str(tmp_path / "x.json"), "--measurements", str(tmp_path / "missing.csv")])
    assert result.exit_code == 2 and "cannot read measurements" in result.output
    result = CliRunner().invoke(app, ["calibrate", "--model", "llama-3.1-8b", "--gpu-name", "h100", "--out",
                                      str(tmp_path / "x.json"), "--grid", "huge", "--device", "cpu"])
    assert result.exit_code == 2
    assert "--grid 'huge': choose from default, chunks, few_rows, tiny" in result.output
