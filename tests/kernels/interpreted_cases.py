"""Triton kernels vs torch references under ``TRITON_INTERPRET=1`` at tiny shapes.

Not collected directly (no ``test_`` prefix): ``test_kernels_interpreted.py``
runs this file in a subprocess, because the variable must be set before Triton
is imported and must not leak into other tests' processes.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import (
    DTYPES,
    MODES,
    check_apply_bitmask,
    check_apply_bool_mask,
    check_masked_argmax,
    check_set_token_filter,
)
from rotary_kv_cases import check_rotary_kv

from cdbench.kernels.fused_moe import align_pairs, fused_moe_gemm, fused_moe_reference
from cdbench.kernels.layer_ops import add_rms_norm, add_rms_norm_reference, silu_and_mul, silu_and_mul_reference

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_kernels_interpreted.py"

FAST = settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@FAST
@given(
    n_rows=st.integers(1, 4), vocab=st.integers(1, 300), pad=st.sampled_from([0, 0, 7, 40]),
    dtype=st.sampled_from(DTYPES), allowed=st.sampled_from([0.0, 0.05, 0.5, 0.95, 1.0]),
    mode=st.sampled_from(MODES), with_indices=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
def test_apply_bitmask_matches_reference(n_rows, vocab, pad, dtype, allowed, mode, with_indices, seed):
    gen = torch.Generator().manual_seed(seed)
    check_apply_bitmask(gen, n_rows, vocab, vocab + pad, dtype, allowed, mode, "cpu", with_indices)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_bitmask_edge_shapes(mode, dtype):
    gen = torch.Generator().manual_seed(1)
    for n_rows, vocab, n_cols in ((1, 33, 33), (3, 64, 64), (4, 100, 160), (2, 31, 31)):
        check_apply_bitmask(gen, n_rows, vocab, n_cols, dtype, 0.1, mode, "cpu", False)
        check_apply_bitmask(gen, n_rows, vocab, n_cols, dtype, 0.9, mode, "cpu", True)


@FAST
@given(
    n_rows=st.integers(1, 4), vocab=st.integers(1, 300), pad=st.sampled_from([0, 5]),
    dtype=st.sampled_from(DTYPES), allowed=st.sampled_from([0.0, 0.3, 1.0]), with_indices=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_apply_bool_mask_matches_reference(n_rows, vocab, pad, dtype, allowed, with_indices, seed):
    gen = torch.Generator().manual_seed(seed)
    check_apply_bool_mask(gen, n_rows, vocab, vocab + pad, dtype, allowed, "cpu", with_indices)


@FAST
@given(
    n_rows=st.integers(1, 4), vocab=st.integers(1, 300), n_tokens=st.integers(0, 40),
    allowed=st.booleans(), reset=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
def test_set_token_filter_matches_reference(n_rows, vocab, n_tokens, allowed, reset, seed):
    gen = torch.Generator().manual_seed(seed)
    check_set_token_filter(gen, n_rows, vocab, n_tokens, allowed, reset, "cpu")


@FAST
@given(
    n_rows=st.integers(1, 4), vocab=st.integers(1, 300), pad=st.sampled_from([0, 9]),
    dtype=st.sampled_from(DTYPES), allowed=st.sampled_from([0.0, 0.05, 0.6]),
    temperature=st.sampled_from([None, 0.5, 1.0, 2.0]), with_indices=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
def test_masked_argmax_matches_reference(n_rows, vocab, pad, dtype, allowed, temperature, with_indices, seed):
    gen = torch.Generator().manual_seed(seed)
    check_masked_argmax(gen, n_rows, vocab, vocab + pad, dtype, allowed, temperature, "cpu", with_indices)


@pytest.mark.parametrize("dtype,n_rows", [(torch.float32, 4), (torch.bfloat16, 8)])
def test_auto_mode_large_launch_matches_reference(dtype, n_rows):
    # 1 MiB of logits: "auto" takes its large-launch path (adaptive for fp32, skip for bf16).
    gen = torch.Generator().manual_seed(5)
    for allowed in (0.05, 0.97):
        check_apply_bitmask(gen, n_rows, 65536, 65536, dtype, allowed, "auto", "cpu", False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (3, 100), (0, 16), (2, 1)])
def test_add_rms_norm_matches_reference(dtype, tokens, hidden):
    gen = torch.Generator().manual_seed(tokens * 131 + hidden)
    residual, x = (torch.randn(tokens, hidden, generator=gen).to(dtype) for _ in range(2))
    weight = torch.rand(hidden, generator=gen).to(dtype)
    out, stream = add_rms_norm(residual.clone(), weight, 1e-6, x.clone())
    want_out, want_stream = add_rms_norm_reference(residual.clone(), weight, 1e-6, x.clone())
    assert torch.equal(stream, want_stream)
    torch.testing.assert_close(out, want_out)
    alone, _ = add_rms_norm(residual, weight, 1e-6)
    torch.testing.assert_close(alone, add_rms_norm_reference(residual.clone(), weight, 1e-6)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("tokens,width", [(1, 1), (2, 1500), (0, 8), (3, 1024)])
def test_silu_and_mul_matches_reference(dtype, tokens, width):
    gate_up = torch.randn(tokens, 2 * width, generator=torch.Generator().manual_seed(width)).to(dtype)
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 2, 16, 4), (3, 1, 24, 16), (2, 2, 8, 1)])
def test_rotary_kv_matches_reference(heads, kv_heads, head_dim, block_size, norm, dtype):
    check_rotary_kv(torch.Generator().manual_seed(heads * head_dim + norm), 7, heads, kv_heads, head_dim, block_size,
                    norm, dtype, "cpu")


# float16: the interpreter's ``tl.dot`` does not take bfloat16
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
