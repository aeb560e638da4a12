"""MoE forward fits: a prefill chunk's tokens route over a share of the experts, decode rows over all; the
experts' grouped GEMM costs more a FLOP at its small tile."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cdbench.harness.costs.calibration import (
    ForwardCalibration,
    read_measurements,
    shipped_calibration_path,
)
from cdbench.harness.costs.calibration_fit import fit_calibration
from cdbench.harness.costs.forward import ForwardCostModel, attention_pairs

REPO = Path(__file__).resolve().parents[3]


def moe_model(**terms) -> ForwardCostModel:
    cal = ForwardCalibration.load(shipped_calibration_path("qwen3-30b-a3b", "h200"))
    # the weights' read at the one-token rate for every step (a several-token step's slower read: tested apart)
    return ForwardCostModel("qwen3-30b-a3b", "h200", forward_calibration=cal.model_copy(
        update={"multi_token_read": 0.0} | terms))


def test_a_prefill_chunk_routes_its_tokens_over_a_share_of_the_experts() -> None:
    skewed, uniform = moe_model(chunk_routing_skew=4.0), moe_model(chunk_routing_skew=1.0)
    # a calibration without the term (None) routes every token uniformly
    assert moe_model(chunk_routing_skew=None).params == uniform.params
    e, k, skew = 128, 8, 4.0

    def experts_read(fwd: ForwardCostModel, **step) -> float:
        # the experts' part of the linear layers' memory time, in experts read
        shape = dict(prefill_tokens=0, prefill_context_tokens=0, decode_rows=0, decode_kv_tokens=0) | step
        weights = fwd.breakdown(**step).linear_memory_s * fwd.params.memory_efficiency
        return (weights - fwd.peak_times(**shape).weight_bytes_s) / fwd._expert_s

    # decode rows route uniformly: the skew leaves decode-only steps alone
    for rows in (1, 16, 256):
        assert skewed.step_s(decode_rows=rows, decode_kv_tokens=rows * 512) == pytest.approx(
            uniform.step_s(decode_rows=rows, decode_kv_tokens=rows * 512), rel=1e-12)
    # one chunk of n tokens touches (E / skew)(1 - (1 - k skew / E)^n) experts, uniform routing E(1 - (1 - k/E)^n)
    for n in (1, 64, 1024):
        step = dict(prefill_tokens=n, prefill_context_tokens=float(attention_pairs(n, 0)), prefill_chunks=1)
        assert experts_read(skewed, **step) == pytest.approx(e / skew * (1 - (1 - k * skew / e) ** n))
        assert experts_read(uniform, **step) == pytest.approx(e * (1 - (1 - k / e) ** n))
    # chunks route apart from each other and from the decode rows: an expert is missed by all of them
    share = (1 - (1 - k * skew / e) ** 256) / skew
    mixed = dict(prefill_tokens=1024, prefill_context_tokens=4 * float(attention_pairs(256, 0)), decode_rows=8,
                 decode_kv_tokens=8 * 1024, prefill_chunks=4)
    assert experts_read(skewed, **mixed) == pytest.approx(e * (1 - (1 - k / e) ** 8 * (1 - share) ** 4))
    assert skewed.step_s(**mixed) < uniform.step_s(**mixed)
    # arrays price each step as the scalar call does
    assert skewed.step_s_array([64, 1024], [attention_pairs(64, 0), mixed["prefill_context_tokens"]], [0, 8],
                               [0, 8192], [1, 4]).tolist() == pytest.approx(
        [skewed.step_s(64, float(attention_pairs(64, 0)), prefill_chunks=1), skewed.step_s(**mixed)])


def test_a_hybrid_skews_only_the_layers_after_full_attention() -> None:
    # qwen3.5-35b-a3b: 10 of 40 layers full attention; the experts after the 30 linear-attention layers route a
    # chunk uniformly (reports/calibration/README.md counts the router's choices)
    cal = ForwardCalibration.load(shipped_calibration_path("qwen3.5-35b-a3b", "h200"))

    def hybrid(skew: float) -> ForwardCostModel:
        return ForwardCostModel("qwen3.5-35b-a3b", "h200", forward_calibration=cal.model_copy(
            update={"chunk_routing_skew": skew, "multi_token_read": 0.0}))

    skewed, uniform = hybrid(4.0), hybrid(1.0)
    e, k, skew, n = 256, 8, 4.0, 64
    step = dict(prefill_tokens=n, prefill_context_tokens=float(attention_pairs(n, 0)), prefill_chunks=1)
    read = {}
    for name, fwd in (("skewed", skewed), ("uniform", uniform)):
        weights = fwd.breakdown(**step).linear_memory_s * fwd.params.memory_efficiency
        shape = dict(decode_rows=0, decode_kv_tokens=0) | step
        read[name] = (weights - fwd.peak_times(**shape).weight_bytes_s) / fwd._expert_s
    every_layer_uniform = e * (1 - (1 - k / e) ** n)
    every_layer_skewed = e / skew * (1 - (1 - k * skew / e) ** n)
    assert read["uniform"] == pytest.approx(every_layer_uniform)
    assert read["skewed"] == pytest.approx(0.25 * every_layer_skewed + 0.75 * every_layer_uniform)


def test_dense_models_are_priced_as_before() -> None:
    shipped = ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h100-sxm"))
    assert shipped.chunk_routing_skew is None
    base = ForwardCostModel("qwen3-8b", "h100-sxm", forward_calibration=shipped)
    terms = ForwardCostModel("qwen3-8b", "h100-sxm", forward_calibration=shipped.model_copy(
        update={"chunk_routing_skew": 8.0, "expert_small_tile_cost": 1.0}))
    for step in (dict(decode_rows=32, decode_kv_tokens=32 * 900),
                 dict(prefill_tokens=512, prefill_context_tokens=float(attention_pairs(512, 0)), prefill_chunks=1),
                 dict(prefill_tokens=512, prefill_context_tokens=2e5, decode_rows=4, decode_kv_tokens=4000,
                      prefill_chunks=2)):
        assert terms.step_s(**step) == base.step_s(**step)
    # a dense fit solves neither term
    rows = read_measurements(REPO / shipped.measurements)
    cal = fit_calibration(rows[::4], "qwen3-8b", "h100-sxm", measurements="x", command="test")
    assert cal.chunk_routing_skew is None and cal.expert_small_tile_cost is None


def _priced_exactly(**update):
    """The MoE's measured grid with every step at the price of the shipped fit with ``update``."""
    truth = ForwardCalibration.load(shipped_calibration_path("qwen3-30b-a3b", "h200")).model_copy(update=update)
    model = ForwardCostModel("qwen3-30b-a3b", "h200", forward_calibration=truth)
    return [dataclasses.replace(r, median_s=model.step_s(r.prefill_tokens, r.prefill_pairs, r.decode_rows,
                                                         r.decode_kv_tokens, r.prefill_chunks))
            for r in read_measurements(REPO / truth.measurements)]


def test_the_fit_recovers_a_known_chunk_routing_skew() -> None:
    exact = _priced_exactly(chunk_routing_skew=3.0)
    cal = fit_calibration(exact, "qwen3-30b-a3b", "h200", measurements="x", command="test")
    assert cal.max_abs_error < 0.005
    assert cal.chunk_routing_skew == pytest.approx(3.0, rel=0.1)


def test_the_experts_flops_cost_more_at_the_grouped_gemms_small_tile() -> None:
    """torch's grouped GEMM runs a smaller tile while a step's mean rows an expert (tokens x 8 / 128 for
    qwen3-30b-a3b) are at most 128: up to 2,048 tokens the experts' FLOPs cost 1 + expert_small_tile_cost times
    theirs above (the shipped fit's measured prefills: 1,024 and 2,048 tokens cost more a token than 4,096 and
    8,192, reports/calibration/README.md)."""
    shipped = ForwardCalibration.load(shipped_calibration_path("qwen3-30b-a3b", "h200"))
    assert shipped.expert_small_tile_cost > 0.1
    tiled, untiled = moe_model(), moe_model(expert_small_tile_cost=None)
    spec = tiled.model
    per_expert = (spec.params_total - spec.active) / (spec.n_experts - spec.experts_per_token)

    def prefill(fwd: ForwardCostModel, n: int):
        return fwd.breakdown(prefill_tokens=n, prefill_context_tokens=float(attention_pairs(n, 0)), prefill_chunks=1)

    extra = tiled.params.expert_small_tile_cost / tiled.params.compute_efficiency / tiled.gpu.bf16_dense_flops
    for n, small in ((1, True), (1024, True), (2048, True), (2049, False), (8192, False)):
        expert_flops = 2.0 * spec.experts_per_token * per_expert * n
        assert prefill(tiled, n).linear_compute_s - prefill(untiled, n).linear_compute_s == pytest.approx(
            extra * expert_flops * small, rel=1e-9, abs=1e-15)
    # one token past the switch the step is priced shorter: the large tile's FLOPs are cheaper
    assert prefill(tiled, 2049).total_s < prefill(tiled, 2048).total_s
    assert prefill(untiled, 2049).total_s > prefill(untiled, 2048).total_s
    # decode rows take part: the tile follows the step's tokens, however they are split
    mixed = dict(prefill_tokens=2000, prefill_context_tokens=float(attention_pairs(2000, 0)), decode_rows=64,
                 decode_kv_tokens=64 * 1024, prefill_chunks=1)
    assert tiled.breakdown(**mixed).linear_compute_s == untiled.breakdown(**mixed).linear_compute_s


def test_the_fit_recovers_a_known_small_tile_cost() -> None:
    exact = _priced_exactly(expert_small_tile_cost=0.6)
    cal = fit_calibration(exact, "qwen3-30b-a3b", "h200", measurements="x", command="test")
    assert cal.max_abs_error < 0.005
    assert cal.expert_small_tile_cost == pytest.approx(0.6, rel=0.1)
    # a grid with no step past the switch cannot tell the term from the rest: it is not solved
    small = [r for r in exact if r.prefill_tokens + r.decode_rows <= 2048]
    assert fit_calibration(small, "qwen3-30b-a3b", "h200", measurements="x", command="test").expert_small_tile_cost \
        is None
