"""A transformer layer's small per-token operations, each one launch: the residual add fused with RMSNorm,
and SiLU-and-multiply.

At a decode step of a few rows these are latency, not bandwidth: on an H200 torch's ``F.rms_norm`` of one
4,096-wide row takes 5.8 µs (one block on one SM) and the residual add beside it another 1.2 µs, 65 and 64
times in a Llama-3.1-8B step, 0.45 ms of its 5.2 (``benchmarks/live_step_kernels.py``,
``reports/calibration/README.md``). Engines fuse them (vLLM's ``fused_add_rms_norm`` and ``silu_and_mul``
ops, SGLang's likewise); so does the live forward, with these kernels:

- :func:`add_rms_norm`: ``residual += x`` then ``x = rms_norm(residual) * weight``, both in place (a row's
  sum of squares in fp32), as vLLM's op does; without ``x`` it normalizes ``residual`` into a new tensor;
- :func:`silu_and_mul`: ``silu(a) * b`` for ``[a | b]`` halves of the last dimension.

CPU tensors run the torch forms (:func:`add_rms_norm_reference`, :func:`silu_and_mul_reference`) unless
``TRITON_INTERPRET=1``; a launch's shape depends only on the tensors' shapes (CUDA graphs capture it).

Examples
--------
>>> import torch
>>> residual, x = torch.ones(1, 4), torch.full((1, 4), 2.0)
>>> out, residual = add_rms_norm(residual, torch.ones(4), 1e-6, x)
>>> residual.tolist(), [round(v, 4) for v in out[0].tolist()]
([[3.0, 3.0, 3.0, 3.0]], [1.0, 1.0, 1.0, 1.0])
>>> [round(v, 4) for v in silu_and_mul(torch.tensor([[0.0, 1.0, 5.0, 5.0]]))[0].tolist()]  # silu(0), silu(1), * 5
[0.0, 3.6553]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cdbench.kernels._launch import use_triton

#: Columns a SiLU-and-multiply program covers: a decode row's 14,336-wide half in 14 programs.
SILU_BLOCK = 1024


def add_rms_norm_reference(residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           x: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form of :func:`add_rms_norm`, with the same in-place writes."""
    if x is None:
        return F.rms_norm(residual, (residual.shape[-1],), weight, eps), residual
    residual += x
    x.copy_(F.rms_norm(residual, (residual.shape[-1],), weight, eps))
    return x, residual


def add_rms_norm(residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 x: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x) * weight, residual + x)``, rows of the last dimension.

    With ``x`` (a sublayer's output, the shape and dtype of ``residual``) both are written in place:
    ``residual`` becomes the sum, ``x`` its normalized form, and the two are returned. Without it,
    ``residual`` is only normalized, into a new tensor. Both contiguous ``[tokens, hidden]``;
    ``weight`` ``[hidden]``.
    """
    _check_rows(residual, "residual")
    if x is not None and (x.shape != residual.shape or x.dtype != residual.dtype or not x.is_contiguous()):
        raise ValueError(f"x must be contiguous and match residual {tuple(residual.shape)} {residual.dtype}, "
                         f"got {tuple(x.shape)} {x.dtype}")
    if weight.shape != (residual.shape[-1],):
        raise ValueError(f"weight must be [{residual.shape[-1]}], got {tuple(weight.shape)}")
    if not use_triton(residual, weight, *(() if x is None else (x,))):
        return add_rms_norm_reference(residual, weight, eps, x)
    tokens, hidden = residual.shape
    out = torch.empty_like(residual) if x is None else x
    if tokens:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm[(tokens,)](out, residual, weight, hidden, eps, ADD=x is not None, BLOCK=block,
                                 num_warps=_warps(block))
    return out, residual


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` = ``[gate | up]``: ``[tokens, width]``."""
    _check_rows(gate_up, "gate_up")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even, got {gate_up.shape[-1]}")
    if not use_triton(gate_up):
        return silu_and_mul_reference(gate_up)
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, width, device=gate_up.device, dtype=gate_up.dtype)
    if tokens and width:
        block = min(SILU_BLOCK, triton.next_power_of_2(width))
        _silu_and_mul[(tokens, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block,
                                                          num_warps=_warps(block))
    return out


def _check_rows(t: torch.Tensor, what: str) -> None:
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous [tokens, width] tensor, got shape {tuple(t.shape)}")


def _warps(block: int) -> int:
    """Enough warps for about eight elements a thread in one pass (four at the least, sixteen at most)."""
    return max(4, min(16, block // 256))


@triton.jit
def _add_rms_norm(out_ptr, res_ptr, w_ptr, hidden, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * hidden
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    r = tl.load(res_ptr + row + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        r += tl.load(out_ptr + row + cols, mask=ok, other=0.0).to(tl.float32)
        # the sum rounded to the residual's dtype, as an unfused add would store it, and normalized from there
        r = r.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row + cols, r, mask=ok)
        r = r.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + cols, (r * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_and_mul(in_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(in_ptr + row * 2 * width + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * 2 * width + width + cols, mask=ok, other=0.0).to(tl.float32)
    # silu in fp32, rounded to the input's dtype before the product, as torch's two ops round it
    act = (gate / (1.0 + tl.exp(-gate))).to(in_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)
