"""The Gated DeltaNet forms against the token-by-token reference, at tiny shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cdbench.harness.live.deltanet import (
    chunk_gated_delta_rule,
    decode_gated_delta_rule,
    expand_heads,
    l2_normalize,
    recurrent_gated_delta_rule,
)


def inputs(length: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(length, heads, dk, generator=gen))
    k = l2_normalize(torch.randn(length, heads, dk, generator=gen))
    v = torch.randn(length, heads, dv, generator=gen)
    g = -F.softplus(torch.randn(length, heads, generator=gen))  # log decay <= 0
    beta = torch.sigmoid(torch.randn(length, heads, generator=gen))
    state = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def test_recurrence_by_hand_one_token() -> None:
    q = torch.tensor([[[1.0, 0.0]]])
    k = torch.tensor([[[0.0, 1.0]]])
    v = torch.tensor([[[3.0]]])
    g, beta = torch.tensor([[0.0]]), torch.tensor([[0.5]])
    state = torch.tensor([[[2.0], [1.0]]])  # S^T k = 1
    out, s = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    # u = 0.5 * (3 - 1) = 1; S += k u^T -> [[2], [2]]; o = S^T q / sqrt(2) = 2 / sqrt(2)
    torch.testing.assert_close(s, torch.tensor([[[2.0], [2.0]]]))
    torch.testing.assert_close(out, torch.tensor([[[2.0 / 2**0.5]]]))


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (16, 4), (37, 16), (64, 64)])
def test_chunked_equals_recurrent(length: int, chunk: int) -> None:
    q, k, v, g, beta, state = inputs(length)
    want_o, want_s = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    got_o, got_s = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    torch.testing.assert_close(got_o, want_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_s, want_s, rtol=1e-4, atol=1e-4)


def test_chunked_continues_across_calls() -> None:
    q, k, v, g, beta, state = inputs(30)
    whole, end = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=8)
    first, mid = chunk_gated_delta_rule(q[:11], k[:11], v[:11], g[:11], beta[:11], state, chunk=8)
    second, end2 = chunk_gated_delta_rule(q[11:], k[11:], v[11:], g[11:], beta[11:], mid, chunk=8)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(end2, end, rtol=1e-4, atol=1e-4)


def test_decode_rows_each_step_their_own_state() -> None:
    rows = [inputs(1, seed=s) for s in range(4)]
    q, k, v, g, beta = (torch.cat([r[i] for r in rows]) for i in range(5))
    states = torch.stack([r[5] for r in rows])
    out, new = decode_gated_delta_rule(q, k, v, g, beta, states)
    for i, r in enumerate(rows):
        want_o, want_s = recurrent_gated_delta_rule(*r)
        torch.testing.assert_close(out[i], want_o[0])
        torch.testing.assert_close(new[i], want_s)


def test_expand_heads_groups_value_heads() -> None:
    x = torch.arange(2 * 2 * 1, dtype=torch.float32).view(2, 2, 1)
    assert expand_heads(x, 4)[0, :, 0].tolist() == [0.0, 0.0, 1.0, 1.0]
