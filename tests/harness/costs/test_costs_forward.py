"""Roofline sanity: the forward cost model against first-principles numbers."""

from __future__ import annotations

import numpy as np
import pytest

from cdbench.harness.costs.forward import (
    ForwardConfig,
    ForwardCostModel,
    attention_pairs,
)
from cdbench.harness.costs.hardware import (
    GPUS,
    MODELS,
    GPUSpec,
    ModelSpec,
    SpecFileError,
    UnknownSpecError,
    resolve_gpu,
    resolve_model,
)


@pytest.fixture(scope="module")
def llama_h100() -> ForwardCostModel:
    return ForwardCostModel("llama-3.1-8b", "h100-sxm", step_overhead_s=0.0, forward_calibration="none")


def test_decode_batch1_is_weight_bytes_over_bandwidth(llama_h100: ForwardCostModel) -> None:
    weight_bytes = 8.03e9 * 2  # bf16
    floor = weight_bytes / 3.35e12  # ≈ 4.8 ms at the datasheet bandwidth
    t = llama_h100.step_s(decode_rows=1, decode_kv_tokens=100)
    assert floor < t < floor / llama_h100.gpu.memory_efficiency * 1.02
    assert llama_h100.breakdown(decode_rows=1, decode_kv_tokens=100).linear_bound == "memory"


def test_overhead_and_speed_apply() -> None:
    base = ForwardCostModel("llama-3.1-8b", "h100-sxm", step_overhead_s=0.0, forward_calibration="none")
    tuned = ForwardCostModel("llama-3.1-8b", "h100-sxm", speed=1.5, step_overhead_s=1e-3, forward_calibration="none")
    args = dict(decode_rows=4, decode_kv_tokens=4000)
    assert tuned.step_s(**args) == pytest.approx(1.5 * (base.step_s(**args) + 1e-3))
    assert tuned.step_s() == 0.0


@pytest.mark.parametrize("model", sorted(MODELS))
def test_monotone_in_batch_and_context(model: str) -> None:
    fwd = ForwardCostModel(model, "h200")
    batch = [fwd.step_s(decode_rows=b, decode_kv_tokens=b * 2000) for b in (1, 2, 8, 32, 128, 512)]
    assert all(a < b for a, b in zip(batch, batch[1:]))
    context = [fwd.step_s(decode_rows=16, decode_kv_tokens=16 * c) for c in (100, 1000, 10_000, 100_000)]
    assert all(a < b for a, b in zip(context, context[1:]))
    prefill = [fwd.step_s(prefill_tokens=n, prefill_context_tokens=attention_pairs(n, 0)) for n in (64, 512, 4096)]
    assert all(a < b for a, b in zip(prefill, prefill[1:]))


def test_long_prefill_is_compute_bound(llama_h100: ForwardCostModel) -> None:
    n = 8192
    parts = llama_h100.breakdown(prefill_tokens=n, prefill_context_tokens=attention_pairs(n, 0))
    assert parts.linear_bound == "compute"
    flops = 2 * 8.03e9 * n
    assert parts.linear_compute_s == pytest.approx(flops / (989e12 * llama_h100.gpu.compute_efficiency))
    # attention grows quadratically: doubling the prompt more than doubles it
    longer = llama_h100.breakdown(prefill_tokens=2 * n, prefill_context_tokens=attention_pairs(2 * n, 0))
    assert longer.prefill_attention_s > 3.5 * parts.prefill_attention_s


def test_attention_pairs() -> None:
    assert attention_pairs(1, 0) == 1
    assert attention_pairs(3, 0) == 1 + 2 + 3
    assert attention_pairs(2, 5) == 6 + 7
    np.testing.assert_allclose(attention_pairs(np.array([3, 2]), np.array([0, 5])), [6, 13])


def test_moe_cheaper_than_dense_with_same_total_params() -> None:
    moe = resolve_model("qwen3-30b-a3b")
    dense = moe.model_copy(update={"name": "dense-30b", "params_active": None, "n_experts": 0, "experts_per_token": 0})
    moe_fwd, dense_fwd = ForwardCostModel(moe, "h100"), ForwardCostModel(dense, "h100")
    for rows in (1, 8, 64):
        assert moe_fwd.step_s(decode_rows=rows, decode_kv_tokens=rows * 1000) < dense_fwd.step_s(
            decode_rows=rows, decode_kv_tokens=rows * 1000)
    pairs = attention_pairs(4096, 0)
    assert moe_fwd.step_s(prefill_tokens=4096, prefill_context_tokens=pairs) < dense_fwd.step_s(
        prefill_tokens=4096, prefill_context_tokens=pairs) / 5


def test_moe_reads_only_touched_experts() -> None:
    fwd = ForwardCostModel("qwen3-30b-a3b", "h100", step_overhead_s=0.0)
    m = fwd.model
    one = fwd.breakdown(decode_rows=1).linear_memory_s
    many = fwd.breakdown(decode_rows=4096).linear_memory_s
    byte_rate = fwd.gpu.hbm_bandwidth_Bps * fwd.gpu.memory_efficiency
    assert one == pytest.approx(m.active * m.bytes_per_weight / byte_rate)  # one token: exactly the active weights
    assert many == pytest.approx(m.params_total * m.bytes_per_weight / byte_rate, rel=1e-3)  # all experts


def test_mla_kv_is_compressed() -> None:
    ds = resolve_model("deepseek-v3")
    assert ds.kv_elements_per_token_layer() == 512 + 64
    gqa_equivalent = 2 * ds.n_heads * ds.head_dim
    assert ds.kv_elements_per_token_layer() < gqa_equivalent / 50
    # the latent is not split by heads, so every TP rank holds all of it
    assert ds.kv_elements_per_token_layer(tp=8) == ds.kv_elements_per_token_layer()


def test_tensor_parallel_splits_weights_and_adds_communication() -> None:
    one = ForwardCostModel("llama-3.1-8b", "h100", tp=1, step_overhead_s=0.0, forward_calibration="none")
    four = ForwardCostModel("llama-3.1-8b", "h100", tp=4, step_overhead_s=0.0)
    p1, p4 = one.breakdown(decode_rows=8, decode_kv_tokens=8000), four.breakdown(decode_rows=8, decode_kv_tokens=8000)
    assert p4.linear_memory_s == pytest.approx(p1.linear_memory_s / 4)
    assert p1.communication_s == 0.0 and p4.communication_s > 0
    assert p4.total_s < p1.total_s
    # GQA heads split over ranks, replicated beyond the KV-head count
    llama = one.model
    assert llama.kv_elements_per_token_layer(4) == llama.kv_elements_per_token_layer(1) / 4
    assert llama.kv_elements_per_token_layer(16) == llama.kv_elements_per_token_layer(8)


def test_array_form_matches_scalar(llama_h100: ForwardCostModel) -> None:
    rng = np.random.default_rng(0)
    pf = rng.integers(0, 2048, 50)
    pairs = attention_pairs(pf, rng.integers(0, 4096, 50))
    rows = rng.integers(0, 256, 50)
    kv = rows * rng.integers(1, 4000, 50)
    rows[0] = pf[0] = pairs[0] = kv[0] = 0
    got = llama_h100.step_s_array(pf, pairs, rows, kv)
    want = [llama_h100.step_s(*args) for args in zip(pf.tolist(), pairs.tolist(), rows.tolist(), kv.tolist())]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[0] == 0.0


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(UnknownSpecError, match="llama-3.1-8b") as err:
        resolve_model("gpt-5")
    assert "gpt-5" in str(err.value)
    with pytest.raises(UnknownSpecError, match="h100-sxm.*h200|a100-80gb.*h100-sxm"):
        ForwardCostModel("qwen3-8b", "tpu-v5")
    with pytest.raises(UnknownSpecError, match="does not exist"):
        resolve_gpu("missing.yaml")


def test_aliases_and_catalog() -> None:
    assert resolve_gpu("H100").name == "h100-sxm"
    assert resolve_gpu("A100_80GB").name == "a100-80gb"
    assert resolve_model("Llama-3.1-8B").name == "llama-3.1-8b"
    assert set(GPUS) == {"h100-sxm", "h200", "a100-80gb"}
    assert set(MODELS) == {"llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "qwen3.5-35b-a3b", "deepseek-v3"}
    assert resolve_model("Qwen3.5-MoE").name == "qwen3.5-35b-a3b"


def test_custom_specs_from_yaml_and_json(tmp_path) -> None:
    model_file = tmp_path / "tiny.yaml"
    model_file.write_text(
        "name: tiny\nparams_total: 1.0e9\nn_layers: 4\nhidden_size: 1024\nn_heads: 8\n"
        "n_kv_heads: 2\nhead_dim: 128\nvocab_size: 32000\n"
    )
    gpu = GPUSpec(name="mygpu", hbm_bandwidth_Bps=1e12, hbm_bytes=24e9, bf16_dense_flops=100e12,
                  nvlink_bandwidth_Bps=100e9, pcie_bandwidth_Bps=32e9, memory_efficiency=1.0)
    gpu_file = tmp_path / "mygpu.json"
    gpu_file.write_text(gpu.model_dump_json())
    fwd = ForwardCostModel(model_file, gpu_file, step_overhead_s=0.0)
    assert fwd.model.name == "tiny" and fwd.gpu == gpu
    assert fwd.breakdown(decode_rows=1).linear_memory_s == pytest.approx(2e9 / 1e12)
    config = ForwardConfig(model=str(model_file), gpu=gpu)
    assert config.build().model.n_layers == 4


def test_bad_spec_file_names_file_and_field(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nparams_total: -3\nn_layers: 4\nhidden_size: 1\nn_heads: 1\nn_kv_heads: 1\n"
                   "head_dim: 1\nvocab_size: 10\n")
    with pytest.raises(SpecFileError, match=r"bad\.yaml.*params_total"):
        resolve_model(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("{not yaml: [")
    with pytest.raises(SpecFileError, match="broken.json"):
        resolve_gpu(broken)
    with pytest.raises(ValueError, match="mla"):
        ModelSpec(name="m", params_total=1e9, n_layers=1, hidden_size=1, n_heads=1, n_kv_heads=1,
                  head_dim=1, vocab_size=1, attention="mla")


def test_a_decode_steps_forward_is_the_cost_models_own_remembered_or_not(monkeypatch) -> None:
    """The GPU costs remember a decode-only step's forward a page of context lengths at a time per row count:
    the same seconds as the forward model's, the model asked once per page, and the memory started afresh
    when full."""
    from cdbench.harness.costs.gpu import RooflineGpuCosts
    from cdbench.harness.costs.mask import MaskCost

    forward = ForwardCostModel("llama-3.1-8b", "h200")
    gpu = RooflineGpuCosts(forward, MaskCost.for_gpu("h200", 1000))
    none = np.zeros(0, np.int64)
    page = RooflineGpuCosts.DECODE_PAGE
    pairs = [(rows, kv) for rows in (1, 2, 8) for kv in (100, 5_000, 5_000 + page)]
    for rows, kv in pairs * 2:
        assert gpu.forward_s(none, none, rows, kv) == forward.step_s(0.0, 0.0, rows, kv, 0)
    calls = []
    monkeypatch.setattr(forward, "decode_step_s", lambda rows, kv: calls.append(kv) or np.ones(len(kv)))
    assert gpu.forward_s(none, none, 1, 101) == forward.step_s(0.0, 0.0, 1, 101, 0)
    assert calls == []  # its page remembered
    monkeypatch.setattr(RooflineGpuCosts, "DECODE_MEMO", len(pairs) * page)
    assert gpu.forward_s(none, none, 3, 7) == 1.0
    assert len(calls) == 1 and calls[0].tolist() == list(range(page)) and len(gpu._pages) == 1  # full: afresh


def test_a_prefill_steps_forward_is_the_cost_models_own_remembered_or_not(monkeypatch) -> None:
    """A step with prefill chunks is remembered by its tokens, attention pairs, decode rows, context and chunks
    (and a lone chunk by its tokens, cached tokens, decode rows and context)."""
    from cdbench.harness.costs.forward import attention_pairs
    from cdbench.harness.costs.gpu import RooflineGpuCosts
    from cdbench.harness.costs.mask import MaskCost

    forward = ForwardCostModel("qwen3-30b-a3b", "h200")
    gpu = RooflineGpuCosts(forward, MaskCost.for_gpu("h200", 1000))
    steps = [(np.array([512]), np.array([0]), 0, 0), (np.array([512]), np.array([64]), 0, 0),
             (np.array([512, 40]), np.array([0, 0]), 3, 900), (np.array([512]), np.array([0]), 3, 900)]
    expected = [forward.step_s(float(c.sum()), float(attention_pairs(c, cached).sum()), rows, kv, len(c))
                for c, cached, rows, kv in steps]
    for _ in range(2):
        assert [gpu.forward_s(*step) for step in steps] == expected
    assert len(gpu._prefill) == len(steps)
    assert len(gpu._prefill_one) == 3  # (a prompt alone: by its chunk and cached tokens too)
    monkeypatch.setattr(forward, "step_s", lambda *args: 1.0)
    assert gpu.forward_s(*steps[0]) == expected[0]  # remembered
    monkeypatch.setattr(RooflineGpuCosts, "PREFILL_MEMO", len(steps))
    assert gpu.forward_s(np.array([7]), np.array([0]), 0, 0) == 1.0 and len(gpu._prefill) == 1  # full: afresh
    assert len(gpu._prefill_one) == len(steps)  # (not full yet)
    assert [gpu.forward_s(*step) for step in steps] == [expected[0], expected[1], 1.0, expected[3]]  # (lone ones)
    assert gpu.forward_s(np.array([9]), np.array([0]), 0, 0) == 1.0 and len(gpu._prefill_one) == 1  # full: afresh
