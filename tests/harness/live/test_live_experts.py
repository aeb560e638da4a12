"""Grouped expert GEMMs against a per-token loop over the routed experts, at tiny shapes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cdbench.harness.live.experts import grouped_experts, route, shared_expert

H, W, E, K = 16, 8, 6, 2  # grouped_mm wants 16-byte rows: multiples of 8 bf16


def weights(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    bf = lambda *s: (torch.randn(*s, generator=gen) * 0.5).to(torch.bfloat16)  # noqa: E731
    return bf(H, E), bf(E, H, 2 * W), bf(E, W, H)


def reference(x, router, gate_up, down):
    """Token by token: softmax, top-k, renormalize, each chosen expert's MLP, weighted sum (float32)."""
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t].float() @ router.float(), -1)
        top = probs.topk(K)
        for w, e in zip(top.values / top.values.sum(), top.indices):
            g, u = (x[t].float() @ gate_up[e].float()).chunk(2)
            out[t] += w * ((F.silu(g) * u) @ down[e].float())
    return out


def test_route_renormalizes_top_k() -> None:
    router = torch.zeros(2, 3)
    router[0] = torch.tensor([0.0, 2.0, 1.0])
    w, ids = route(torch.tensor([[1.0, 0.0]]), router, 2)
    assert ids.tolist() == [[1, 2]]
    e = torch.exp(torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(w, (e / e.sum())[None])


def test_grouped_experts_match_the_per_token_loop() -> None:
    router, gate_up, down = weights()
    x = torch.randn(13, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w, ids = route(x, router, K)
    got = grouped_experts(x, w, ids, gate_up, down).float()
    torch.testing.assert_close(got, reference(x, router, gate_up, down), rtol=3e-2, atol=3e-2)


def test_experts_nobody_routes_to_are_skipped() -> None:
    _, gate_up, down = weights()
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ids = torch.tensor([[5, 0]] * 4)  # experts 1..4 get no token
    w = torch.tensor([[0.75, 0.25]] * 4)
    want = torch.zeros(4, H)
    for e, share in ((5, 0.75), (0, 0.25)):
        g, u = (x.float() @ gate_up[e].float()).chunk(2, -1)
        want += share * ((F.silu(g) * u) @ down[e].float())
    torch.testing.assert_close(grouped_experts(x, w, ids, gate_up, down).float(), want, rtol=3e-2, atol=3e-2)


def test_shared_expert_is_gated_per_token() -> None:
    _, gate_up, down = weights()
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    gate = torch.zeros(H, 1, dtype=torch.bfloat16)  # sigmoid(0) = 1/2
    g, u = (x.float() @ gate_up[0].float()).chunk(2, -1)
    want = 0.5 * ((F.silu(g) * u) @ down[0].float())
    torch.testing.assert_close(shared_expert(x, gate_up[0], down[0], gate).float(), want, rtol=3e-2, atol=3e-2)


def test_fused_experts_match_the_per_token_loop() -> None:
    from cdbench.harness.live.experts import fused_experts

    router, gate_up, down = weights()
    x = torch.randn(13, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w, ids = route(x, router, K)
    got = fused_experts(x, w, ids, gate_up, down).float()
    torch.testing.assert_close(got, reference(x, router, gate_up, down), rtol=3e-2, atol=3e-2)
