"""Decode attention: the torch reference's semantics, input checks, the default splits, the Triton
kernel under the interpreter (in a subprocess) and on a GPU at Llama-3.1-8B shapes, CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch
from decode_attention_cases import (
    assert_close,
    check_decode_attention,
    check_paged_decode_attention,
    decode_inputs,
    paged,
    reference_output,
)
from interpreter import run_under_interpreter

from cdbench.kernels import decode_attention as module
from cdbench.kernels.decode_attention import decode_attention, default_splits, lpt_order
from cdbench.kernels.reference import decode_attention_reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Llama-3.1-8B attention: 32 query heads over 8 KV heads of 128.
LLAMA = {"kv_heads": 8, "group": 4, "head_dim": 128}


def test_triton_kernel_equals_reference_under_interpreter():
    run_under_interpreter("decode_attention_interpreted.py")


def test_reference_matches_per_head_softmax():
    # An independent oracle: one row and query head at a time, float64, KV head h // G.
    gen = torch.Generator().manual_seed(0)
    q, k, v, slots, lengths = decode_inputs(gen, [3, 0, 16, 1], 2, 3, 8, 16, torch.float32, "cpu")
    got = decode_attention_reference(q, k, v, slots, lengths, scale=0.5)
    for row, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist())):
        for head in range(6):
            if length == 0:
                assert not got[row, head].any()
                continue
            keys, values = k[slot, head // 3, :length].double(), v[slot, head // 3, :length].double()
            weights = torch.softmax(keys @ q[row, head].double() * 0.5, dim=0)
            torch.testing.assert_close(got[row, head].double(), weights @ values, rtol=1e-5, atol=1e-6)


def test_paged_reference_reads_each_rows_pages_in_table_order():
    gen = torch.Generator().manual_seed(4)
    q, k, v, slots, lengths = decode_inputs(gen, [5, 0, 16, 11], 2, 2, 16, 16, torch.float32, "cpu")
    k_pages, v_pages, table = paged(k, v, 4, gen)
    assert not torch.equal(table.flatten().sort().values, table.flatten()), "pages out of order"
    got = decode_attention_reference(q, k_pages, v_pages, slots, lengths, block_table=table)
    torch.testing.assert_close(got, decode_attention_reference(q, k, v, slots, lengths))
    # CPU tensors run the reference, the table included
    torch.testing.assert_close(decode_attention(q.half(), k_pages.half(), v_pages.half(), slots, lengths,
                                                block_table=table), got.half(), rtol=1e-2, atol=1e-2)


def test_cpu_tensors_run_the_reference_into_out():
    gen = torch.Generator().manual_seed(1)
    q, k, v, slots, lengths = decode_inputs(gen, [4, 9], 2, 2, 16, 12, torch.bfloat16, "cpu")
    out = torch.empty_like(q)
    assert decode_attention(q, k, v, slots, lengths, out=out) is out
    assert torch.equal(out, decode_attention_reference(q, k, v, slots, lengths))


@pytest.mark.parametrize("change,error", [
    (lambda a: {**a, "q": a["q"].float()}, TypeError),
    (lambda a: {**a, "q": a["q"][:, :3]}, ValueError),                 # heads not a multiple of kv_heads
    (lambda a: {**a, "k_cache": a["k_cache"][..., :8]}, ValueError),  # head_dim differs
    (lambda a: {**a, "lengths": a["lengths"][:1]}, TypeError),
    (lambda a: {**a, "lengths": a["lengths"].float()}, TypeError),
    (lambda a: {**a, "lengths": torch.tensor([13, 1])}, IndexError),  # past max_len
    (lambda a: {**a, "slots": torch.tensor([0, 4])}, IndexError),     # no slot 4
    (lambda a: {**a, "out": torch.empty(2, 4, 16)}, ValueError),      # wrong dtype
    (lambda a: {**a, "splits": 0}, ValueError),
    (lambda a: {**a, "min_split_keys": 0}, ValueError),
    (lambda a: {**a, "order": torch.tensor([1, 0]), "balance": False}, ValueError),  # an order unused
    (lambda a: {**a, "order": torch.tensor([0])}, TypeError),
    (lambda a: {**a, "order": torch.tensor([0.0, 1.0])}, TypeError),
    (lambda a: {**a, "order": torch.tensor([1, 1])}, IndexError),    # not a permutation
    (lambda a: {**a, "order": torch.tensor([1, 2])}, IndexError),
    (lambda a: {**a, "block_table": torch.tensor([0, 1])}, TypeError),             # not [requests, blocks]
    (lambda a: {**a, "block_table": torch.tensor([[0], [9]])}, IndexError),        # no block 9
    (lambda a: {**a, "block_table": torch.zeros(1, 1, dtype=torch.int64)}, IndexError),  # slot 1 has no row
])
def test_rejects_bad_inputs(change, error):
    gen = torch.Generator().manual_seed(2)
    q, k, v, slots, lengths = decode_inputs(gen, [4, 9], 2, 2, 16, 12, torch.bfloat16, "cpu", spare_slots=2)
    args = {"q": q, "k_cache": k, "v_cache": v, "slots": slots, "lengths": lengths}
    with pytest.raises(error):
        decode_attention(**change(args))


def test_lpt_order_puts_the_longest_rows_first():
    lengths = torch.tensor([5, 0, 300, 17, 300, 1], dtype=torch.int32)
    order = lpt_order(lengths)
    assert sorted(order.tolist()) == list(range(6))
    assert lengths[order].tolist() == [300, 300, 17, 5, 1, 0]


def test_default_splits_fill_the_gpu_without_short_splits(monkeypatch):
    monkeypatch.setattr(module, "sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    budget = module.PROGRAMS_PER_SM * 132
    assert default_splits(4, 8, 8192, torch.device("cpu")) == 1
    for rows in (1, 3, 8, 16, 64, 256):
        for max_len in (100, 1024, 8192, 131072):
            splits = default_splits(rows, 8, max_len, cuda)
            assert splits & (splits - 1) == 0, "a power of two"
            assert splits == 1 or splits * module.MIN_KEYS_PER_SPLIT <= max_len
            assert splits == 1 or rows * 8 * splits <= budget, "no more programs than the budget"
            assert splits <= module.MAX_SPLITS
            doubled_fits = rows * 8 * splits * 2 <= budget and splits * 2 <= module.MAX_SPLITS
            assert not doubled_fits or splits * 2 * module.MIN_KEYS_PER_SPLIT > max_len, (rows, max_len, splits)
    # the H200 sweep's best: 4 programs per SM or just under it, not the next power of two past it
    assert [default_splits(r, 8, 8192, cuda) for r in (16, 32, 64, 128)] == [4, 2, 1, 1]
    # and short caches split into key blocks: one row at 512 and 2,048 keys, two at 512
    assert [default_splits(1, 8, 512, cuda), default_splits(1, 8, 2048, cuda), default_splits(2, 8, 512, cuda)] \
        == [8, 32, 8]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 32, 256])
@pytest.mark.parametrize("splits", [None, 1, 5, 32])
@pytest.mark.gpu
@needs_cuda
def test_llama_decode_shapes_gpu(rows, splits, dtype):
    gen = torch.Generator().manual_seed(rows * 31 + (splits or 0))
    lengths = torch.randint(1, 8193, (rows,), generator=gen)
    lengths[: min(rows, 4)] = torch.tensor([1, 8192, 0, 4097])[: min(rows, 4)]
    check_decode_attention(gen, lengths.tolist(), max_len=8192, dtype=dtype, splits=splits, device="cuda", **LLAMA)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("rows", [1, 32, 256])
@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.gpu
@needs_cuda
def test_llama_paged_decode_shapes_gpu(rows, splits, block_size):
    gen = torch.Generator().manual_seed(rows * 17 + block_size)
    lengths = torch.randint(1, 4097, (rows,), generator=gen)
    lengths[: min(rows, 3)] = torch.tensor([1, 4096, 0])[: min(rows, 3)]
    check_paged_decode_attention(gen, lengths.tolist(), max_len=4096, block_size=block_size, dtype=torch.bfloat16,
                                 splits=splits, device="cuda", **LLAMA)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("splits", [None, 1])
def test_cuda_graph_replays_for_new_lengths_gpu(splits):
    gen = torch.Generator().manual_seed(7)
    first = [100, 8192, 1, 3000, 17, 0, 512, 8000]
    q, k, v, slots, lengths = decode_inputs(gen, first, max_len=8192, dtype=torch.bfloat16, device="cuda", **LLAMA)
    # No key is poisoned: the replays' lengths differ from the ones the inputs were drawn for.
    k.normal_(generator=torch.Generator("cuda").manual_seed(8))
    v.normal_(generator=torch.Generator("cuda").manual_seed(9))
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        decode_attention(q, k, v, slots, lengths, out=out, splits=splits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k, v, slots, lengths, out=out, splits=splits)
    for new in (first, [8192, 1, 0, 5000, 64, 8191, 2, 300], [1] * 8, [8192] * 8):
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        q.normal_()
        graph.replay()
        assert_close(out, reference_output(q, k, v, slots, lengths), f"replay with lengths {new}")
