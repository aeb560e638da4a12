"""The live forward's MTP head (CPU, tiny model): each drafting pass is one decode step of a one-layer model
made of the head's layer, fed the projection of the previous pass's greedy token and hidden state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cdbench.harness.costs.hardware import ModelSpec
from cdbench.harness.live.forward import NORM_EPS, LiveForward
from cdbench.harness.live.paged import KVCache, KVPool
from cdbench.harness.live.step import LiveStep


def tiny(mtp_layers: int = 1) -> ModelSpec:
    return ModelSpec(name="tiny-mtp", params_total=1e5, n_layers=2, hidden_size=64, n_heads=8, n_kv_heads=2,
                     head_dim=16, vocab_size=50, intermediate_size=96, qk_norm=True, mtp_layers=mtp_layers)


def pool(spec: ModelSpec) -> KVPool:
    return KVPool(spec, 2 * 16, "cpu", torch.bfloat16, block_size=4, extra_layers=spec.mtp_layers)


def test_each_drafting_pass_is_a_decode_step_of_the_heads_layer() -> None:
    spec = tiny()
    fwd = LiveForward(spec, "cpu", dtype=torch.bfloat16, seed=1, mtp=True)
    positions, slots, passes = [5, 9], [0, 1], 3
    cache = pool(spec).cache(2, 16)
    logits = fwd.draft(cache, fwd.draft_inputs(positions, slots), passes)

    # the reference: a one-layer forward whose layer is the head's, its embedding table each pass's projected
    # inputs (row i of the table is row i's input), its cache the head's pages of a fresh pool
    ref = LiveForward(spec.model_copy(update={"n_layers": 1, "mtp_layers": 0}), "cpu", dtype=torch.bfloat16)
    head = fwd.mtp_layers[0]
    ref.layers = [type(head)(**{**head.__dict__, "cache_index": 0})]
    ref.final_norm, ref.lm_head = fwd.final_norm, fwd.lm_head
    fresh = pool(spec).cache(2, 16)
    n_full = spec.n_full_attention_layers
    ref_cache = KVCache([fresh.k[n_full]], [fresh.v[n_full]], fresh.block_table, fresh.block_size)
    inputs = fwd.draft_inputs(positions, slots)
    tokens, hidden = inputs.tokens, inputs.hidden
    enorm, hnorm = fwd.mtp_norms
    for j in range(passes):
        x = torch.cat([F.rms_norm(F.embedding(tokens, fwd.embed), (64,), enorm, NORM_EPS),
                       F.rms_norm(hidden, (64,), hnorm, NORM_EPS)], dim=-1) @ fwd.mtp_fc
        ref.embed = x
        step = ref.decode_inputs([p + j for p in positions], slots, tokens=[0, 1], per_row=True)
        expected = ref.step(ref_cache, step)
        # the head's hidden state after its layer: what the step's LM head read (recovered through the layer)
        hidden = _layer_out(ref, x, ref_cache, step)
        tokens = expected.argmax(dim=-1)
    assert torch.allclose(logits, expected, atol=1e-5, rtol=1e-4)
    # the head wrote its keys at the drafts' positions, in its own pages only
    assert torch.equal(cache.k[n_full], fresh.k[n_full]) and torch.equal(cache.v[n_full], fresh.v[n_full])
    assert all(not c.any() for c in cache.k[:n_full])
    written = cache.where(torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([5, 6, 7, 9, 10, 11]))
    flat = cache.k[n_full].permute(0, 2, 1, 3).reshape(-1, spec.n_kv_heads, spec.head_dim)
    assert flat[written].abs().sum(dim=(1, 2)).gt(0).all()
    assert int(flat.abs().sum(dim=(1, 2)).gt(0).sum()) == len(written)


def _layer_out(ref: LiveForward, x: torch.Tensor, cache: KVCache, step) -> torch.Tensor:
    """The one layer's output for inputs ``x`` (its keys rewritten with the same values: a replay)."""
    layer = ref.layers[0]
    cos, sin = ref._rope(step.positions)
    where = cache.where(step.slots, step.positions)
    normed = F.rms_norm(x, (x.shape[-1],), layer.attn_norm, NORM_EPS)
    x = x + ref._attention(layer, normed, cos, sin, cache, 0, where, step, len(x), (), None)
    return x + ref._ffn(layer, F.rms_norm(x, (x.shape[-1],), layer.mlp_norm, NORM_EPS))


def test_the_head_is_built_only_when_asked_and_only_for_a_model_that_has_one() -> None:
    assert LiveForward(tiny(), "cpu", dtype=torch.bfloat16).mtp_layers == []
    with pytest.raises(ValueError, match="has no MTP head"):
        LiveForward(tiny(), "cpu", dtype=torch.bfloat16).draft(pool(tiny()).cache(1, 8), None, 1)
    with pytest.raises(ValueError, match="tiny-mtp has no MTP layer"):
        LiveForward(tiny(0), "cpu", dtype=torch.bfloat16, mtp=True)


def test_the_pool_pages_the_heads_layers_after_the_models() -> None:
    spec = tiny(2)
    assert len(pool(spec).k) == spec.n_full_attention_layers + 2
    per_layer = KVCache.bytes_per_token(spec, torch.bfloat16) // spec.n_full_attention_layers
    with_head = KVCache.bytes_per_token(spec, torch.bfloat16, extra_layers=2)
    assert with_head == per_layer * (spec.n_full_attention_layers + 2)


def test_a_live_step_drafts_with_the_head_after_its_forward() -> None:
    spec = tiny()
    live = LiveStep(spec, 64, max_len=40, device="cpu", kv_tokens=160, max_rows=8, block_size=4, mtp_drafts=2)
    assert len(live.paged.pool.k) == spec.n_full_attention_layers + 1  # the head's pages beside the model's
    empty = np.zeros(0, np.int64)
    live.begin(np.array([5, 9]), np.array([2, 0]), empty, empty, sync=True, host_s=0.0,
               decode_rid=np.array([7, 3]), prefill_rid=empty, running=np.array([7, 3]))
    times = live.end(mask_rows=0, sample_rows=4, host_s=0.0, sync=True)
    assert times.forward_s > 0
    # request 7 verified 5..7 and drafts at 8 and 9; request 3 verified 9 and drafts at 10 and 11: their
    # blocks hold the drafts too (10 and 12 tokens in blocks of 4)
    paged = live.paged
    assert [len(paged._blocks[rid]) for rid in (7, 3)] == [3, 3]
    cache, head = live.cache, spec.n_full_attention_layers
    slots = torch.tensor([paged._rows[7]] * 2 + [paged._rows[3]] * 2)
    flat = cache.k[head].permute(0, 2, 1, 3).reshape(-1, spec.n_kv_heads, spec.head_dim)
    drafted = cache.where(slots, torch.tensor([8, 9, 10, 11]))
    written = flat.abs().sum(dim=(1, 2)).gt(0)
    # the head's keys at the drafts' positions; the warm-up's steps wrote none of its pages
    assert written[drafted].all() and int(written.sum()) == len(drafted)


def test_a_live_run_drafting_with_the_head_finishes_its_requests() -> None:
    from cdbench.harness.costs.gpu import FixedGpuCosts
    from cdbench.harness.executors.model import FixedGrammarCosts, ModelExecutor
    from cdbench.harness.policies import policy
    from cdbench.harness.run import max_context, simulate
    from cdbench.workloads.request import Request

    requests = [Request(i, 0.002 * i, 12, 10) for i in range(4)]
    max_len = max_context(requests, 2)
    live = LiveStep(tiny(), 64, max_len, device="cpu", kv_tokens=8 * (max_len + 2), max_rows=16, block_size=4,
                    mtp_drafts=2)
    result = simulate(requests, policy("vllm", spec_tokens=2, spec_drafter="mtp", kv_block_size=4),
                      ModelExecutor(FixedGrammarCosts(), alpha=0.5), FixedGpuCosts(forward_base_s=0.01), seed=1,
                      trace_steps=0, live=live)
    assert result.summary.completed == 4 and result.summary.drafted_tokens > 0
    decode = result.steps[result.steps["decode_rows"] > 0]
    assert (decode["forward_s"] > 0).all()
