"""The live forward of the seed's model family: MoE FFNs and hybrid Gated DeltaNet + full attention layers."""

from __future__ import annotations

import pytest
import torch

from cdbench.harness.costs.hardware import ModelSpec, resolve_model
from cdbench.harness.live.forward import (
    LiveForward,
    PrefillChunk,
    TensorParallel,
    kept_linear_state,
)
from cdbench.harness.live.paged import KVCache, KVPool

MOE = ModelSpec(name="tiny-moe", params_total=2e5, params_active=1e5, n_layers=2, hidden_size=64, n_heads=8,
                n_kv_heads=2, head_dim=16, vocab_size=50, n_experts=6, experts_per_token=2,
                moe_intermediate_size=32, qk_norm=True)
# every 2nd layer full attention (gated output), a shared expert; 4 value heads over 2 key heads
HYBRID = MOE.model_copy(update={
    "name": "tiny-hybrid", "n_layers": 4, "full_attention_interval": 2, "attention_output_gate": True,
    "shared_expert_intermediate_size": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4})


@pytest.mark.parametrize("spec", [MOE, HYBRID], ids=lambda s: s.name)
def test_cached_steps_match_one_full_prefill(spec: ModelSpec) -> None:
    torch.manual_seed(0)
    fwd = LiveForward(spec, "cpu", dtype=torch.float32, seed=1)
    tokens = torch.randint(0, spec.vocab_size, (13,))
    full = fwd.step(KVCache.allocate(spec, 1, 16, "cpu", torch.float32), prefill=[PrefillChunk(0, 0, 13)],
                    prefill_tokens=tokens)
    # chunks of 7 and 4 (the linear layers carry state and convolution inputs across), then two decode steps
    cache = KVCache.allocate(spec, 1, 16, "cpu", torch.float32)
    fwd.step(cache, prefill=[PrefillChunk(0, 0, 7)], prefill_tokens=tokens[:7])
    fwd.step(cache, prefill=[PrefillChunk(0, 7, 4)], prefill_tokens=tokens[7:11])
    fwd.step(cache, decode=fwd.decode_inputs([11], [0], [int(tokens[11])]))
    last = fwd.step(cache, decode=fwd.decode_inputs([12], [0], [int(tokens[12])]))
    torch.testing.assert_close(last, full, rtol=1e-4, atol=1e-5)


def test_hybrid_mixed_batch_matches_separate_steps(one_at_a_time) -> None:
    spec = HYBRID
    fwd = LiveForward(spec, "cpu", dtype=torch.float32, seed=2)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 6)]
    cache = KVCache.allocate(spec, 3, 16, "cpu", torch.float32)
    for slot in (0, 1):
        fwd.step(cache, prefill=[PrefillChunk(slot, 0, len(prompts[slot]))], prefill_tokens=prompts[slot])
    # a stale state in slot 2 must not leak into its fresh prefill
    cache.state[0][2].fill_(5.0)
    cache.conv[0][2].fill_(5.0)
    mixed = fwd.step(cache, decode=fwd.decode_inputs([5, 9], [0, 1], [3, 4]),
                     prefill=[PrefillChunk(2, 0, 6)], prefill_tokens=prompts[2])
    torch.testing.assert_close(mixed, one_at_a_time(fwd, spec, prompts), rtol=1e-4, atol=1e-5)


def test_kept_linear_state_puts_back_the_steps_slots() -> None:
    """What a CUDA graph's capture relies on: warm-up steps inside the block leave the stepped slots' linear
    states and convolution inputs as they were, and a step after the block matches one without the block."""
    spec = HYBRID
    fwd = LiveForward(spec, "cpu", dtype=torch.float32, seed=3)
    cache = KVCache.allocate(spec, 3, 16, "cpu", torch.float32)
    fwd.step(cache, prefill=[PrefillChunk(s, 0, 5) for s in range(3)])
    before = [t.clone() for t in [*cache.state, *cache.conv]]
    decode = fwd.decode_inputs([5, 5], [0, 1], [3, 4])
    with kept_linear_state(cache, decode, [PrefillChunk(2, 5, 3)]):
        for _ in range(2):
            fwd.step(cache, decode, [PrefillChunk(2, 5, 3)])
        assert any(not torch.equal(a, b) for a, b in zip(before, [*cache.state, *cache.conv]))
    for a, b in zip(before, [*cache.state, *cache.conv]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_kept_linear_state_keeps_a_slot_once_however_many_rows_share_it() -> None:
    """A verification row's drafts and a graph's padding rows share their request's slot: one copy a slot (a
    slot's state is a request's heads x key_dim x value_dim a layer), and each comes back."""
    spec = HYBRID
    fwd = LiveForward(spec, "cpu", dtype=torch.float32, seed=3)
    cache = KVCache.allocate(spec, 3, 16, "cpu", torch.float32)
    fwd.step(cache, prefill=[PrefillChunk(s, 0, 5) for s in range(3)])
    before = [t.clone() for t in [*cache.state, *cache.conv]]
    # slot 1 verifies two drafts (three rows), slot 0 pads three more rows; slot 2's chunk
    decode = fwd.decode_inputs([5, 6, 7, 0, 0, 0], [1, 1, 1, 0, 0, 0], per_row=True)
    with kept_linear_state(cache, decode, [PrefillChunk(2, 5, 3)]) as kept:
        assert len(kept) == 2 * spec.n_linear_layers and all(copy.shape[0] == 3 for copy in kept)
        fwd.step(cache, fwd.decode_inputs([5, 5], [0, 1]), [PrefillChunk(2, 5, 3)])
    for a, b in zip(before, [*cache.state, *cache.conv]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_hybrid_cache_layout() -> None:
    pool = KVPool(HYBRID, 64, "cpu", torch.float32)
    cache = pool.cache(4, 16)
    assert len(cache.k) == 2 and len(cache.state) == 2  # 2 full-attention, 2 linear layers
    assert cache.state[0].shape == (4, 4, 8, 8)
    assert cache.conv[0].shape == (4, 2 * 2 * 8 + 4 * 8, 3)
    assert pool.cache(2, 16).state[0].shape[0] == 2
    assert KVCache.bytes_per_token(HYBRID, torch.float32) == 2 * 2 * 2 * 16 * 4
    assert KVCache.bytes_per_slot(HYBRID, torch.float32) == 2 * (4 * 8 * 8 + 64 * 3) * 4
    assert KVCache.bytes_per_slot(MOE) == 0
    assert KVCache.bytes_per_slot(resolve_model("qwen3.5-35b-a3b")) == resolve_model(
        "qwen3.5-35b-a3b").state_bytes_per_request()


def test_moe_and_hybrid_do_not_shard() -> None:
    with pytest.raises(ValueError, match="dense models only"):
        LiveForward(HYBRID, "cpu", dtype=torch.float32, tp=TensorParallel(2, 0))


def test_bf16_hybrid_step_is_finite() -> None:
    fwd = LiveForward(HYBRID, "cpu", dtype=torch.bfloat16)
    cache = KVCache.allocate(HYBRID, 2, 80, "cpu", torch.bfloat16)
    logits = fwd.step(cache, prefill=[PrefillChunk(0, 0, 70)])  # more than one 64-token chunk
    logits = torch.cat([logits, fwd.step(cache, decode=fwd.decode_inputs([70], [0]))])
    assert logits.shape == (2, HYBRID.vocab_size) and torch.isfinite(logits.float()).all()


def test_default_tokens_are_each_requests_own() -> None:
    import torch.nn.functional as F

    from cdbench.harness.live.experts import route
    from cdbench.harness.live.forward import request_tokens

    spec = MOE.model_copy(update={"n_experts": 16, "vocab_size": 500})
    fwd = LiveForward(spec, "cpu", dtype=torch.float32)
    # 64 requests' tokens at one position: distinct, the same every call, and spread over the experts
    ids = request_tokens(torch.arange(64), torch.full((64,), 7), spec.vocab_size)
    assert len(set(ids.tolist())) == 64
    assert torch.equal(ids, request_tokens(torch.arange(64), torch.full((64,), 7), spec.vocab_size))
    _, experts = route(F.embedding(ids, fwd.embed), fwd.layers[0].moe.router, spec.experts_per_token)
    assert len(set(experts.flatten().tolist())) >= 14  # a repeated token would touch 2
    # one request's sequence moves on with its position, and no two requests share their prompt
    first, second = (request_tokens(torch.full((40,), s), torch.arange(40), spec.vocab_size) for s in (0, 1))
    assert len(set(first.tolist())) > 30 and not torch.equal(first, second)


def test_steps_without_tokens_feed_each_requests_own() -> None:
    from cdbench.harness.live.forward import request_tokens

    def run(explicit: bool) -> torch.Tensor:
        fwd = LiveForward(MOE, "cpu", dtype=torch.float32, seed=3)
        cache = KVCache.allocate(MOE, 3, 16, "cpu", torch.float32)
        # two prompts in one step, the second after 4 cached tokens; then decode rows of both
        chunks = [PrefillChunk(0, 0, 9), PrefillChunk(2, 4, 5)]
        given = torch.cat([request_tokens(torch.full((9,), 0), torch.arange(9), MOE.vocab_size),
                           request_tokens(torch.full((5,), 2), torch.arange(4, 9), MOE.vocab_size)])
        prefill = fwd.step(cache, prefill=chunks, prefill_tokens=given if explicit else None)
        ids = request_tokens(torch.tensor([2, 0]), torch.tensor([9, 9]), MOE.vocab_size).tolist()
        decode = fwd.step(cache, fwd.decode_inputs([9, 9], [2, 0], tokens=ids if explicit else None))
        return torch.cat([prefill, decode])

    implied, given = run(False), run(True)
    torch.testing.assert_close(implied, given)
    # and the two requests' decode rows are not fed alike (one id per batch row would be)
    assert not torch.allclose(implied[-1], implied[-2])


def test_requests_prefilled_alike_keep_their_own_contexts() -> None:
    # same-length prompts in different table rows write different keys (one shared prompt would write the same),
    # so their decode rows' hidden states, and with them a MoE's experts, do not converge
    fwd = LiveForward(MOE, "cpu", dtype=torch.float32)
    cache = KVCache.allocate(MOE, 2, 16, "cpu", torch.float32)
    for slot in (0, 1):
        fwd.step(cache, prefill=[PrefillChunk(slot, 0, 12)])
    keys = [cache.pages(MOE.n_layers - 1, slot, 12)[0] for slot in (0, 1)]
    assert not torch.allclose(keys[0], keys[1])


def test_linear_kernel_choice() -> None:
    assert LiveForward(HYBRID, "cpu", dtype=torch.float32).linear_kernels == "torch"  # no GPU: the torch forms
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LiveForward(HYBRID, "cpu", linear_kernels="fla")
    with pytest.raises(ValueError, match="auto, torch or fla"):
        LiveForward(HYBRID, "cpu", linear_kernels="triton")


def test_moe_kernel_choice_runs_the_same_experts() -> None:
    # the fused kernels (their torch reference on the CPU) in place of the grouped GEMMs: the same step,
    # the experts' FFN checked against torch's in test_live_experts.py
    import cdbench.harness.live.experts as experts

    steps = {}
    for kernels in ("grouped_mm", "fused"):
        fwd = LiveForward(MOE, "cpu", dtype=torch.bfloat16, moe_kernels=kernels)
        assert fwd._experts is (experts.fused_experts if kernels == "fused" else experts.grouped_experts)
        cache = KVCache.allocate(MOE, 2, 32, "cpu", torch.bfloat16)
        first = fwd.step(cache, prefill=[PrefillChunk(0, 0, 12)])
        steps[kernels] = torch.cat([first, fwd.step(cache, decode=fwd.decode_inputs([12], [0]))]).float()
    torch.testing.assert_close(steps["fused"], steps["grouped_mm"], rtol=3e-2, atol=3e-2)
    with pytest.raises(ValueError, match="grouped_mm or fused"):
        LiveForward(MOE, "cpu", moe_kernels="triton")
