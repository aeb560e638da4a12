"""The live forward computes a real transformer step: a KV cache, chunked prefill and decode agree."""

from __future__ import annotations

import pytest
import torch

from cdbench.harness.costs.hardware import ModelSpec, resolve_model
from cdbench.harness.live.forward import (
    LiveForward,
    PrefillChunk,
    check_supported,
    intermediate_size,
)
from cdbench.harness.live.paged import KVCache, KVPool


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

