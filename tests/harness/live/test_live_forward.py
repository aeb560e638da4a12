"""The live forward computes a real transformer step: a KV cache, chunked prefill and decode agree; its MTP
head's drafting passes are decode steps of a one-layer model made of the head's layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cdbench.harness.costs.hardware import ModelSpec, resolve_model
from cdbench.harness.live.forward import (
    NORM_EPS,
    LiveForward,
    PrefillChunk,
    check_supported,
    intermediate_size,
    request_tokens,
)
from cdbench.harness.live.paged import KVCache, KVPool
from cdbench.harness.live.step import LiveStep


def tiny(qk_norm: bool) -> ModelSpec:
    return ModelSpec(name="tiny", params_total=1e5, n_layers=2, hidden_size=64, n_heads=8, n_kv_heads=2,
                     head_dim=16, vocab_size=50, intermediate_size=96, qk_norm=qk_norm)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_cached_steps_match_one_full_prefill(qk_norm: bool) -> None:
    torch.manual_seed(0)
    spec = tiny(qk_norm)
    fwd = LiveForward(spec, "cpu", dtype=torch.float32, seed=1)
    tokens = torch.randint(0, spec.vocab_size, (12,))
    full = fwd.step(KVCache.allocate(spec, 1, 16, "cpu", torch.float32), prefill=[PrefillChunk(0, 0, 12)],
                    prefill_tokens=tokens)
    # The same 12 tokens as a chunk of 7, a chunk of 4 after them, then one decode step.
    cache = KVCache.allocate(spec, 1, 16, "cpu", torch.float32)
    fwd.step(cache, prefill=[PrefillChunk(0, 0, 7)], prefill_tokens=tokens[:7])
    fwd.step(cache, prefill=[PrefillChunk(0, 7, 4)], prefill_tokens=tokens[7:11])
    last = fwd.step(cache, decode=fwd.decode_inputs([11], [0], [int(tokens[11])]))
    torch.testing.assert_close(last, full, rtol=1e-4, atol=1e-5)


def test_mixed_batch_rows_of_different_lengths_match_separate_steps(one_at_a_time) -> None:
    spec = tiny(True)
    fwd = LiveForward(spec, "cpu", dtype=torch.float32)
    prompts = [torch.randint(0, spec.vocab_size, (n,)) for n in (5, 9, 6)]
    cache = KVCache.allocate(spec, 3, 16, "cpu", torch.float32)
    for slot in (0, 1):
        fwd.step(cache, prefill=[PrefillChunk(slot, 0, len(prompts[slot]))], prefill_tokens=prompts[slot])
    # Rows 0 and 1 decode (5 and 9 cached: the shorter one is masked) while slot 2 prefills.
    mixed = fwd.step(cache, decode=fwd.decode_inputs([5, 9], [0, 1], [3, 4]),
                     prefill=[PrefillChunk(2, 0, 6)], prefill_tokens=prompts[2])
    torch.testing.assert_close(mixed, one_at_a_time(fwd, spec, prompts), rtol=1e-4, atol=1e-5)


def test_shapes_and_refusals() -> None:
    assert intermediate_size(resolve_model("llama-3.1-8b")) == 14336
    derived = resolve_model("qwen3-8b").model_copy(update={"intermediate_size": None})
    assert intermediate_size(derived) == 12288  # from params_total, as the model card says
    check_supported(resolve_model("qwen3-30b-a3b"))
    check_supported(resolve_model("qwen3.5-35b-a3b"))
    with pytest.raises(ValueError, match="GQA models only"):
        check_supported(resolve_model("deepseek-v3"))
    with pytest.raises(ValueError, match="needs moe_intermediate_size"):
        check_supported(resolve_model("qwen3-30b-a3b").model_copy(update={"moe_intermediate_size": None}))
    pool = KVPool(tiny(False), 64, "cpu", torch.float32)
    assert pool.cache(4, 16).k[0].shape == (4, 2, 16, 16)
    with pytest.raises(ValueError, match="does not fit"):
        pool.cache(5, 16)
    assert KVCache.bytes_per_token(resolve_model("llama-3.1-8b")) == 2 * 32 * 8 * 128 * 2


def test_measure_grid_sizes_the_cache_slots_as_asked():
    from cdbench.harness.live.measure import StepShape, measure_grid, pool_tokens

    shapes = [StepShape(rows=2, kv=8), StepShape(chunks=1, new=16)]
    # 2 rows of 8 + 1 keys: a block of 16 each; with cache_len, 4 blocks each
    assert (pool_tokens(shapes), pool_tokens(shapes, cache_len=64)) == (32, 128)
    spec = tiny(qk_norm=False)
    rows = measure_grid(spec, shapes, device="cpu", dtype=torch.bfloat16, min_reps=1, min_time_s=0.0, per_row=True,
                        cache_len=64)
    assert [r.kind for r in rows] == ["decode", "prefill"] and all(r.median_s > 0 for r in rows)
    with pytest.raises(ValueError, match="cache_len 8 is shorter"):
        measure_grid(spec, shapes, device="cpu", cache_len=8)


def _scattered(spec, dtype):
    """Three requests of 16 tokens in blocks of 4, grown block by block in turns from a shuffled free list, so
    each request's pages are interleaved with the others' and out of order."""
    import numpy as np

    from cdbench.harness.live.paged import PagedRequests

    paged = PagedRequests(KVPool(spec, 64, "cpu", dtype, block_size=4), 3, 16)
    paged.allocator.release(paged.allocator.allocate(16)[::-1])  # hand the blocks out in another order
    for tokens in range(4, 17, 4):
        paged.rows(np.array([0, 1, 2]), np.full(3, tokens))
    paged.flush()
    cache = paged.cache
    assert len(set(cache.block_table.flatten().tolist())) == 12
    assert any(row.tolist() != sorted(row.tolist()) for row in cache.block_table), "pages out of order"
    return cache


def test_pages_scattered_over_the_pool_match_one_block_a_request(one_at_a_time) -> None:
    # the dense decode path (fp32): the steps equal the same requests in caches of one block each
    spec = tiny(True)
    fwd = LiveForward(spec, "cpu", dtype=torch.float32)
    prompts = [torch.randint(0, spec.vocab_size, (n,)) for n in (5, 9, 6)]
    cache = _scattered(spec, torch.float32)
    for slot in (0, 1):
        fwd.step(cache, prefill=[PrefillChunk(slot, 0, len(prompts[slot]))], prefill_tokens=prompts[slot])
    mixed = fwd.step(cache, decode=fwd.decode_inputs([5, 9], [0, 1], [3, 4]),
                     prefill=[PrefillChunk(2, 0, 6)], prefill_tokens=prompts[2])
    torch.testing.assert_close(mixed, one_at_a_time(fwd, spec, prompts), rtol=1e-4, atol=1e-5)
    # a chunk after a cached prefix reads that prefix from its pages
    tokens = torch.randint(0, spec.vocab_size, (12,))
    whole = fwd.step(KVCache.allocate(spec, 1, 16, "cpu", torch.float32), prefill=[PrefillChunk(0, 0, 12)],
                     prefill_tokens=tokens)
    fwd.step(cache, prefill=[PrefillChunk(1, 0, 7)], prefill_tokens=tokens[:7])
    torch.testing.assert_close(fwd.step(cache, prefill=[PrefillChunk(1, 7, 5)], prefill_tokens=tokens[7:]), whole,
                               rtol=1e-4, atol=1e-5)


# ---- the MTP head ------------------------------------------------------------------------------------------

def tiny_mtp(mtp_layers: int = 1) -> ModelSpec:
    return ModelSpec(name="tiny-mtp", params_total=1e5, n_layers=2, hidden_size=64, n_heads=8, n_kv_heads=2,
                     head_dim=16, vocab_size=50, intermediate_size=96, qk_norm=True, mtp_layers=mtp_layers)


def mtp_pool(spec: ModelSpec) -> KVPool:
    return KVPool(spec, 2 * 16, "cpu", torch.bfloat16, block_size=4, extra_layers=spec.mtp_layers)


def test_each_drafting_pass_is_a_decode_step_of_the_heads_layer() -> None:
    spec = tiny_mtp()
    fwd = LiveForward(spec, "cpu", dtype=torch.bfloat16, seed=1, mtp=True)
    positions, slots, passes = [5, 9], [0, 1], 3
    cache = mtp_pool(spec).cache(2, 16)
    logits = fwd.draft(cache, fwd.draft_inputs(positions, slots), passes)

    # the reference: a one-layer forward whose layer is the head's, its embedding table each pass's projected
    # inputs (row i of the table is row i's input), its cache the head's pages of a fresh pool
    ref = LiveForward(spec.model_copy(update={"n_layers": 1, "mtp_layers": 0}), "cpu", dtype=torch.bfloat16)
    head = fwd.mtp_layers[0]
    ref.layers = [type(head)(**{**head.__dict__, "cache_index": 0})]
    ref.final_norm, ref.lm_head = fwd.final_norm, fwd.lm_head
    fresh = mtp_pool(spec).cache(2, 16)
    n_full = spec.n_full_attention_layers
    ref_cache = KVCache([fresh.k[n_full]], [fresh.v[n_full]], fresh.block_table, fresh.block_size)
    inputs = fwd.draft_inputs(positions, slots)
    tokens, hidden = request_tokens(inputs.slots, inputs.positions, spec.vocab_size), inputs.hidden
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


def test_measuring_draft_shapes_times_the_heads_passes() -> None:
    from cdbench.harness.live.measure import StepShape, draft_grid, grid_shapes, measure_grid, tiny_grid

    spec = tiny_mtp()
    # a model with an MTP head gets the draft shapes after the step grid's, on one GPU only
    assert grid_shapes("tiny", spec) == tiny_grid() + [StepShape(rows=1, kv=8, drafts=1),
                                                       StepShape(rows=4, kv=16, drafts=2)]
    assert grid_shapes("tiny", tiny_mtp(0)) == grid_shapes("tiny", spec, tp=2) == tiny_grid()
    assert grid_shapes("draft", spec) == draft_grid() and len(draft_grid()) == 18
    assert all(s.rows * s.kv <= 2**18 for s in draft_grid())
    with pytest.raises(ValueError, match="tiny-mtp has no MTP head"):
        grid_shapes("draft", tiny_mtp(0))
    with pytest.raises(ValueError, match="measured on one GPU, not 2 ranks"):
        grid_shapes("draft", spec, tp=2)
    with pytest.raises(ValueError, match="a draft shape has drafting rows and no prefill chunk"):
        StepShape(rows=2, kv=8, chunks=1, new=4, drafts=1)
    shapes = [StepShape(rows=2, kv=8), StepShape(rows=2, kv=8, drafts=3)]
    assert shapes[1].max_len == 11  # the drafts' keys go at positions 8, 9 and 10
    rows = measure_grid(spec, shapes, device="cpu", min_reps=1, min_time_s=0.0)
    assert [(r.kind, r.mtp_drafts, r.label) for r in rows] == [("decode", 0, "decode 2x8"),
                                                               ("draft", 3, "draft 2x8 k3")]
    assert rows[1].decode_attention == "per_row" and rows[0].decode_attention == "dense"
    assert all(r.median_s > 0 and not r.graph for r in rows)


def _layer_out(ref: LiveForward, x: torch.Tensor, cache: KVCache, step) -> torch.Tensor:
    """The one layer's output for inputs ``x`` (its keys rewritten with the same values: a replay)."""
    layer = ref.layers[0]
    cos, sin = ref._rope(step.positions)
    where = cache.where(step.slots, step.positions)
    normed = F.rms_norm(x, (x.shape[-1],), layer.attn_norm, NORM_EPS)
    x = x + ref._attention(layer, normed, cos, sin, cache, 0, where, step, len(x), (), None)
    return x + ref._ffn(layer, F.rms_norm(x, (x.shape[-1],), layer.mlp_norm, NORM_EPS))


def test_the_head_is_built_only_when_asked_and_only_for_a_model_that_has_one() -> None:
    assert LiveForward(tiny_mtp(), "cpu", dtype=torch.bfloat16).mtp_layers == []
    with pytest.raises(ValueError, match="has no MTP head"):
        LiveForward(tiny_mtp(), "cpu", dtype=torch.bfloat16).draft(mtp_pool(tiny_mtp()).cache(1, 8), None, 1)
    with pytest.raises(ValueError, match="tiny-mtp has no MTP layer"):
        LiveForward(tiny_mtp(0), "cpu", dtype=torch.bfloat16, mtp=True)


def test_the_pool_pages_the_heads_layers_after_the_models() -> None:
    spec = tiny_mtp(2)
    assert len(mtp_pool(spec).k) == spec.n_full_attention_layers + 2
    per_layer = KVCache.bytes_per_token(spec, torch.bfloat16) // spec.n_full_attention_layers
    with_head = KVCache.bytes_per_token(spec, torch.bfloat16, extra_layers=2)
    assert with_head == per_layer * (spec.n_full_attention_layers + 2)


def test_a_live_step_drafts_with_the_head_after_its_forward() -> None:
    spec = tiny_mtp()
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
    live = LiveStep(tiny_mtp(), 64, max_len, device="cpu", kv_tokens=8 * (max_len + 2), max_rows=16, block_size=4,
                    mtp_drafts=2)
    result = simulate(requests, policy("vllm", spec_tokens=2, spec_drafter="mtp", kv_block_size=4),
                      ModelExecutor(FixedGrammarCosts(), alpha=0.5), FixedGpuCosts(forward_base_s=0.01), seed=1,
                      trace_steps=0, live=live)
    assert result.summary.completed == 4 and result.summary.drafted_tokens > 0
    decode = result.steps[result.steps["decode_rows"] > 0]
    assert (decode["forward_s"] > 0).all()


def test_measuring_with_written_contexts_writes_what_a_prefill_leaves_before_timing(monkeypatch) -> None:
    """--write-contexts: each decode row's context and each chunk's cached prefix are written by prefill steps
    before the shape is timed, and the rows say so (a calibration of them records it)."""
    from cdbench.harness.live import measure
    from cdbench.harness.live.measure import StepShape, measure_grid

    spec = tiny(qk_norm=False)
    writes: list[list[tuple[int, int, int]]] = []
    step = LiveForward.step

    def recorded(self, cache, decode=None, prefill=(), *args, **kwargs):
        if decode is None and prefill:
            writes.append([(c.slot, c.cached, c.new) for c in prefill])
        return step(self, cache, decode, prefill, *args, **kwargs)

    monkeypatch.setattr(LiveForward, "step", recorded)
    monkeypatch.setattr(measure, "_WRITE_STEP_TOKENS", 16)
    shapes = [StepShape(rows=3, kv=8), StepShape(rows=1, kv=4, chunks=1, new=4, cached=8)]
    rows = measure_grid(spec, shapes, device="cpu", min_reps=1, min_time_s=0.0, write_contexts=True)
    # the first shape's three rows in steps of at most 16 tokens; the second's row and its chunk's prefix
    assert writes[0] == [(0, 0, 8), (1, 0, 8)] and writes[1] == [(2, 0, 8)]
    assert [(0, 0, 4), (1, 0, 8)] in writes
    assert all(r.contexts_written for r in rows)
    writes.clear()
    plain = measure_grid(spec, shapes[:1], device="cpu", min_reps=1, min_time_s=0.0)
    assert not plain[0].contexts_written and writes == []


def test_written_contexts_survive_the_measurement_file_and_a_fit_refuses_to_mix_them(tmp_path) -> None:
    import dataclasses

    from cdbench.harness.costs.calibration import CalibrationError, read_measurements, write_measurements
    from cdbench.harness.costs.calibration_fit import fit_calibration
    from cdbench.harness.costs.hardware import resolve_gpu

    repo = __import__("pathlib").Path(__file__).resolve().parents[3]
    rows = read_measurements(repo / "reports" / "calibration" / "qwen3-8b__h200.csv")
    assert not any(r.contexts_written for r in rows)  # measured before the column: unwritten
    written = [dataclasses.replace(r, contexts_written=True) for r in rows]
    write_measurements(written, tmp_path / "m.csv")
    assert read_measurements(tmp_path / "m.csv") == written
    spec, gpu = resolve_model("qwen3-8b"), resolve_gpu("h200")
    with pytest.raises(CalibrationError, match="mix written and unwritten contexts"):
        fit_calibration(written[:40] + rows[40:], spec, gpu, measurements="m.csv", command="test")
    # an MTP head's draft shapes write their own keys (never a prefill's contexts): they mix with written steps
    hybrid = read_measurements(repo / "reports" / "calibration" / "qwen3.5-35b-a3b__h200.csv")
    steps_written = [r if r.mtp_drafts else dataclasses.replace(r, contexts_written=True) for r in hybrid]
    assert any(r.mtp_drafts for r in steps_written)
    cal = fit_calibration(steps_written, resolve_model("qwen3.5-35b-a3b"), gpu, measurements="m.csv", command="test")
    assert cal.contexts_written
