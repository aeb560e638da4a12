"""The campaign script's evaluation and report (scripts/fidelity_campaign.py), on synthetic run folders."""

import importlib.util
import json
import sys
from pathlib import Path

import pandas as pd
import pytest
from synthetic_run import write_synthetic_run

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fidelity_campaign.py"
_spec = importlib.util.spec_from_file_location("fidelity_campaign", _SCRIPT)
campaign = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = campaign  # its dataclasses look their module up while being defined
_spec.loader.exec_module(campaign)

BASE = {"median_ttft_ms": 20.0, "median_tpot_ms": 10.0, "request_throughput": 5.0, "p99_ttft_ms": 100.0,
        "p99_tpot_ms": 30.0, "p99_itl_ms": 40.0, "mask_share": 0.1}


def _run(folder: Path, rate: float, **scaled: float) -> None:
    summary = {**BASE, **{m: BASE[m] * f for m, f in scaled.items()}}
    write_synthetic_run(folder, summary=summary)
    (folder / "config.yaml").write_text(f"mode: model\nworkload:\n  arrival:\n    rate: {rate}\n")


def test_cells_are_judged_against_their_bars_and_incomplete_groups_are_listed(tmp_path):
    out = tmp_path / "campaign"
    group = out / "xgrammar-sglang-default"
    (group / "capacity").mkdir(parents=True)
    (group / "capacity" / "summary.json").write_text(json.dumps({"request_throughput": 10.0}))
    cell = group / "load0.5"
    _run(cell / "hybrid-a", 5.0)
    _run(cell / "hybrid-b", 5.0, median_ttft_ms=1.01)
    _run(cell / "model-own", 5.0, median_ttft_ms=1.04, p99_ttft_ms=0.92)  # within 5 % and 10 %
    _run(cell / "model-shipped", 5.0, p99_ttft_ms=0.5)  # -50 %: beyond the shipped bar of 25 %
    (out / "outlines-vllm-github_medium" / "capacity").mkdir(parents=True)  # its capacity run never finished

    frame = campaign.evaluate(out)
    own = frame[(frame["comparison"] == "model-own") & (frame["metric"] == "median_ttft_ms")].iloc[0]
    assert own["error_pct"] == pytest.approx(4.0) and own["verdict"] == "within" and own["rate_rps"] == 5.0
    assert own["noise_pct"] == pytest.approx(1.0) and own["capacity_rps"] == 10.0
    shipped = frame[(frame["comparison"] == "model-shipped") & (frame["metric"] == "p99_ttft_ms")].iloc[0]
    assert shipped["tolerance_pct"] == 25.0 and shipped["verdict"] == "beyond"
    assert (cell / "fidelity-own" / "fidelity.md").is_file() and (cell / "fidelity-shipped" / "fidelity.csv").is_file()

    md = campaign.write_report(frame, out, tmp_path / "report", "python scripts/fidelity_campaign.py ...", None)
    text = md.read_text()
    own_part, shipped_part = text.split("## model with the shipped default profile")
    assert "Cells passing: 1 of 1; figures within their bar: 6 of 6." in own_part
    assert "| xgrammar | sglang | default | 0.5 | 5 | +4.0 | +0.0 | +0.0 | -8.0 | +0.0 | +0.0 | yes |" in own_part
    assert "Cells passing: 0 of 1" in shipped_part and "**-50.0** ✗" in shipped_part
    assert "incomplete: outlines/vllm/github_medium/every load" in text and "did not finish" in text
    assert len(pd.read_csv(tmp_path / "report" / "campaign.csv")) == len(frame)
