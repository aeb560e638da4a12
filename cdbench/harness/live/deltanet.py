"""The Gated DeltaNet recurrence of a hybrid model's linear-attention layers, in torch.

Per value head a state matrix ``S`` (``d_k x d_v``) carries the sequence. Each
token decays it by ``exp(g)``, corrects it toward the token's value along the
token's key with strength ``beta`` (the delta rule), and reads it with the query
(Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025; the semantics of
flash-linear-attention's ``fused_recurrent_gated_delta_rule``)::

    S  <- exp(g) * S
    u   = beta * (v - S^T k)
    S  <- S + k u^T
    o   = S^T (q / sqrt(d_k))

Three forms of the same function:

- :func:`recurrent_gated_delta_rule`: token by token, the reference;
- :func:`chunk_gated_delta_rule`: the chunked form a prefill runs (fla's
  ``chunk_gated_delta_rule``): within a chunk of ``C`` tokens the corrections
  ``u`` solve one unit lower-triangular system (the WY form), and the state
  crosses the chunk in three matrix products, so the work is matrix
  multiplication rather than ``C`` dependent steps;
- :func:`decode_gated_delta_rule`: one token for each of a batch of rows, each
  with its own state (a decode step).

Queries and keys come normalized (unit L2 norm per head, as the Qwen3-Next and
Qwen3.5 layers normalize them) and already expanded to the value heads (value
head ``i`` reads key head ``i // (value_heads / key_heads)``: :func:`expand_heads`).
The state is float32 throughout; ``g`` is the per-token log decay (``<= 0``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

NORM_EPS = 1e-6


def fla_kernels() -> tuple[Callable, Callable] | None:
    """flash-linear-attention's ``(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)``, or ``None``.

    The ``flash-linear-attention`` package (0.6.0 installs from PyPI beside torch 2.13 with
    ``fla-core`` and ``einops``, leaving torch alone) is Triton kernels; importing it needs a GPU
    driver, so on a machine without one (and where it is not installed) this is ``None`` and the
    torch forms above run.
    """
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except (ImportError, RuntimeError):  # not installed; or Triton finds no GPU driver
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def expand_heads(x: torch.Tensor, value_heads: int) -> torch.Tensor:
    """``[tokens, key_heads, d]`` -> ``[tokens, value_heads, d]``: each key head serves a run of value heads."""
    return x.repeat_interleave(value_heads // x.shape[1], dim=1)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """Unit L2 norm over the last dimension (float32)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + NORM_EPS)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. ``q, k``: ``[T, H, d_k]``; ``v``: ``[T, H, d_v]``; ``g, beta``: ``[T, H]``;
    ``state``: ``[H, d_k, d_v]``. Returns the outputs ``[T, H, d_v]`` and the final state."""
    scale = q.shape[-1] ** -0.5
    s = state.float().clone()
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].float().exp()[:, None, None]
        u = beta[t].float()[:, None] * (v[t].float() - torch.einsum("hk,hkv->hv", k[t].float(), s))
        s = s + k[t].float()[:, :, None] * u[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t].float() * scale, s))
    return torch.stack(out), s


def decode_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, each row its own state. ``q, k``: ``[R, H, d_k]``; ``v``: ``[R, H, d_v]``;
    ``g, beta``: ``[R, H]``; ``states``: ``[R, H, d_k, d_v]``. Returns ``[R, H, d_v]`` and the new states."""
    scale = q.shape[-1] ** -0.5
    s = states.float() * g.float().exp()[:, :, None, None]
    u = beta.float()[:, :, None] * (v.float() - torch.einsum("rhk,rhkv->rhv", k.float(), s))
    s = s + k.float()[:, :, :, None] * u[:, :, None, :]
    return torch.einsum("rhk,rhkv->rhv", q.float() * scale, s), s


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form over one sequence (shapes as :func:`recurrent_gated_delta_rule`).

    Within a chunk, with ``G`` the cumulative log decay from its start and ``S0`` the
    state entering it, token ``i``'s correction is
    ``u_i = beta_i (v_i - e^{G_i} S0^T k_i - sum_{j<i} e^{G_i - G_j} (k_i . k_j) u_j)``,
    i.e. ``(I + M) u = beta v - (beta e^G k) S0`` with ``M`` strictly lower triangular;
    so ``u = U - W S0`` where ``U`` and ``W`` solve that system once per chunk. Then
    ``o_i = e^{G_i} S0^T q_i + sum_{j<=i} e^{G_i - G_j} (q_i . k_j) u_j`` and the state
    leaving the chunk is ``e^{G_C} S0 + sum_j e^{G_C - G_j} k_j u_j^T``.
    """
    length, heads, dk = q.shape
    dv = v.shape[-1]
    pad = -length % chunk
    n = (length + pad) // chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, n, C, ...]; padding: no decay, no update
        x = F.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.view(n, chunk, heads, *x.shape[2:]).movedim(2, 0)

    qc, kc, vc = blocks(q) * dk**-0.5, blocks(k), blocks(v)
    gc, bc = blocks(g[..., None])[..., 0], blocks(beta[..., None])[..., 0]
    cum = gc.cumsum(-1)  # [H, n, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # e^{G_i - G_j} for j <= i, 0 above the diagonal (masked before exp: no overflow)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    m = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
    system = m + torch.eye(chunk, device=q.device)
    u0 = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, (bc * cum.exp())[..., None] * kc, upper=False, unitriangular=True)
    scores = (qc @ kc.transpose(-1, -2)) * decay  # [H, n, C, C], causal with the decay
    to_end = (cum[..., -1:] - cum).exp()  # e^{G_C - G_j}
    s = state.float()
    out = torch.empty(heads, n, chunk, dv, device=q.device)
    for c in range(n):
        u = u0[:, c] - w[:, c] @ s
        out[:, c] = cum[:, c].exp()[..., None] * (qc[:, c] @ s) + scores[:, c] @ u
        s = cum[:, c, -1].exp()[:, None, None] * s + (kc[:, c] * to_end[:, c, :, None]).transpose(-1, -2) @ u
    return out.movedim(0, 2).reshape(n * chunk, heads, dv)[:length], s
