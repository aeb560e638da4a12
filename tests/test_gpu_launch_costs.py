"""benchmarks/gpu_launch_costs.py on the CPU: every replayed call of V0's sampler and row path is timed and written."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_launch_costs  # noqa: E402


def test_each_call_is_timed_per_rows_and_written_under_the_versions_line(tmp_path):
    out = tmp_path / "launch.csv"
    gpu_launch_costs.main(["--device", "cpu", "--rows", "1,3", "--vocab", "100", "--reps", "2", "--warmup", "1",
                           "--out", str(out)])
    head, *lines = out.read_text().splitlines()
    assert head.startswith("# device=") and "xgrammar=" in head and "torch=" in head
    rows = list(csv.DictReader(lines))
    sampler = [r["name"] for r in rows if r["part"] == "sampler" and r["rows"] == "3"]
    # the CPU run's 16 device calls: 9 sends, the cast, div_, softmax, log_softmax, the index cast, gather, argmax
    calls = [n for n in sampler if not n.startswith(("stage_", "ref_"))]
    assert len(calls) == 16 and calls[:9] == [f"to_{n}" for n in gpu_launch_costs.SENT]
    assert len([n for n in sampler if n.startswith("stage_")]) == 7
    per_row = [r for r in rows if r["part"] == "processor" and r["rows"] == "3"]
    assert [r["name"] for r in per_row] == ["copy_blocking", "apply_bitmask", "write_back"]
    assert all(r["n"] == "6" for r in per_row)  # one per row and step
    assert {r["mode"] for r in rows} == {"idle"}  # the busy GPU mode needs CUDA
    assert all(float(r["p10_us"]) <= float(r["host_us"]) <= float(r["p90_us"]) for r in rows)
