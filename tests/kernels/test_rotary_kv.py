"""The fused rotary + KV-write kernel: the reference against the live forward's unfused torch path, input
checks, the Triton kernel on a GPU (under the interpreter: ``interpreted_cases.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rotary_kv_cases import check_rotary_kv, rotary_kv_inputs

from cdbench.kernels.reference import rotary_kv_reference
from cdbench.kernels.rotary_kv import rotary_kv_write

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_reference_is_the_unfused_norm_rotary_and_cache_copy():
    # The torch path the forward ran before the fusion: rms_norm per head, rotate-half, index copies.
    gen = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, d, block = 6, 4, 2, 16, 4
    _, q, k, v, cos, sin, k_cache, v_cache, where, (qn, kn) = rotary_kv_inputs(gen, tokens, heads, kv_heads, d,
                                                                              block, True, torch.float32, "cpu")

    def rotate(x, w):
        x = F.rms_norm(x, (d,), w, 1e-6)
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]], dim=-1)

    want_q, want_k, want_v = rotate(q, qn), rotate(k, kn), v.clone()
    rotary_kv_reference(q, k, v, cos, sin, k_cache, v_cache, where, qn, kn)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    for t in range(tokens):
        at = int(where[t])
        if at < 0:
            continue
        torch.testing.assert_close(k_cache[at // block, :, at % block], want_k[t])
        torch.testing.assert_close(v_cache[at // block, :, at % block], want_v[t])
    assert int((~k_cache.isnan()).any(-1).sum()) == (tokens - 1) * kv_heads


def test_cpu_tensors_run_the_reference():
    check_rotary_kv(torch.Generator().manual_seed(6), 5, 4, 2, 16, 4, True, torch.bfloat16, "cpu")


@pytest.mark.parametrize("change,error", [
    (lambda a: {**a, "cos": a["cos"][:, :3]}, ValueError),
    (lambda a: {**a, "k": a["k"][:, :1]}, ValueError),                      # v differs from k
    (lambda a: {**a, "where": a["where"].float()}, TypeError),
    (lambda a: {**a, "where": torch.tensor([0, 1, 99])}, IndexError),     # past the cache
    (lambda a: {**a, "q_norm": torch.ones(16)}, ValueError),              # k_norm missing
    (lambda a: {**a, "k_cache": a["k_cache"][:, :1]}, ValueError),
])
def test_rejects_bad_inputs(change, error):
    _, q, k, v, cos, sin, k_cache, v_cache, where, _ = rotary_kv_inputs(torch.Generator().manual_seed(7), 3, 2, 2,
                                                                         16, 4, False, torch.float32, "cpu")
    args = {"q": q, "k": k, "v": v, "cos": cos, "sin": sin, "k_cache": k_cache, "v_cache": v_cache, "where": where}
    with pytest.raises(error):
        rotary_kv_write(**change(args))


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.gpu
@needs_cuda
def test_llama_and_qwen3_shapes_gpu(norm, block_size):
    check_rotary_kv(torch.Generator().manual_seed(8), 300, 32, 8, 128, block_size, norm, torch.bfloat16, "cuda")
