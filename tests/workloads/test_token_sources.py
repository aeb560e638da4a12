from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cdbench.workloads.token_sources import RandomWalk, allowed_tokens

V = 100


def bitmask(ids: set[int]) -> torch.Tensor:
    row = torch.zeros((V + 31) // 32, dtype=torch.int32)
    for i in ids:
        word = int(row[i // 32]) | (1 << (i % 32))
        row[i // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32 wraps bit 31
    return row


@settings(max_examples=50, deadline=None)
@given(st.sets(st.integers(0, V - 1), min_size=1))
def test_allowed_tokens_matches_bitmask_and_bool_rows(ids):
    assert set(allowed_tokens(bitmask(ids), V).tolist()) == ids
    row = torch.zeros(V, dtype=torch.bool)
    row[list(ids)] = True
    assert set(allowed_tokens(row, V).tolist()) == ids


def test_walk_draws_only_allowed_tokens_and_is_seeded():
    ids = {3, 31, 63, 64, 90}
    walk = RandomWalk(eos_token_ids=(99,), vocab_size=V, seed=1, eos_bias=0.0)
    draws = [walk.next_token(bitmask(ids), request_id=r, position=p) for r in range(5) for p in range(10)]
    assert set(draws) <= ids and len(set(draws)) > 2
    again = RandomWalk(eos_token_ids=(99,), vocab_size=V, seed=1, eos_bias=0.0)
    assert draws == [again.next_token(bitmask(ids), request_id=r, position=p) for r in range(5) for p in range(10)]


def test_eos_bias_and_cap():
    row = bitmask({5, 6, 99})
    always = RandomWalk(eos_token_ids=(99,), vocab_size=V, seed=0, eos_bias=1.0)
    assert always.next_token(row, request_id=0, position=0) == 99
    capped = RandomWalk(eos_token_ids=(99,), vocab_size=V, seed=0, eos_bias=0.0, max_tokens=4)
    assert capped.next_token(row, request_id=0, position=3) != 99
    assert capped.next_token(row, request_id=0, position=4) == 99
    # EOS not allowed: the cap cannot force it
    assert capped.next_token(bitmask({5}), request_id=0, position=9) == 5


def test_empty_row_is_an_error():
    walk = RandomWalk(eos_token_ids=(99,), vocab_size=V, seed=0)
    with pytest.raises(ValueError, match="allows no token"):
        walk.next_token(bitmask(set()), request_id=3, position=1)


def test_request_params_replace_the_walks_seed_bias_and_cap():
    from cdbench.workloads.request import WalkParams

    row = bitmask({5, 6, 7, 8, 99})
    walk = RandomWalk(eos_token_ids=(99,), vocab_size=V, seed=0, eos_bias=0.0)
    ending = WalkParams(seed=0, eos_bias=1.0)
    assert walk.next_token(row, request_id=0, position=0, params=ending) == 99
    capped = WalkParams(seed=0, eos_bias=0.0, max_tokens=2)
    assert walk.next_token(row, request_id=0, position=1, params=capped) != 99
    assert walk.next_token(row, request_id=0, position=2, params=capped) == 99
    # the params' seed decides the draws, not the walk's
    own = [walk.next_token(row, request_id=0, position=p) for p in range(30)]
    same_seed = [walk.next_token(row, request_id=0, position=p, params=WalkParams(seed=0, eos_bias=0.0))
                 for p in range(30)]
    other_seed = [walk.next_token(row, request_id=0, position=p, params=WalkParams(seed=9, eos_bias=0.0))
                  for p in range(30)]
    assert own == same_seed != other_seed
