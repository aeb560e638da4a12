"""The fused MoE GEMM vs its torch reference under ``TRITON_INTERPRET=1``, at tiny shapes.

Not collected directly: ``test_fused_moe.py`` runs this file in a subprocess. float16 (the interpreter's
``tl.dot`` does not take bfloat16).
"""

from __future__ import annotations

import os

import pytest
import torch

from cdbench.kernels.fused_moe import align_pairs, fused_moe_gemm, fused_moe_reference

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_fused_moe.py"


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("tokens,k,experts,hidden,width", [(1, 2, 5, 32, 80), (7, 3, 4, 70, 24), (20, 2, 6, 16, 16)])
def test_fused_moe_gemm_matches_reference(tokens, k, experts, hidden, width, weighted):
    gen = torch.Generator().manual_seed(tokens * 100 + k)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    a = torch.randn(tokens, hidden, generator=gen).half()
    w = torch.randn(experts, hidden, width, generator=gen).half() * 0.2
    weights = torch.rand(tokens * k, generator=gen).half() if weighted else None
    order, blocks = align_pairs(ids, experts)
    got = fused_moe_gemm(a, w, order, blocks, tokens * k, k, weights)
    want = fused_moe_reference(a, w, order, blocks, tokens * k, k, weights, 16, torch.empty_like(got))
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
