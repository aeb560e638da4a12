"""The decode-attention kernel vs its torch reference under ``TRITON_INTERPRET=1``, at tiny shapes.

Not collected directly (no ``test_`` prefix): ``test_decode_attention.py`` runs
this file in a subprocess, as ``test_kernels_interpreted.py`` does for the mask
kernels. float16 only: the interpreter does not support bfloat16 ``tl.dot``
(it multiplies the raw bits; triton-lang/triton#11584), so bfloat16 is checked
on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from decode_attention_cases import (
    assert_close,
    check_decode_attention,
    check_paged_decode_attention,
    decode_inputs,
    reference_output,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdbench.kernels.decode_attention import decode_attention, lpt_order

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_decode_attention.py"

FAST = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@st.composite
def row_lengths(draw, max_len: int) -> list[int]:
    """1-5 rows, often at the edges (0, 1, max_len) where off-by-one reads show."""
    length = st.one_of(st.sampled_from([0, 1, max_len, max_len - 1]), st.integers(0, max_len))
    return draw(st.lists(length, min_size=1, max_size=5))


@FAST
@given(
    data=st.data(), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2, 4, 5]),
    head_dim=st.sampled_from([16, 24, 32]), max_len=st.sampled_from([64, 100]),
    splits=st.sampled_from([None, 1, 2, 3, 8]), min_split_keys=st.sampled_from([None, 1, 20]),
    seed=st.integers(0, 2**32 - 1),
)
def test_decode_attention_matches_reference(data, kv_heads, group, head_dim, max_len, splits, min_split_keys, seed):
    lengths = data.draw(row_lengths(max_len))
    gen = torch.Generator().manual_seed(seed)
    check_decode_attention(gen, lengths, kv_heads, group, head_dim, max_len, torch.float16, splits, "cpu",
                           min_split_keys=min_split_keys)


@pytest.mark.parametrize("min_split_keys", [1, 32])
@pytest.mark.parametrize("splits", [1, 2, 4, 16])
@pytest.mark.parametrize("group,head_dim", [(2, 16), (4, 32)])
def test_decode_attention_edge_lengths(group, head_dim, splits, min_split_keys):
    # More splits than a row has blocks (or than its floor of keys per split allows): the extra
    # programs return without writing partials, and the merge reads only those that ran.
    gen = torch.Generator().manual_seed(splits * 10 + group)
    check_decode_attention(gen, [1, 64, 17, 0, 63, 33], 2, group, head_dim, 64, torch.float16, splits, "cpu",
                           index_dtype=torch.int64, min_split_keys=min_split_keys)


def test_decode_attention_writes_given_out_with_scale_and_strided_query():
    gen = torch.Generator().manual_seed(3)
    q, k, v, slots, lengths = decode_inputs(gen, [5, 64, 30], 2, 4, 32, 64, torch.float16, "cpu")
    # A query that is a view into a wider projection output, as the live forward's is.
    wide = torch.zeros(3, q.shape[1] + 4, 32, dtype=torch.float16)
    wide[:, 2:-2] = q
    query = wide[:, 2:-2]
    out = torch.full_like(q, float("nan"))
    returned = decode_attention(query, k, v, slots, lengths, out=out, scale=0.3, splits=3)
    assert returned is out
    assert_close(out, reference_output(q, k, v, slots, lengths, scale=0.3), "out=, scale=0.3")


# Ragged batches whose long rows are last (launched first when balanced) or first (where they stay).
RAGGED = {"long_last": [9, 3, 12, 0, 7, 64, 61], "long_first": [64, 61, 9, 3, 12, 0, 7]}


@pytest.mark.parametrize("splits,min_split_keys", [(1, None), (3, 1), (8, 16)], ids=["direct", "split3", "split8"])
@pytest.mark.parametrize("arrangement", sorted(RAGGED))
def test_balanced_launch_writes_each_row_at_its_own_index(arrangement, splits, min_split_keys):
    # Every row has its own query, slot and length, so a program that ran row order[i] but wrote
    # row i (or read row i's query, slot or length) is off the reference by far.
    gen = torch.Generator().manual_seed(len(arrangement) * 7 + splits)
    q, k, v, slots, lengths = decode_inputs(gen, RAGGED[arrangement], 2, 4, 32, 64, torch.float16, "cpu")
    expected = reference_output(q, k, v, slots, lengths)
    balanced = decode_attention(q, k, v, slots, lengths, splits=splits, min_split_keys=min_split_keys)
    in_order = decode_attention(q, k, v, slots, lengths, splits=splits, min_split_keys=min_split_keys, balance=False)
    what = f"{arrangement} splits={splits}"
    assert_close(balanced, expected, what)
    assert_close(in_order, expected, what + " balance=False")
    # The same arithmetic per row, whichever program ran it.
    assert torch.equal(balanced, in_order), what


@pytest.mark.parametrize("splits", [1, 3])
def test_a_given_order_is_the_launch_order_and_changes_no_output(splits):
    gen = torch.Generator().manual_seed(11)
    q, k, v, slots, lengths = decode_inputs(gen, RAGGED["long_last"], 1, 2, 16, 64, torch.float16, "cpu")
    expected = decode_attention(q, k, v, slots, lengths, splits=splits, min_split_keys=1)
    for order in (lpt_order(lengths), torch.randperm(7, generator=gen), torch.arange(6, -1, -1, dtype=torch.int32)):
        got = decode_attention(q, k, v, slots, lengths, splits=splits, min_split_keys=1, order=order)
        assert torch.equal(got, expected), f"order {order.tolist()}"


@FAST
@given(
    data=st.data(), group=st.sampled_from([1, 4]), block_size=st.sampled_from([1, 4, 16, 32]),
    splits=st.sampled_from([None, 1, 3]), min_split_keys=st.sampled_from([None, 1]), seed=st.integers(0, 2**32 - 1),
)
def test_paged_decode_attention_matches_slotted_and_reference(data, group, block_size, splits, min_split_keys, seed):
    # Pages smaller and larger than the kernel's key block, shuffled over the pool, ragged rows.
    lengths = data.draw(row_lengths(64))
    gen = torch.Generator().manual_seed(seed)
    check_paged_decode_attention(gen, lengths, 2, group, 16, 64, block_size, torch.float16, splits, "cpu",
                                 min_split_keys=min_split_keys)
