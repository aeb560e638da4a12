"""The fused residual add + RMSNorm and SiLU-and-multiply: their torch forms against the unfused ops the
live forward ran before, in-place writes, input checks, and the Triton kernels on a GPU (under the
interpreter: ``interpreted_cases.py``)."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.nn.functional as F

from cdbench.kernels import layer_ops
from cdbench.kernels.layer_ops import add_rms_norm, add_rms_norm_reference, silu_and_mul, silu_and_mul_reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_doc_examples():
    assert doctest.testmod(layer_ops).failed == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_rms_norm_is_the_unfused_add_then_norm_written_in_place(dtype):
    gen = torch.Generator().manual_seed(3)
    residual = torch.randn(5, 48, generator=gen).to(dtype)
    x = torch.randn(5, 48, generator=gen).to(dtype)
    weight = torch.rand(48, generator=gen).to(dtype)
    want_sum = residual + x
    want = F.rms_norm(want_sum, (48,), weight, 1e-6)
    out, stream = add_rms_norm(residual, weight, 1e-6, x)
    assert out is x and stream is residual, "both written in place"
    assert torch.equal(stream, want_sum) and torch.equal(out, want)


def test_add_rms_norm_without_x_only_normalizes():
    residual = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    before = residual.clone()
    out, stream = add_rms_norm(residual, torch.tensor([1.0, 2.0]), 0.0 + 1e-12)
    assert stream is residual and torch.equal(residual, before) and out is not residual
    rms = (12.5) ** 0.5
    torch.testing.assert_close(out[0], torch.tensor([3.0 / rms, 8.0 / rms]))
    assert torch.equal(out[1], torch.zeros(2))


def test_silu_and_mul_is_the_unfused_silu_times_up():
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(3, 20, generator=gen)
    gate, up = gate_up[:, :10], gate_up[:, 10:]
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("call,error", [
    (lambda: add_rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6, torch.ones(2, 3)), "x must be contiguous"),
    (lambda: add_rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6, torch.ones(2, 4, dtype=torch.float16)),
     "x must be contiguous"),
    (lambda: add_rms_norm(torch.ones(4, 2).t(), torch.ones(4), 1e-6), "residual must be a contiguous"),
    (lambda: add_rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6), r"weight must be \[4\]"),
    (lambda: add_rms_norm(torch.ones(4), torch.ones(4), 1e-6), "residual must be a contiguous"),
    (lambda: silu_and_mul(torch.ones(2, 5)), "must be even"),
    (lambda: silu_and_mul(torch.ones(6)), "gate_up must be a contiguous"),
])
def test_rejects_bad_inputs(call, error):
    with pytest.raises(ValueError, match=error):
        call()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens,hidden", [(1, 4096), (3, 5120), (7, 100), (0, 64)])
def test_gpu_kernels_match_the_torch_forms(dtype, tokens, hidden):
    gen = torch.Generator("cuda").manual_seed(tokens + hidden)
    residual = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=gen)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=gen)
    weight = torch.rand(hidden, device="cuda", dtype=dtype, generator=gen)
    out, stream = add_rms_norm(residual.clone(), weight, 1e-6, x.clone())
    want_out, want_stream = add_rms_norm_reference(residual.clone(), weight, 1e-6, x.clone())
    assert torch.equal(stream, want_stream)
    torch.testing.assert_close(out, want_out)
    gate_up = torch.randn(tokens, 2 * hidden, device="cuda", dtype=dtype, generator=gen)
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up))
