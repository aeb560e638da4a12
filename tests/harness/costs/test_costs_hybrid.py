"""The seed's model family in the roofline: hybrid linear attention, MoE routing skew, MTP drafting."""

from __future__ import annotations

import numpy as np
import pytest

from cdbench.harness.costs.forward import (
    ForwardConfig,
    ForwardCostModel,
    attention_pairs,
)
from cdbench.harness.costs.hardware import ModelSpec, resolve_model

# A tiny hybrid: 4 layers, every 2nd full attention; 2 value heads of 4 x 8 states.
TINY = ModelSpec(name="tiny-hybrid", params_total=1e6, n_layers=4, hidden_size=64, n_heads=4, n_kv_heads=2,
                 head_dim=16, vocab_size=100, intermediate_size=128, full_attention_interval=2,
                 linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=8,
                 linear_conv_kernel_dim=4)
ALL_FULL = TINY.model_copy(update={"name": "tiny-full", "full_attention_interval": 1})


def roof(spec, gpu: str = "h100") -> ForwardCostModel:
    return ForwardCostModel(spec, gpu, step_overhead_s=0.0, forward_calibration="none")


def test_layer_pattern_is_the_published_one() -> None:
    m = resolve_model("qwen3.5-35b-a3b")
    full = [i for i in range(m.n_layers) if m.is_full_attention(i)]
    assert full == list(range(3, 40, 4))  # linear, linear, linear, full, ... as in layer_types
    assert (m.n_full_attention_layers, m.n_linear_layers) == (10, 30)
    assert m.is_hybrid and not resolve_model("qwen3-30b-a3b").is_hybrid


def test_cache_bytes_helpers_by_hand() -> None:
    llama = resolve_model("llama-3.1-8b")
    assert llama.kv_bytes_per_token() == 2 * 8 * 128 * 2 * 32
    assert llama.state_bytes_per_request() == 0
    assert llama.request_cache_bytes(1000) == 1000 * 131072
    m = resolve_model("qwen3.5-35b-a3b")
    assert m.kv_bytes_per_token() == 2 * 2 * 256 * 2 * 10  # only the 10 full-attention layers cache keys
    state = 32 * 128 * 128 * 2
    conv = (2 * 16 * 128 + 32 * 128) * 3 * 2
    assert m.state_bytes_per_request() == 30 * (state + conv)
    # two ranks: value and key heads split
    assert m.state_bytes_per_request(tp=2) == 30 * (16 * 128 * 128 * 2 + (2 * 8 * 128 + 16 * 128) * 3 * 2)
    assert m.request_cache_bytes(100, tp=2) == 100 * m.kv_bytes_per_token(2) + m.state_bytes_per_request(2)


def test_hybrid_needs_linear_shapes() -> None:
    with pytest.raises(ValueError, match="linear_"):
        ModelSpec(name="bad", params_total=1e6, n_layers=4, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=16,
                  vocab_size=100, full_attention_interval=2)


def test_published_shapes_give_the_parameter_counts() -> None:
    m = resolve_model("qwen3.5-35b-a3b")
    h, e = m.hidden_size, 3 * m.hidden_size * m.moe_intermediate_size
    full = h * m.n_heads * m.head_dim * 2 + 2 * h * m.n_kv_heads * m.head_dim + m.n_heads * m.head_dim * h
    qkvz = h * (2 * m.linear_num_key_heads * m.linear_key_head_dim + 2 * m.linear_num_value_heads * 128)
    linear = qkvz + h * 2 * m.linear_num_value_heads + m.linear_num_value_heads * 128 * h
    shared = 3 * h * m.shared_expert_intermediate_size + h * m.n_experts
    body = 2 * m.vocab_size * h + 10 * full + 30 * linear
    assert body + 40 * (m.n_experts * e + shared) == pytest.approx(m.params_total, rel=2e-3)
    assert body + 40 * (m.experts_per_token * e + shared) == pytest.approx(m.params_active, rel=2e-3)
    assert m.params_total * m.bytes_per_weight < 141e9 / 2  # bf16 weights leave the H200 half its memory


def test_decode_reads_state_not_growing_kv_in_linear_layers() -> None:
    hybrid, full = roof(TINY), roof(ALL_FULL)
    g = hybrid.gpu
    byte_rate, flops_rate = g.hbm_bandwidth_Bps * g.memory_efficiency, g.bf16_dense_flops * g.compute_efficiency
    rows, kv = 3, 3 * 500
    # by hand: 2 full layers of KV reads, and 2 linear layers' states read and written once per row
    kv_bytes = kv * (2 * 2 * 16 * 2) * 2
    state_bytes = rows * 2 * 2 * (2 * 4 * 8 * 2 + (2 * 4 + 2 * 8) * 3 * 2)
    attn_flops = kv * 2 * 4 * 32 * 2 + rows * 7 * 2 * 4 * 8 * 2
    expect = max(attn_flops / flops_rate, (kv_bytes + state_bytes) / byte_rate)
    assert hybrid.breakdown(decode_rows=rows, decode_kv_tokens=kv).decode_attention_s == pytest.approx(expect)
    # context grows the hybrid's decode half as fast (2 of 4 layers cache keys)
    slope_h = hybrid.step_s(decode_rows=rows, decode_kv_tokens=2 * kv) - hybrid.step_s(decode_rows=rows, decode_kv_tokens=kv)
    slope_f = full.step_s(decode_rows=rows, decode_kv_tokens=2 * kv) - full.step_s(decode_rows=rows, decode_kv_tokens=kv)
    assert slope_h == pytest.approx(slope_f / 2)


def test_prefill_is_chunked_scan_flops() -> None:
    hybrid, full = roof(TINY), roof(ALL_FULL)
    flops_rate = hybrid.gpu.bf16_dense_flops * hybrid.gpu.compute_efficiency
    n = 256
    pairs = attention_pairs(n, 0)
    per_token = (6 * 4 * 8 + 2 * 64 * (4 + 8)) * 2 * 2  # 2 value heads, 2 linear layers
    expect = pairs * 2 * 4 * 32 * 2 / flops_rate + n * per_token / flops_rate
    got = hybrid.breakdown(prefill_tokens=n, prefill_context_tokens=pairs, prefill_chunks=1).prefill_attention_s
    assert got == pytest.approx(expect)
    # quadratic attention only in the full layers: a long prompt costs the hybrid less attention
    long_pairs = attention_pairs(8192, 0)
    assert (hybrid.breakdown(prefill_tokens=8192, prefill_context_tokens=long_pairs).prefill_attention_s
            < 0.6 * full.breakdown(prefill_tokens=8192, prefill_context_tokens=long_pairs).prefill_attention_s)


def test_hybrid_monotone() -> None:
    fwd = ForwardCostModel("qwen3.5-35b-a3b", "h200", forward_calibration="none")
    rows = np.arange(1, 300)
    t = fwd.step_s_array(0, 0, rows, rows * 1000)
    assert np.all(np.diff(t) >= 0)
    kv = np.arange(1, 100) * 1000
    assert np.all(np.diff(fwd.step_s_array(0, 0, 8, kv)) > 0)
    pf = np.arange(1, 4000, 37)
    assert np.all(np.diff(fwd.step_s_array(pf, attention_pairs(pf, 0), 0, 0, 1)) > 0)


def test_moe_imbalance() -> None:
    base = roof("qwen3-30b-a3b")
    same = ForwardCostModel("qwen3-30b-a3b", "h100", step_overhead_s=0.0, forward_calibration="none", moe_imbalance=1.0)
    skew = ForwardCostModel("qwen3-30b-a3b", "h100", step_overhead_s=0.0, forward_calibration="none", moe_imbalance=2.0)
    for rows in (1, 7, 64):
        assert same.step_s(decode_rows=rows) == base.step_s(decode_rows=rows)  # the default is uniform routing
    # one token reads exactly k experts however skewed the router; many tokens read only E / rho of them
    assert skew.breakdown(decode_rows=1).linear_memory_s == pytest.approx(base.breakdown(decode_rows=1).linear_memory_s)
    peak = skew.peak_times(0, 0, 100_000, 0)
    assert (peak.weight_bytes_s, peak.expert_bytes_s) == pytest.approx((skew._dense_weight_s, skew._expert_s * 64))
    assert skew.step_s(decode_rows=32) < base.step_s(decode_rows=32)
    with pytest.raises(ValueError, match="moe_imbalance"):
        ForwardCostModel("qwen3-30b-a3b", "h100", moe_imbalance=0.5)
    assert ForwardConfig(model="qwen3-30b-a3b", moe_imbalance=1.5).build().moe_imbalance == 1.5


def test_mtp_draft_cost_by_hand() -> None:
    fwd = roof("qwen3.5-35b-a3b", "h200")
    m, g = fwd.model, fwd.gpu
    h = m.hidden_size
    byte_rate = g.hbm_bandwidth_Bps * g.memory_efficiency
    layer = (2 * h * h + h * 16 * 256 * 2 + 2 * h * 2 * 256 + 16 * 256 * h + h * 256 + 3 * h * 512
             + 8 * 3 * h * 512)
    weights = (layer + m.vocab_size * h) * 2
    # one row, no context: the head's weights, its 8 experts and the LM head, at the memory roof
    assert fwd.mtp_draft_s(1, 1) == pytest.approx(weights / byte_rate)
    # drafting is sequential: k drafts are k passes; more rows touch more experts
    assert fwd.mtp_draft_s(1, 3) == pytest.approx(3 * fwd.mtp_draft_s(1, 1), rel=1e-5)  # (+1 key a pass)
    assert fwd.mtp_draft_s(16, 1, 16 * 1000) > fwd.mtp_draft_s(1, 1, 1000)
    assert fwd.mtp_draft_s(0, 3) == 0.0 == fwd.mtp_draft_s(4, 0)
    # a draft token costs far less than a verifying step of the whole model
    assert fwd.mtp_draft_s(8, 1, 8000) < 0.5 * fwd.step_s(decode_rows=8, decode_kv_tokens=8000)
    with pytest.raises(ValueError, match="no MTP layer"):
        roof("qwen3-30b-a3b").mtp_draft_s(1, 1)


def test_mtp_head_of_an_unpriced_kind_fails_only_when_drafting() -> None:
    fwd = roof(resolve_model("deepseek-v3").model_copy(update={"mtp_layers": 1}))
    assert fwd.step_s(decode_rows=1, decode_kv_tokens=100) > 0
    with pytest.raises(ValueError, match="GQA attention only"):
        fwd.mtp_draft_s(1, 1)
