"""A mixture of experts' grouped GEMM as one Triton launch for every expert (vLLM's ``fused_moe`` layout).

A step's ``tokens x k`` (token, expert) pairs are sorted by expert and each
expert's pairs padded to a whole block of ``BLOCK_M`` rows
(:func:`align_pairs`, torch ops on the device, no host synchronization, so a
CUDA graph captures it); one program per (row block, column block) reads its
block's expert, gathers its pairs' input rows by index (no sorted copy of the
activations) and multiplies them by that expert's weights. Blocks past the
last expert's return at once, so the launch shape depends only on the pair
count (a graph serves any routing). Row ``p`` of the output is pair ``p``
(token ``p // k``'s ``p % k``-th expert), optionally scaled by its routing
weight, so the experts' outputs of a token sum over a reshape.

Examples
--------
>>> import torch
>>> ids = torch.tensor([[1, 0], [1, 2]])            # 2 tokens, k = 2, 3 experts
>>> order, experts = align_pairs(ids, 3, block_m=2)
>>> order.tolist()[:6], experts.tolist()[:3]        # expert 0: pair 1; expert 1: pairs 0, 2; expert 2: pair 3
([1, 4, 0, 2, 3, 4], [0, 1, 2])
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cdbench.kernels._launch import use_triton

BLOCK_M = 16  # pair rows a program: a decode step routes few pairs to each expert
BLOCK_N = 64
BLOCK_K = 64


def align_pairs(ids: torch.Tensor, n_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ``ids`` ``[tokens, k]`` sorted by expert, each expert's padded to ``block_m`` rows.

    Returns ``order`` (``[pairs + n_experts * (block_m - 1)]`` rounded up to ``block_m``: the pair of each
    sorted row; padding rows hold ``pairs``, which is no pair) and ``experts`` (each row block's expert;
    ``n_experts`` for blocks past the last expert's). Shapes depend only on ``ids``' shape.
    """
    flat = ids.reshape(-1)
    pairs = flat.shape[0]
    rows = -(-(pairs + n_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    sorted_experts, pair_of = flat.sort(stable=True)
    first_sorted = counts.cumsum(0) - counts  # each expert's first place among the sorted pairs
    rank = torch.arange(pairs, device=ids.device) - first_sorted[sorted_experts]
    where = (ends - padded)[sorted_experts] + rank
    order = torch.full((rows,), pairs, dtype=torch.int64, device=ids.device).scatter_(0, where, pair_of)
    block_starts = torch.arange(0, rows, block_m, device=ids.device)
    experts = torch.searchsorted(ends, block_starts, right=True)
    return order, experts


@triton.jit
def _fused_moe(
    a_ptr, b_ptr, c_ptr, order_ptr, experts_ptr, weights_ptr, n_experts, pairs, a_div, n, k,
    a_row, b_expert, b_k, c_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WEIGHTED: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(experts_ptr + block).to(tl.int64)
    if expert >= n_experts:
        return
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(order_ptr + m)
    ok = pair < pairs
    a_rows = (pair // a_div).to(tl.int64)  # the input row of each pair: its token (a_div = k) or itself (1)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kk_ok = kk < k
        a = tl.load(a_ptr + a_rows[:, None] * a_row + kk[None, :], mask=ok[:, None] & kk_ok[None, :], other=0.0)
        b = tl.load(b_ptr + expert * b_expert + kk[:, None] * b_k + cols[None, :],
                    mask=kk_ok[:, None] & cols_ok[None, :], other=0.0)
        acc += tl.dot(a, b)
    if WEIGHTED:
        acc *= tl.load(weights_ptr + pair, mask=ok, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * c_row + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=ok[:, None] & cols_ok[None, :])


def fused_moe_gemm(a: torch.Tensor, w: torch.Tensor, order: torch.Tensor, experts: torch.Tensor, pairs: int,
                   per_token: int, weights: torch.Tensor | None = None, block_m: int = BLOCK_M) -> torch.Tensor:
    """Every pair's input row times its expert's weights, ``[pairs, n]``.

    ``a``: ``[pairs / per_token, k]`` (pair ``p`` reads row ``p // per_token``: the tokens with
    ``per_token`` = top-k, or the pairs' own rows with 1); ``w``: ``[experts, k, n]``; ``order``,
    ``experts``: :func:`align_pairs` of the routing at ``block_m``; ``weights``: optional ``[pairs]``
    routing weights the rows are scaled by. CPU tensors run the torch reference.
    """
    n_experts, k, n = w.shape
    if a.shape[1] != k or a.shape[0] * per_token != pairs or a.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError(f"a {tuple(a.shape)} (per_token {per_token}) and w {tuple(w.shape)} do not fit {pairs} pairs "
                         "(contiguous along their last dimension)")
    if order.shape[0] % block_m or experts.shape[0] != order.shape[0] // block_m:
        raise ValueError(f"order {tuple(order.shape)} and experts {tuple(experts.shape)} are not one block of "
                         f"{block_m} rows an expert entry")
    out = torch.empty((pairs, n), device=a.device, dtype=a.dtype)
    tensors = (a, w, order, experts) + (() if weights is None else (weights,))
    if not use_triton(*tensors):
        return fused_moe_reference(a, w, order, experts, pairs, per_token, weights, block_m, out)
    grid = (experts.shape[0], triton.cdiv(n, BLOCK_N))
    _fused_moe[grid](a, w, out, order, experts, weights if weights is not None else a, n_experts, pairs, per_token,
                     n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                     BLOCK_K=BLOCK_K, WEIGHTED=weights is not None, num_warps=4)
    return out


def fused_moe_reference(a, w, order, experts, pairs, per_token, weights, block_m, out) -> torch.Tensor:
    """:func:`fused_moe_gemm` in fp32 torch, block by block as the kernel walks them."""
    for block, expert in enumerate(experts.tolist()):
        if expert >= w.shape[0]:
            continue
        rows = order[block * block_m:(block + 1) * block_m]
        rows = rows[rows < pairs]
        y = a[rows // per_token].float() @ w[expert].float()
        if weights is not None:
            y = y * weights[rows].float()[:, None]
        out[rows] = y.to(out.dtype)
    return out
