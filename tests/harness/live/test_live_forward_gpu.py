"""On a CUDA device: a captured step replays to the eager step's logits."""

from __future__ import annotations

import pytest
import torch

from cdbench.harness.costs.hardware import ModelSpec
from cdbench.harness.live.forward import (
    LiveForward,
    PrefillChunk,
    kept_linear_state,
)
from cdbench.harness.live.paged import KVCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_graph_replay_matches_eager() -> None:
    spec = ModelSpec(name="small", params_total=1e7, n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=2,
                     head_dim=64, vocab_size=1000, intermediate_size=1024, qk_norm=True)
    fwd = LiveForward(spec, "cuda")
    cache = KVCache.allocate(spec, 9, 300, "cuda")
    fwd.step(cache, prefill=[PrefillChunk(s, 0, 256) for s in range(9)])
    decode = fwd.decode_inputs([256] * 8)
    eager = fwd.step(cache, decode, [PrefillChunk(8, 256, 32)]).clone()
    graph = fwd.capture(cache, decode, [PrefillChunk(8, 256, 32)])
    torch.testing.assert_close(graph.replay(), eager, rtol=2e-2, atol=2e-2)


def test_live_gpu_costs_time_graph_replays() -> None:
    import numpy as np

    from cdbench.harness.live.gpu import LiveGpuCosts

    spec = ModelSpec(name="small", params_total=1e7, n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=2,
                     head_dim=64, vocab_size=1000, intermediate_size=1024)
    live = LiveGpuCosts(spec, vocab_size=4096, kv_tokens=2**16, max_rows=64)
    decode = [live.forward_s(np.zeros(0), np.zeros(0), 8, 8 * 500) for _ in range(3)]
    assert all(t > 0 for t in decode) and len(live._graphs) == 1  # one capture, replayed
    assert live.forward_s(np.array([128, 64]), np.array([0, 256]), 8, 8 * 500) > 0
    assert 0 < live.apply_s(16) == live.apply_s(16)


def test_measure_grid_times_steps_after_an_idle_gpu() -> None:
    from cdbench.harness.live.measure import StepShape, measure_grid

    spec = ModelSpec(name="small", params_total=1e7, n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=2,
                     head_dim=64, vocab_size=1000, intermediate_size=1024)
    shapes = [StepShape(rows=4, kv=300)]
    alone = measure_grid(spec, shapes, per_row=True, cache_len=1024, idle_s=1e-3, min_reps=5, min_time_s=0.0)
    packed = measure_grid(spec, shapes, per_row=True, cache_len=1024, min_reps=5, min_time_s=0.0)
    assert alone[0].reps == 5 and alone[0].median_s > 0 and packed[0].median_s > 0


def test_fla_delta_rule_matches_the_torch_forms() -> None:
    """flash-linear-attention's Gated DeltaNet kernels against the torch forms: decode rows and prefill chunks
    from the same states, outputs and new states."""
    pytest.importorskip("fla")
    spec = ModelSpec(name="small-hybrid", params_total=2e7, n_layers=2, hidden_size=512, n_heads=8, n_kv_heads=2,
                     head_dim=64, vocab_size=1000, intermediate_size=1024, full_attention_interval=2,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                     linear_value_head_dim=64, linear_conv_kernel_dim=4)
    fwd = LiveForward(spec, "cuda", linear_kernels="fla")
    gen = torch.Generator("cuda").manual_seed(0)
    rows, chunks = 3, [PrefillChunk(3, 0, 100), PrefillChunk(4, 40, 70)]
    tokens, heads, d = rows + 170, 4, 64
    q, k = (torch.nn.functional.normalize(torch.randn(tokens, heads, d, device="cuda", generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(tokens, heads, d, device="cuda", generator=gen)
    g = -torch.rand(tokens, heads, device="cuda", generator=gen) * 0.5
    beta = torch.rand(tokens, heads, device="cuda", generator=gen)
    start = torch.randn(5, heads, d, d, device="cuda", generator=gen) * 0.1
    decode = fwd.decode_inputs([50, 60, 70], [0, 1, 2])
    outputs, states = {}, {}
    for name, form in (("fla", fwd._fla_delta_rule), ("torch", fwd._torch_delta_rule)):
        state = start.clone()
        qk = (q.bfloat16(), k.bfloat16()) if name == "fla" else (q, k)  # as the layer hands them over
        outputs[name] = form(*qk, v.bfloat16(), g, beta, state, decode, rows, chunks).float()
        states[name] = state
    torch.testing.assert_close(outputs["fla"], outputs["torch"], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(states["fla"], states["torch"], rtol=2e-2, atol=2e-2)


def test_hybrid_steps_with_fla_match_the_torch_forms() -> None:
    """Whole steps of a hybrid (dense FFN: a MoE router's top-k flips on bf16 rounding, which no tolerance
    covers) through fla's kernels and through the torch forms."""
    pytest.importorskip("fla")
    spec = ModelSpec(name="small-hybrid", params_total=2e7, n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=2,
                     head_dim=64, vocab_size=1000, intermediate_size=1024, qk_norm=True, attention_output_gate=True,
                     full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)
    logits = {}
    for kernels in ("fla", "torch"):
        fwd = LiveForward(spec, "cuda", linear_kernels=kernels)
        assert fwd.linear_kernels == kernels
        cache = KVCache.allocate(spec, 3, 300, "cuda")
        first = fwd.step(cache, prefill=[PrefillChunk(s, 0, 100 + 50 * s) for s in range(3)])
        later = fwd.step(cache, fwd.decode_inputs([100, 150]), [PrefillChunk(2, 200, 30)])
        logits[kernels] = torch.cat([first, later]).float()
    torch.testing.assert_close(logits["fla"], logits["torch"], rtol=5e-2, atol=5e-2)


def test_hybrid_decode_graph_replays() -> None:
    spec = ModelSpec(name="small-hybrid", params_total=2e7, params_active=1e7, n_layers=4, hidden_size=512,
                     n_heads=8, n_kv_heads=2, head_dim=64, vocab_size=1000, n_experts=8, experts_per_token=2,
                     moe_intermediate_size=256, qk_norm=True, full_attention_interval=2, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                     linear_conv_kernel_dim=4)
    fwd = LiveForward(spec, "cuda")
    cache = KVCache.allocate(spec, 8, 300, "cuda")
    fwd.step(cache, prefill=[PrefillChunk(s, 0, 256) for s in range(8)])
    decode = fwd.decode_inputs([256] * 8)
    with kept_linear_state(cache, decode):  # the replay starts from the states the eager step started from
        eager = fwd.step(cache, decode).clone()
    graph = fwd.capture(cache, decode)  # leaves the states as they were
    torch.testing.assert_close(graph.replay(), eager, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_hybrid_prefill_step_captures(kernels: str) -> None:
    """A mixed step of a MoE hybrid (grouped expert GEMMs, chunked delta rule) captures and replays."""
    spec = ModelSpec(name="small-hybrid", params_total=2e7, params_active=1e7, n_layers=4, hidden_size=512,
                     n_heads=8, n_kv_heads=2, head_dim=64, vocab_size=1000, n_experts=8, experts_per_token=2,
                     moe_intermediate_size=256, shared_expert_intermediate_size=256, qk_norm=True,
                     full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)
    fwd = LiveForward(spec, "cuda", linear_kernels=kernels)
    cache = KVCache.allocate(spec, 3, 400, "cuda")
    fwd.step(cache, prefill=[PrefillChunk(s, 0, 200) for s in range(3)])
    graph = fwd.capture(cache, fwd.decode_inputs([200, 200]), [PrefillChunk(2, 200, 130)])
    assert torch.isfinite(graph.replay().float()).all()


def test_the_mtp_heads_captured_drafting_matches_its_eager_passes() -> None:
    from cdbench.harness.live.paged import KVPool

    spec = ModelSpec(name="tiny-mtp", params_total=1e5, n_layers=2, hidden_size=64, n_heads=8, n_kv_heads=2,
                     head_dim=16, vocab_size=50, intermediate_size=96, qk_norm=True, mtp_layers=1)
    fwd = LiveForward(spec, "cuda", mtp=True)
    pool = KVPool(spec, 64, "cuda", block_size=4, extra_layers=1)
    cache = pool.cache(2, 16)
    positions, slots = [5, 9], [0, 1]
    eager = fwd.draft(cache, fwd.draft_inputs(positions, slots), 3)
    # the capture's warm-up passes rewrite the same keys, so the replay reads what the eager passes read
    graph = fwd.capture_draft(cache, fwd.draft_inputs(positions, slots), 3)
    torch.testing.assert_close(graph.replay(), eager, rtol=2e-2, atol=2e-2)


def test_the_default_grid_of_a_model_with_an_mtp_head_measures_its_drafting_as_graphs() -> None:
    from cdbench.harness.live.measure import StepShape, default_grid, draft_grid, grid_shapes, measure_grid

    spec = ModelSpec(name="small-mtp", params_total=1e7, n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=2,
                     head_dim=64, vocab_size=1000, intermediate_size=1024, qk_norm=True, mtp_layers=1)
    assert grid_shapes("default", spec) == default_grid() + draft_grid()
    # the default grid's largest step beside its draft shapes: one pool holds both, the head's pages after
    shapes = [StepShape(rows=512, kv=512), *draft_grid()]
    rows = measure_grid(spec, shapes, per_row=True, min_reps=3, min_time_s=0.0)
    assert [r.kind for r in rows] == ["decode"] + ["draft"] * len(draft_grid())
    assert [r.mtp_drafts for r in rows[1:]] == [s.drafts for s in draft_grid()]
    assert all(r.graph and r.reps >= 3 and r.median_s > 0 for r in rows)
