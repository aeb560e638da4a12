"""Torch references (the kernels' oracle) against independent numpy definitions, and input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cdbench.kernels import (
    apply_bitmask,
    apply_bool_mask,
    masked_argmax,
    reference,
    set_token_filter,
)


def _numpy_allowed(bitmask: torch.Tensor, n_cols: int) -> np.ndarray:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little").reshape(bitmask.shape[0], -1)
    out = np.zeros((bitmask.shape[0], n_cols), dtype=bool)
    width = min(n_cols, bits.shape[1])
    out[:, :width] = bits[:, :width].astype(bool)
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 200), st.integers(0, 40), st.integers(0, 2**32 - 1))
def test_pack_unpack_match_numpy(n_rows, vocab, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(n_rows, vocab, generator=gen) < 0.5
    packed = reference.pack_bitmask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (n_rows, (vocab + 31) // 32)
    assert np.array_equal(_numpy_allowed(packed, vocab + pad)[:, :vocab], allowed.numpy())
    assert torch.equal(reference.unpack_bitmask(packed, vocab + pad), torch.from_numpy(_numpy_allowed(packed, vocab + pad)))


def test_apply_bitmask_reference_masks_padding_and_keeps_other_rows():
    logits = torch.randn(3, 70)
    before = logits.clone()
    bitmask = torch.tensor([[-1, 0], [-1, -1], [1, 0]], dtype=torch.int32)  # 64 tokens covered
    apply_bitmask(logits, bitmask, indices=[0, 2])
    assert torch.equal(logits[1], before[1])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == list(range(32))
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [0]


def test_set_token_filter_reference_semantics():
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    set_token_filter(bitmask, [5, 5, 33], rows=[0, 1], allowed=False, vocab_size=40)
    allowed = reference.unpack_bitmask(bitmask, 64)
    expected = torch.zeros(64, dtype=torch.bool)
    expected[:40] = True
    expected[[5, 33]] = False
    assert torch.equal(allowed[0], expected) and torch.equal(allowed[1], expected)
    set_token_filter(bitmask, [7], rows=[1], allowed=True, reset=False)
    assert bool(reference.unpack_bitmask(bitmask, 64)[1, 7])


def test_masked_argmax_greedy_ties_and_empty_rows():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    bitmask = torch.tensor([[0b0111], [0]], dtype=torch.int32)
    assert masked_argmax(logits, bitmask).tolist() == [1, -1]


def test_gumbel_sampling_follows_the_masked_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0]])
    bitmask = torch.tensor([[0b01111]], dtype=torch.int32)  # token 4 disallowed
    draws = torch.stack([masked_argmax(logits, bitmask, temperature=1.5, seed=11, offset=i) for i in range(3000)])
    counts = torch.bincount(draws.flatten(), minlength=5).float() / draws.numel()
    expected = torch.softmax(logits[0, :4] / 1.5, dim=0)
    assert counts[4] == 0
    assert torch.allclose(counts[:4], expected, atol=0.03)
    again = masked_argmax(logits, bitmask, temperature=1.5, seed=11, offset=7)
    assert torch.equal(again, draws[7])  # same (seed, offset): same draw


@pytest.mark.parametrize("call,match", [
    (lambda: apply_bitmask(torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int64)), "int32"),
    (lambda: apply_bitmask(torch.zeros(2, 8), torch.zeros(3, 1, dtype=torch.int32)), "3 rows"),
    (lambda: apply_bitmask(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32)), "float32"),
    (lambda: apply_bitmask(torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int32), indices=[2]), r"indices contains 2"),
    (lambda: apply_bitmask(torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int32), mode="fast"), "unknown mode"),
    (lambda: apply_bool_mask(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.uint8)), "bool"),
    (lambda: set_token_filter(torch.zeros(2, 1, dtype=torch.int32), [32], rows=[0]), r"token_ids contains 32"),
    (lambda: set_token_filter(torch.zeros(2, 1, dtype=torch.int32), [1], rows=[0], vocab_size=40), "vocab_size"),
    (lambda: masked_argmax(torch.zeros(1, 8), torch.zeros(1, 1, dtype=torch.int32), temperature=-1.0), ">= 0"),
])
def test_bad_input_names_the_problem(call, match):
    with pytest.raises((TypeError, ValueError, IndexError), match=match):
        call()
