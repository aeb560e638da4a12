"""benchmarks/live_prefill_gap.py on the CPU: a tiny model's prefill steps timed as the calibration grid times
them and through live mode's LiveStep, on one process and on two tensor-parallel rank processes (gloo)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import live_prefill_gap  # noqa: E402

TINY = {"name": "tiny", "params_total": 1e5, "n_layers": 2, "hidden_size": 64, "n_heads": 8, "n_kv_heads": 4,
        "head_dim": 16, "vocab_size": 50, "intermediate_size": 96}


def test_shapes_are_parsed_or_refused_by_name():
    shape = live_prefill_gap.parse_shape("2x576+64x1024")
    assert (shape.chunks, shape.new, shape.rows, shape.kv) == (2, 576, 64, 1024)
    with pytest.raises(ValueError, match="shape '2x': expected CxN"):
        live_prefill_gap.parse_shape("2x")
    with pytest.raises(ValueError, match="shape '0x8': chunks and tokens must be positive"):
        live_prefill_gap.parse_shape("0x8")


@pytest.mark.parametrize("chunks,new", [(1, 100), (2, 7), (5, 660), (3, 1)])
def test_ragged_chunks_keep_the_steps_tokens(chunks, new):
    shape = live_prefill_gap.parse_shape(f"{chunks}x{new}")
    ragged = live_prefill_gap.chunk_lengths(shape, ragged=True)
    assert len(ragged) == chunks and int(ragged.sum()) == chunks * new and (ragged >= 1).all()
    assert live_prefill_gap.longest_context([shape]) == int(ragged.max())


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_prefill_steps_are_timed_on_one_and_two_tensor_parallel_ranks(tmp_path):
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps(TINY))
    out = tmp_path / "gap.csv"
    live_prefill_gap.main(["--model", str(spec), "--device", "cpu", "--vocab", "64", "--gpu", "h100-sxm",
                           "--shapes", "1x8", "3x6+2x8", "--tp", "1", "2", "--reps", "2", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [(r["tp"], r["chunks"], r["new"], r["rows"]) for r in rows] == [
        ("1", "1", "8", "0"), ("1", "3", "6", "2"), ("2", "1", "8", "0"), ("2", "3", "6", "2")]
    for row in rows:
        assert row["gpu"] == "cpu" and row["max_len"] == "9"  # the ragged step's last prompt: 9 tokens
        for name in ("grid_ms", "live_ms", "live_ragged_ms", "live_step_ms", "model_ms"):
            assert float(row[name]) > 0
        assert float(row["live_step_ms"]) >= float(row["live_ms"])
        # (every figure of the row is rounded to 4 decimals: a small ratio is off its recomputed value by that much)
        ratio = float(row["live_ms"]) / float(row["grid_ms"])
        assert float(row["live_over_grid"]) == pytest.approx(ratio, rel=1e-3, abs=1e-4)
    # the model's price follows the tensor-parallel size (its shard and all-reduces)
    assert rows[0]["model_ms"] != rows[2]["model_ms"]


def test_a_max_len_too_short_for_a_shape_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        live_prefill_gap.main(["--device", "cpu", "--shapes", "2x10", "--max-len", "12", "--out", str(tmp_path / "x")])
    assert "--max-len 12 is shorter than a shape's longest context (15 tokens)" in capsys.readouterr().err
