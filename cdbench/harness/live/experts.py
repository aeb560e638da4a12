"""A mixture-of-experts FFN as grouped GEMMs: route, sort tokens by expert, one grouped matmul, scatter back.

Routing is the Qwen3 MoE router's: a softmax over the experts' logits, the top
``k``, their weights renormalized to sum to 1 (``norm_topk_prob``). The routed
experts then run as engines run them: the ``tokens x k`` (token, expert) pairs
are sorted by expert, so each expert's tokens are one contiguous block; the
experts' gated SiLU MLPs are two grouped matrix multiplications over those
blocks (``torch.nn.functional.grouped_mm``: one kernel for all experts, block
boundaries read from a device tensor, so a CUDA graph can capture it), the
SiLU-and-multiply between them one launch (:func:`~cdbench.kernels.layer_ops.silu_and_mul`); each
pair's output, weighted, is added back into its token's row. A shared expert
(Qwen3-Next, Qwen3.5) is a dense gated MLP every token passes through, scaled
by a sigmoid gate of the token.

Expert weights are stacked ``[experts, hidden, 2 * width]`` (gate and up) and
``[experts, width, hidden]`` (down); ``grouped_mm`` wants bf16.

:func:`fused_experts` is the same FFN as vLLM's ``fused_moe`` runs it
(:mod:`cdbench.kernels.fused_moe`): the pairs aligned to blocks by expert, each
GEMM one Triton launch that gathers its input rows by index, the routing
weights applied in the second, the ``k`` outputs of a token summed over a
reshape: no sorted copy of the activations and no scatter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cdbench.kernels.fused_moe import align_pairs, fused_moe_gemm
from cdbench.kernels.layer_ops import silu_and_mul


def route(x: torch.Tensor, router: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``k`` experts and their weights: ``([tokens, k] float32, [tokens, k] int64)``."""
    probs = torch.softmax((x @ router).float(), dim=-1)
    weights, ids = probs.topk(k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum for each token of ``x`` ``[tokens, hidden]``."""
    tokens, k = ids.shape
    n_experts = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    token_of = order // k  # which token each sorted pair belongs to
    # counted by a scatter, not bincount: CUDA's bincount reads the largest id back to the host,
    # which a CUDA graph's capture forbids
    counts = torch.zeros(n_experts, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0).to(torch.int32)
    y = F.grouped_mm(silu_and_mul(F.grouped_mm(x[token_of], gate_up, offs=ends)), down, offs=ends)
    y = y * weights.reshape(-1)[order].to(y.dtype)[:, None]
    return torch.zeros_like(x).index_add_(0, token_of, y)


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_experts` through the fused kernels (the module doc)."""
    tokens, k = ids.shape
    pairs = tokens * k
    order, experts = align_pairs(ids, gate_up.shape[0])
    hidden = silu_and_mul(fused_moe_gemm(x, gate_up, order, experts, pairs, k))
    y = fused_moe_gemm(hidden, down, order, experts, pairs, 1, weights.reshape(-1))
    return y.view(tokens, k, -1).sum(1)


def shared_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The shared expert's gated MLP, scaled per token by ``sigmoid(x @ gate)``."""
    return torch.sigmoid(x @ gate) * (silu_and_mul(x @ gate_up) @ down)
