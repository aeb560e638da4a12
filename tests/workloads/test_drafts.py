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
    # a longer draft starts with the shorter one
    assert all(a.propose(request(r), p, 2) == a.propose(request(r), p, 5)[:2] for r in range(5) for p in range(30))


def test_bad_alpha(vocab):
    with pytest.raises(ValueError, match="alpha"):
        DraftSource(1.5, vocab, 0)


def test_alpha_zero_replacements_include_grammar_valid_and_invalid_tokens(vocab):
    # every draft token is replaced; at each position of a JSON answer, ask the real grammar whether the
    # replacement could follow the answer so far (plausible ones often can inside strings, random ones rarely)
    from cdbench.backends import create_backend
    from cdbench.backends.base import ConstraintSpec

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "note": {"type": "string"}},
              "required": ["name", "note"]}
    texts = ('{"name": "Alice Smith", "note": "likes green tea"}', '{"name": "Bob Stone", "note": "reads old maps"}')
    eos = vocab.eos_token_ids[0]
    tokens = tuple(tuple(vocab.encode(t)) + (eos,) for t in texts)
    pool = InstancePool("person", texts, tokens)
    request = Request(0, 0.0, 10, len(tokens[0]), ConstraintSpec("json_schema", schema), "person", tokens[0],
                      instance_index=0)
    backend = create_backend("xgrammar", vocab)
    matcher = backend.matcher(backend.compile(request.spec))
    drafts = DraftSource(0.0, vocab, 5, {"person": pool})
    verdicts = []
    for position, token in enumerate(tokens[0][:-1]):
        (draft,) = drafts.propose(request, position, 1)
        assert draft != token
        verdicts.append(matcher.copy().accept(draft))
        assert matcher.accept(token)
    assert any(verdicts) and not all(verdicts)


def test_proposing_for_many_rows_at_once_equals_one_at_a_time(vocab):
    import numpy as np

    from cdbench.workloads.drafts import OracleTokens

    other = Request(1, 0.0, 10, 30, spec_id="t", output_tokens=tuple(range(3000, 3030)))
    plain = Request(2, 0.0, 10, 5)  # no output tokens: no drafts
    requests = [request(0), other, plain, request(7)]
    drafts = DraftSource(0.4, vocab, 11, {"s": POOL})
    rows = np.array([3, 0, 1, 2, 0, 1])
    positions = np.array([4, 38, 29, 0, 0, 10])
    ks = np.array([4, 4, 3, 2, 1, 5])
    batch = drafts.propose_rows(requests, OracleTokens.of(requests), rows, positions, ks)
    assert batch == [drafts.propose(requests[r], p, k) for r, p, k in zip(rows, positions, ks)]
    assert [len(d) for d in batch] == [4, 2, 1, 0, 1, 5]


def test_drafts_drawn_by_block_match_direct_draws_across_blocks_and_growing_k(vocab):
    """The drafts table is drawn per block of requests, and redrawn wider when a step asks for more."""
    import numpy as np

    from cdbench.workloads.drafts import OracleTokens

    requests = [Request(i, 0.0, 10, 12 + i % 5, output_tokens=tuple(range(100 * i, 100 * i + 12 + i % 5)))
                if i % 9 else Request(i, 0.0, 10, 4) for i in range(200)]  # 200 requests: four blocks
    oracle = OracleTokens.of(requests)
    drafts = DraftSource(0.5, vocab, 3)
    rng = np.random.default_rng(0)
    for k in (1, 2, 2, 4, 3):
        rows = rng.choice(len(requests), 30, replace=False)
        positions = np.array([rng.integers(0, 17) if requests[r].output_tokens else 0 for r in rows.tolist()])
        positions = np.minimum(positions, oracle.length[rows])
        ks = np.full(len(rows), k)
        batch = drafts.propose_rows(requests, oracle, rows, positions, ks)
        assert batch == [drafts.propose(requests[r], p, k) for r, p in zip(rows.tolist(), positions.tolist())]
    # the last request at its end (no drafts) beside one that has some: its row points past the last token
    last = len(requests) - 1
    ends = drafts.propose_rows(requests, oracle, np.array([last, 1]), np.array([int(oracle.length[last]), 0]),
                               np.array([3, 3]))
    assert ends == [[], drafts.propose(requests[1], 0, 3)] and len(ends[1]) == 3
