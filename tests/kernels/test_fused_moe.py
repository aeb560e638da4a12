"""The fused MoE GEMM: the pairs' alignment, its reference against a per-pair loop, the Triton kernel on a GPU
against torch's grouped GEMMs (under the interpreter: ``interpreted_cases.py``)."""

from __future__ import annotations

import pytest
import torch

from cdbench.kernels.fused_moe import align_pairs, fused_moe_gemm


def test_pairs_are_sorted_by_expert_in_whole_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]])
    order, experts = align_pairs(ids, 5, block_m=2)
    pairs = ids.numel()
    assert order.shape[0] % 2 == 0 and experts.shape[0] == order.shape[0] // 2
    for block, expert in enumerate(experts.tolist()):
        rows = order[2 * block:2 * block + 2]
        real = rows[rows < pairs]
        if expert >= 5:
            assert real.numel() == 0
        else:
            assert (ids.reshape(-1)[real] == expert).all()
    assert sorted(order[order < pairs].tolist()) == list(range(pairs))  # every pair once
    # expert 3's 4 pairs take 2 blocks, expert 4 none; the blocks after the last expert's are marked 5
    assert experts.tolist() == [0, 1, 2, 3, 3] + [5] * (len(experts) - 5)


def test_the_reference_is_each_pairs_expert_product():
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([[2, 0], [1, 2], [2, 1]])
    a = torch.randn(3, 8, generator=gen)
    w = torch.randn(3, 8, 4, generator=gen)
    weights = torch.rand(6, generator=gen)
    order, experts = align_pairs(ids, 3)
    got = fused_moe_gemm(a, w, order, experts, 6, 2, weights)
    for p in range(6):
        torch.testing.assert_close(got[p], weights[p] * (a[p // 2] @ w[ids.reshape(-1)[p]]), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_fused_experts_match_grouped_experts_at_qwen3_30b_shapes_gpu(tokens):
    from cdbench.harness.live.experts import fused_experts, grouped_experts, route

    gen = torch.Generator("cuda").manual_seed(tokens)
    h, w, e, k = 2048, 768, 128, 8
    x = torch.randn(tokens, h, device="cuda", generator=gen).bfloat16()
    router = (torch.randn(h, e, device="cuda", generator=gen) * 0.02).bfloat16()
    gate_up = (torch.randn(e, h, 2 * w, device="cuda", generator=gen) * 0.02).bfloat16()
    down = (torch.randn(e, w, h, device="cuda", generator=gen) * 0.02).bfloat16()
    weights, ids = route(x, router, k)
    torch.testing.assert_close(fused_experts(x, weights, ids, gate_up, down).float(),
                               grouped_experts(x, weights, ids, gate_up, down).float(), rtol=3e-2, atol=3e-2)
