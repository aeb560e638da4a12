"""``cdbench calibrate``: fit stored measurements anywhere; measure a tiny model on the CPU."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest
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


def calibrate_tiny(tmp_path: Path, tp: int = 1) -> tuple[Path, Path]:
    """The tiny model's spec file and its calibration at ``tp`` ranks (gloo), measured on the CPU over the tiny
    grid."""
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    out = tmp_path / ("tiny.json" if tp == 1 else f"tiny_tp{tp}.json")
    result = CliRunner().invoke(app, ["calibrate", "--model", str(spec), "--gpu-name", "h100", "--out", str(out),
                                      "--grid", "tiny", "--device", "cpu", "--tp", str(tp)])
    assert result.exit_code == 0, result.output
    return spec, out


def test_measure_tiny_model_on_cpu(tmp_path: Path) -> None:
    _, out = calibrate_tiny(tmp_path)
    rows = read_measurements(out.with_suffix(".csv"))
    assert {r.kind for r in rows} == {"decode", "prefill", "mixed"}
    assert all(r.gpu_device == "cpu" and not r.graph and r.median_s > 0 for r in rows)
    assert ForwardCalibration.load(out).model == "tiny-gqa"


def test_a_model_with_an_mtp_head_has_its_draft_shapes_measured_and_fitted(tmp_path: Path, monkeypatch) -> None:
    from cdbench.harness.live import measure

    spec = tmp_path / "tiny-mtp.yaml"
    spec.write_text(TINY.replace("tiny-gqa", "tiny-mtp") + "mtp_layers: 1\n")
    out, report = tmp_path / "tiny.json", tmp_path / "fit.md"
    result = CliRunner().invoke(app, ["calibrate", "--model", str(spec), "--gpu-name", "h100", "--out", str(out),
                                      "--grid", "tiny", "--device", "cpu", "--report", str(report),
                                      "--holdout", "2"])
    assert result.exit_code == 0, result.output
    assert "measuring tiny-mtp on cpu: 9 shapes" in result.output and "2 of them the MTP head's" in result.output
    rows = read_measurements(out.with_suffix(".csv"))
    assert [(r.kind, r.mtp_drafts) for r in rows[-2:]] == [("draft", 1), ("draft", 2)]
    cal = ForwardCalibration.load(out)
    assert cal.mtp_draft is not None and [s.shape for s in cal.fit][-2:] == ["draft 1x8 k1", "draft 4x16 k2"]
    table = report.read_text()
    assert "Step fit over 7 shapes" in table and "The MTP head's draft term (each pass" in table
    assert "over 2 shapes: max |error|" in table and "| mtp_roof_scale |" in table and "| draft 4x16 k2 |" in table
    # the draft grid alone is measured, not fitted (its small shapes here: the CPU's time)
    monkeypatch.setitem(measure.GRIDS, "draft", measure.tiny_draft_grid)
    alone = tmp_path / "draft.json"
    result = CliRunner().invoke(app, ["calibrate", "--model", str(spec), "--gpu-name", "h100", "--out", str(alone),
                                      "--grid", "draft", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "draft shapes only: nothing fitted" in result.output and not alone.exists()
    assert {r.kind for r in read_measurements(alone.with_suffix(".csv"))} == {"draft"}
    # a model without a head has no draft shapes to measure
    result = CliRunner().invoke(app, ["calibrate", "--model", "qwen3-8b", "--gpu-name", "h100", "--out",
                                      str(alone), "--grid", "draft", "--device", "cpu"])
    assert result.exit_code == 2 and "qwen3-8b has no MTP head" in result.output


def test_an_idle_gap_before_each_repetition_is_recorded_and_kept_by_its_probe(tmp_path: Path) -> None:
    from cdbench.harness.costs.calibration import CalibrationError, write_measurements
    from cdbench.harness.costs.calibration_fit import fit_calibration

    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    out = tmp_path / "idle.json"
    args = ["calibrate", "--model", str(spec), "--gpu-name", "h100", "--grid", "tiny", "--device", "cpu"]
    result = CliRunner().invoke(app, [*args, "--out", str(out), "--idle-s", "0.002"])
    assert result.exit_code == 0, result.output
    rows = read_measurements(out.with_suffix(".csv"))
    assert {r.idle_s for r in rows} == {0.002} and ForwardCalibration.load(out).idle_s == 0.002
    probe = CliRunner().invoke(app, [*args, "--probe", str(tmp_path / "p.json"), "--calibration", str(out)])
    assert probe.exit_code == 0, probe.output
    other = CliRunner().invoke(app, [*args, "--probe", str(tmp_path / "q.json"), "--calibration", str(out),
                                     "--idle-s", "0.5"])
    assert other.exit_code == 2 and "was measured with 0.002 s before each repetition" in other.output
    # two tensor-parallel ranks, each repetition after the gap on both: recorded so, and probed so
    tp_out = tmp_path / "tp.json"
    tp = CliRunner().invoke(app, [*args, "--out", str(tp_out), "--idle-s", "0.002", "--tp", "2"])
    assert tp.exit_code == 0, tp.output
    tp_rows = read_measurements(tp_out.with_suffix(".csv"))
    assert {(r.tp, r.idle_s) for r in tp_rows} == {(2, 0.002)} and all(r.reps == 3 for r in tp_rows)
    assert ForwardCalibration.load(tp_out).idle_s == 0.002
    # a CSV without the column (as measured before it) reads as back to back; one fit never mixes the two
    old = tmp_path / "before_the_column.csv"
    with (REPO / "reports/calibration/qwen3-30b-a3b__h200.csv").open(newline="") as src, \
            old.open("w", newline="") as dst:
        reader = csv.DictReader(src)
        kept = [name for name in reader.fieldnames if name != "idle_s"]
        writer = csv.DictWriter(dst, fieldnames=kept, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(reader)
    back_to_back = read_measurements(old)
    assert {r.idle_s for r in back_to_back} == {0.0}
    mixed = tmp_path / "mixed.csv"
    write_measurements([*back_to_back[:-1], replace(back_to_back[-1], idle_s=0.02)], mixed)
    with pytest.raises(CalibrationError, match="mix idle gaps"):
        fit_calibration(read_measurements(mixed), "qwen3-30b-a3b", "h200", measurements=str(mixed), command="x")


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


RANKS_PACK = "reports/fidelity/live_vs_model/ranks_vs_model.pack"


def test_refit_with_the_measured_all_reduce_and_held_out_shapes(tmp_path: Path) -> None:
    """The shipped TP=2 fit is what its command gives: the all-reduce's per-row time measured by the packed
    live TP runs (their median), the rest fitted, and each shape's error when held out."""
    import json
    import statistics

    from cdbench.harness.costs.calibration import shipped_calibration_path
    from cdbench.harness.live.ranks import ranks_info_of
    from cdbench.results.pack import open_run

    shipped = ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h200", 2))
    runs = [f"{RANKS_PACK}::under/{w}-tp2-live-{c}" for w in ("default", "json") for c in "bc"]
    assert shipped.all_reduce_runs == runs
    out = tmp_path / "tp2.json"
    args = ["calibrate", "--model", "qwen3-8b", "--gpu-name", "h200", "--out", str(out), "--measurements",
            str(REPO / shipped.measurements), "--holdout", "4"]
    result = CliRunner().invoke(app, [*args, *(x for r in runs for x in ("--all-reduce", str(REPO / r)))])
    assert result.exit_code == 0, result.output
    cal = ForwardCalibration.load(out)
    slopes = []
    for ref in runs:
        table = json.loads(open_run(REPO / ref).read_file("live.json"))["ranks"]["all_reduce_s"]
        slopes.append((table["8192"] - table["1024"]) / (8192 - 1024))
        assert ranks_info_of(open_run(REPO / ref).read_file("live.json"), ref).all_reduce_token_s == slopes[-1]
    assert cal.all_reduce_token_s == pytest.approx(statistics.median(slopes), rel=1e-12)
    assert cal.all_reduce_token_s == shipped.all_reduce_token_s
    for new, old in zip(cal.fit, shipped.fit, strict=True):
        assert new.predicted_s == pytest.approx(old.predicted_s, rel=1e-3)
    assert "Held out (fitted on the other shapes, 98 shapes in turn)" in result.output
    assert "| decode_layer_s |" in result.output and "held-out error |" in result.output
    # a run without the ranks' all-reduce, and a one-GPU fit given one, are refused in one line
    result = CliRunner().invoke(app, [*args, "--all-reduce", str(REPO / f"{RANKS_PACK}::under/json-dp2-live-a")])
    assert result.exit_code == 2 and "fewer than two sizes" in result.output
    result = CliRunner().invoke(app, ["calibrate", "--model", "qwen3-8b", "--gpu-name", "h200", "--out", str(out),
                                      "--measurements", str(REPO / "reports/calibration/qwen3-8b__h200.csv"),
                                      "--all-reduce", str(REPO / runs[0])])
    assert result.exit_code == 2 and "these measurements are of one GPU" in result.output


def test_probe_a_tiny_cpu_calibration_and_price_a_run_at_its_speed(tmp_path: Path) -> None:
    from cdbench.harness.costs.forward_speed import ForwardProbe, fit_speed
    from cdbench.results.config_files import ConfigError
    from cdbench.results.run_config import validate_run_config

    spec, cal = calibrate_tiny(tmp_path)
    probe = tmp_path / "probe.json"
    result = CliRunner().invoke(app, ["calibrate", "--model", str(spec), "--gpu-name", "h100", "--probe", str(probe),
                                      "--calibration", str(cal), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert f"--set costs.forward_speed=probe:{probe}" in result.output
    written = ForwardProbe.model_validate_json(probe.read_text())
    measured = {s.shape: s.measured_s for s in ForwardCalibration.load(cal).fit}
    assert set(written.shapes) == set(measured) and len(written.ratios) == 7  # the tiny grid's every shape
    assert (written.model, written.gpu, written.device) == ("tiny-gqa", "h100-sxm", "cpu")
    assert written.speed.decode_steps == 3 and written.speed.prefill_steps == 4
    # the speed is the fit of the written ratios, decode-only shapes apart from those with prefill chunks
    prefill = ["prefill" in shape for shape in written.shapes]
    ratios = list(zip(written.ratios, prefill, strict=True))
    refit = fit_speed([r for r, p in ratios if not p], [r for r, p in ratios if p], f"probe:{probe}", min_ratios=4)
    assert written.speed == refit and all(r > 0 for r in written.ratios)
    tree = {"mode": "model", "costs": {"model": str(spec), "gpu": "h100", "forward_calibration": str(cal),
                                       "fixed_grammar": {}, "forward_speed": f"probe:{probe}"}}
    speed = validate_run_config(tree).costs.forward_speed
    assert speed.decode == written.speed.decode and speed.source == f"probe:{probe}"
    with pytest.raises(ConfigError, match=f"probe:{probe} probed tiny-gqa on h100-sxm at tp=1; this run prices "
                                          "qwen3-8b"):
        validate_run_config({"mode": "model", "costs": {"model": "qwen3-8b", "fixed_grammar": {},
                                                        "forward_speed": f"probe:{probe}"}})
    with pytest.raises(ConfigError, match="not a forward probe"):
        validate_run_config({**tree, "costs": {**tree["costs"], "forward_speed": f"probe:{cal}"}})


def test_a_probe_of_another_models_calibration_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["calibrate", "--model", "qwen3-8b", "--gpu-name", "h100", "--probe",
                                      str(tmp_path / "p.json"), "--calibration",
                                      str(REPO / "cdbench/harness/costs/calibrations/llama-3.1-8b__h100-sxm.json")])
    assert result.exit_code == 2
    assert "is for llama-3.1-8b on h100-sxm at tp=1; the probe times qwen3-8b on h100-sxm" in result.output
    assert not (tmp_path / "p.json").exists()


def test_probe_tensor_parallel_ranks_on_cpu_and_price_only_their_rank_count(tmp_path: Path) -> None:
    """``--probe --tp 2`` times a tp=2 calibration's shapes on two gloo rank processes; its speed prices a
    tp=2 run of the model and is refused for a one-GPU run; a tp=1 calibration is refused for the probe."""
    from cdbench.harness.costs.forward_speed import ForwardProbe
    from cdbench.results.config_files import ConfigError
    from cdbench.results.run_config import validate_run_config

    spec, cal = calibrate_tiny(tmp_path, tp=2)
    probe = tmp_path / "probe_tp2.json"
    args = ["calibrate", "--model", str(spec), "--gpu-name", "h100", "--probe", str(probe), "--device", "cpu"]
    result = CliRunner().invoke(app, [*args, "--calibration", str(cal), "--tp", "2"])
    assert result.exit_code == 0, result.output
    assert "2 tensor-parallel ranks" in result.output
    written = ForwardProbe.model_validate_json(probe.read_text())
    assert (written.model, written.gpu, written.tp, written.device) == ("tiny-gqa", "h100-sxm", 2, "cpu")
    assert set(written.shapes) == {s.shape for s in ForwardCalibration.load(cal).fit}
    assert written.speed.decode_steps + written.speed.prefill_steps == 7 and all(r > 0 for r in written.ratios)
    costs = {"model": str(spec), "gpu": "h100", "forward_calibration": str(cal), "fixed_grammar": {},
             "forward_speed": f"probe:{probe}"}
    tree = {"mode": "model", "costs": {**costs, "tp": 2}, "scheduler": {"ranks": 2, "parallel": "tp"}}
    speed = validate_run_config(tree).costs.forward_speed
    assert (speed.decode, speed.prefill) == (written.speed.decode, written.speed.prefill)
    with pytest.raises(ConfigError, match=f"probe:{probe} probed tiny-gqa on h100-sxm at tp=2; this run prices "
                                          "tiny-gqa on h100-sxm at tp=1"):
        validate_run_config({"mode": "model", "costs": {k: v for k, v in costs.items() if k != "forward_calibration"}})
    # the probe times the calibration at the ranks it was measured on
    result = CliRunner().invoke(app, [*args, "--calibration", str(cal)])
    assert result.exit_code == 2
    assert f"--calibration {cal} is for tiny-gqa on h100-sxm at tp=2; the probe times tiny-gqa on h100-sxm at tp=1" \
        in result.output
