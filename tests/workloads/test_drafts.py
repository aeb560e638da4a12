from __future__ import annotations

import pytest

from cdbench.workloads.drafts import DraftSource
from cdbench.workloads.instances import InstancePool
from cdbench.workloads.request import Request

ORACLE = tuple(range(1000, 1040))
POOL = InstancePool("s", ("a", "b"), (ORACLE, tuple(range(2000, 2040))))


def request(i=0):
    return Request(i, 0.0, 10, len(ORACLE), spec_id="s", output_tokens=ORACLE, instance_index=0)


def test_alpha_one_gives_the_oracle_continuation(vocab):
    drafts = DraftSource(1.0, vocab, 0, {"s": POOL})
    assert drafts.propose(request(), 5, 3) == [1005, 1006, 1007]
    assert drafts.propose(request(), 38, 4) == [1038, 1039]
    assert drafts.propose(Request(1, 0.0, 1, 1), 0, 4) == []


def test_acceptance_rate_follows_alpha_and_replacements_mix(vocab):
    drafts = DraftSource(0.7, vocab, 3, {"s": POOL})
    same = total = from_pool = 0
    for rid in range(60):
        for pos in range(0, 36, 4):
            draft = drafts.propose(request(rid), pos, 4)
            for offset, token in enumerate(draft):
                total += 1
                same += token == ORACLE[pos + offset]
                from_pool += 2000 <= token < 2040
    assert 0.64 < same / total < 0.76
    assert 0.08 < from_pool / (total - same) < 0.9  # some plausible, some random


def test_alpha_zero_never_matches_and_avoids_special_tokens(vocab):
    drafts = DraftSource(0.0, vocab, 1)
    for pos in range(30):
        for offset, token in enumerate(drafts.propose(request(), pos, 3)):
            assert token != ORACLE[pos + offset]
            assert token not in vocab.forbidden_token_ids


def test_proposals_are_deterministic(vocab):
    a = DraftSource(0.5, vocab, 9, {"s": POOL})
    b = DraftSource(0.5, vocab, 9, {"s": POOL})
    calls = [(request(r), p, 4) for r in range(5) for p in range(0, 30, 7)]
    assert [a.propose(*c) for c in calls] == [b.propose(*c) for c in reversed(calls)][::-1]


def test_bad_alpha(vocab):
    with pytest.raises(ValueError, match="alpha"):
        DraftSource(1.5, vocab, 0)
