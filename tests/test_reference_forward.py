"""benchmarks/reference_forward.py on the CPU: a tiny model's live decode steps, the minimal reference forward and
the weight-bytes floor, one CSV row a shape and the markdown table."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import reference_forward  # noqa: E402

from cdbench.harness.costs.hardware import ModelSpec, resolve_model  # noqa: E402

TINY = {"name": "tiny", "params_total": 1e5, "n_layers": 2, "hidden_size": 64, "n_heads": 8, "n_kv_heads": 2,
        "head_dim": 16, "vocab_size": 50, "intermediate_size": 96, "qk_norm": True}
MOE = ModelSpec(name="tiny-moe", params_total=2e5, params_active=1e5, n_layers=2, hidden_size=64, n_heads=8,
                n_kv_heads=2, head_dim=16, vocab_size=50, n_experts=6, experts_per_token=2, moe_intermediate_size=32)


def test_live_reference_and_floor_of_a_tiny_model_on_the_cpu(tmp_path):
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps(TINY))
    out = tmp_path / "ref.csv"
    reference_forward.main(["--model", str(spec), "--device", "cpu", "--rows", "1", "4", "--kv", "16", "64",
                            "--max-tokens", "128", "--min-reps", "2", "--min-time", "0", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [(r["rows"], r["kv"]) for r in rows] == [("1", "16"), ("4", "16"), ("1", "64")]  # 4 x 64 > 128 tokens
    for r in rows:
        assert r["device"] == "cpu" and float(r["live_ms"]) > 0 and float(r["reference_ms"]) > 0
        assert float(r["live_over_reference"]) == pytest.approx(float(r["live_ms"]) / float(r["reference_ms"]), rel=1e-6)
        assert float(r["floor_kv_ms"]) > float(r["floor_ms"]) > 0
    # weights: 2 layers of qkv (64 x 192), o (128 x 64), gate_up (64 x 192), down (96 x 64); the LM head 64 x 50
    weights = (2 * (64 * 192 + 128 * 64 + 64 * 192 + 96 * 64) + 64 * 50) * 2
    assert float(rows[0]["weight_gb"]) == pytest.approx(weights / 1e9)
    assert float(rows[1]["kv_gb"]) == pytest.approx(2 * 4 * 16 * 32 * 2 * 2 / 1e9)  # k and v, 2 layers, bf16
    table = out.with_suffix(".md").read_text()
    assert "| tiny | 4 | 16 |" in table and "live / floor" in table


def test_the_reference_reads_the_experts_uniform_routing_touches():
    ref = reference_forward.ReferenceForward(MOE, "cpu")
    assert [reference_forward.experts_touched(MOE, n) for n in (1, 2, 4, 64)] == [2, 3, 5, 6]
    token_of, ends = ref.routing(2)
    assert sorted(token_of.tolist()) == [0, 0, 1, 1] and ends.tolist() == [2, 3, 4, 4, 4, 4]  # 3 experts touched
    expert = 64 * 64 + 32 * 64  # gate_up and down of one expert
    dense = 2 * (64 * 192 + 128 * 64) + 64 * 50
    assert ref.weight_bytes(2) == (dense + 2 * 3 * expert) * 2
    logits = ref.step(torch.tensor([3, 9]), ref.cache(2, 8), ref.routing(2))
    assert logits.shape == (2, 50) and torch.isfinite(logits.float()).all()


def test_hybrid_models_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="qwen3.5-35b-a3b: the reference forward has no linear-attention layers"):
        reference_forward.ReferenceForward(resolve_model("qwen3.5-35b-a3b"), "cpu")
