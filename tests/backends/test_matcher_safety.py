"""Every backend refuses bad input with a clear error and an unchanged state.

llguidance and outlines-core write masks through raw pointers, so a mask they
cannot write (a row past its end, another dtype or width, strided memory) must
be refused before the engine sees it; ids outside the vocabulary and
rollbacks a matcher cannot do must leave it exactly as it was.

Subjects: the three engines and ``none`` on cl100k, and the reasoner (over
llguidance, on qwen3.6, where ``</think>`` is one token) both while thinking
(its own fill) and in the answer (the engine's fill).
"""

from __future__ import annotations

import pytest
import torch
from cases import ENGINES

from cdbench.backends import ConstraintSpec, create_backend

LETTERS = ConstraintSpec("regex", "abcdefgh")  # each state allows a different next letter
SUBJECTS = (*ENGINES, "none", "reasoner-thinking", "reasoner-answer")


def _start(engines, subject: str):
    """The backend and a fresh matcher (the reasoner's in the phase named)."""
    if subject.startswith("reasoner"):
        backend = engines.reasoner("llguidance", "qwen3.6")
        grammar = engines.compiled("llguidance", "qwen3.6", LETTERS)
        return backend, backend.matcher(grammar, thinking=subject == "reasoner-thinking")
    backend = engines.backend(subject, "cl100k")
    return backend, backend.matcher(engines.compiled(subject, "cl100k", LETTERS))


def _letters(backend, text: str) -> list[int]:
    tokens = [backend.vocab.encode(ch)[0] for ch in text]
    assert all(len(backend.vocab.encode(ch)) == 1 for ch in text)
    return tokens


def _mask_of(backend, matcher) -> torch.Tensor:
    mask = backend.allocate_mask(1)
    matcher.fill_mask(mask, 0)
    return mask


@pytest.mark.parametrize("subject", SUBJECTS)
@pytest.mark.parametrize("row", [1, 3, -1, 2**40])
def test_a_row_outside_the_mask_is_refused(engines, subject, row):
    backend, matcher = _start(engines, subject)
    mask = backend.allocate_mask(1)
    mask.fill_(7)
    with pytest.raises(IndexError, match="fill_mask: row"):
        matcher.fill_mask(mask, row)
    assert bool((mask == 7).all()), "a refused fill wrote into the mask"


def _bad_masks(backend):
    width = backend.allocate_mask(1).shape[1]
    freed = backend.allocate_mask(2)
    freed.untyped_storage().resize_(0)  # a shape whose memory is gone
    return {
        "freed": freed,
        "int64": torch.zeros((2, width), dtype=torch.int64),
        "bool": torch.zeros((2, width), dtype=torch.bool),
        "narrow": torch.zeros((2, width - 1), dtype=torch.int32),
        "one-dimensional": torch.zeros(width, dtype=torch.int32),
        "strided": backend.allocate_mask(4).t().contiguous().t(),
        "every-other-row": backend.allocate_mask(4)[::2],
    }


@pytest.mark.parametrize("subject", SUBJECTS)
@pytest.mark.parametrize("kind", ["int64", "bool", "narrow", "one-dimensional", "strided", "every-other-row", "freed"])
def test_a_mask_it_cannot_write_is_refused(engines, subject, kind):
    backend, matcher = _start(engines, subject)
    mask = _bad_masks(backend)[kind]
    before = mask.clone() if kind != "freed" else None
    with pytest.raises(ValueError, match="fill_mask: the mask must be a contiguous CPU torch.int32 tensor"):
        matcher.fill_mask(mask, 0)
    assert before is None or torch.equal(mask, before)
    with pytest.raises(TypeError, match="fill_mask: the mask must be a torch.Tensor, not list"):
        matcher.fill_mask([[0]], 0)


@pytest.mark.parametrize("subject", SUBJECTS)
def test_a_row_of_a_row_slice_is_written_in_place(engines, subject):
    """A slice of rows starts inside its storage: only the row asked for changes."""
    backend, matcher = _start(engines, subject)
    expected = _mask_of(backend, matcher)[0]
    big = backend.allocate_mask(4)
    big.fill_(7)
    matcher.fill_mask(big[1:3], 1)
    assert torch.equal(big[2], expected)
    assert all(bool((big[i] == 7).all()) for i in (0, 1, 3))


@pytest.mark.parametrize("subject", SUBJECTS)
def test_each_new_mask_is_checked_and_filled_where_it_lies(engines, subject):
    """Masks checked once are shared by every matcher of the backend; a new tensor is checked again."""
    backend, matcher = _start(engines, subject)
    expected = _mask_of(backend, matcher)[0]
    for rows in (8, 2, 5):  # a new, larger or smaller, tensor each time
        mask = backend.allocate_mask(rows)
        mask.fill_(7)
        matcher.fill_mask(mask, rows - 1)
        assert torch.equal(mask[rows - 1], expected) and bool((mask[:-1] == 7).all())
        with pytest.raises(IndexError, match="fill_mask: row"):
            matcher.fill_mask(mask, rows)
    _, other = _start(engines, subject)  # a new matcher finds the last mask checked
    other.fill_mask(mask, 0)
    assert torch.equal(mask[0], expected)
    with pytest.raises(ValueError):
        other.fill_mask(mask.t(), 0)  # and still checks another tensor over the same memory


@pytest.mark.parametrize("subject", SUBJECTS)
def test_ids_outside_the_vocabulary_are_rejected_without_harm(engines, subject):
    backend, matcher = _start(engines, subject)
    a, b = _letters(backend, "ab")
    assert matcher.accept(a)
    before = _mask_of(backend, matcher)
    for token in (-1, backend.vocab.size, backend.vocab.size + 7, 2**40, -(2**40)):
        assert matcher.accept(token) is False, token
    assert torch.equal(_mask_of(backend, matcher), before), "a rejected id changed the state"
    assert matcher.accept(b)


@pytest.mark.parametrize("subject", SUBJECTS)
def test_a_refused_rollback_changes_nothing(engines, subject):
    backend, matcher = _start(engines, subject)
    tokens = _letters(backend, "abcd")
    assert all(matcher.accept(t) for t in tokens)
    before = _mask_of(backend, matcher)
    for k in (-1, 5, 100):
        with pytest.raises(ValueError, match=f"cannot roll back {k}"):
            matcher.rollback(k)
        assert torch.equal(_mask_of(backend, matcher), before), f"a refused rollback({k}) changed the state"
        assert torch.equal(_mask_of(backend, matcher.copy()), before), f"a refused rollback({k}) broke copy()"
    matcher.rollback(2)
    _, fresh = _start(engines, subject)
    assert all(fresh.accept(t) for t in tokens[:2])
    assert torch.equal(_mask_of(backend, matcher), _mask_of(backend, fresh))


def test_outlines_rollback_past_its_window_changes_nothing(engines):
    """outlines-core keeps ``max_rollback`` states; a longer rollback is refused before any token is forgotten."""
    backend = create_backend("outlines", engines.backend("outlines", "cl100k").vocab, max_rollback=2)
    grammar = backend.compile(LETTERS)
    tokens = _letters(backend, "abcd")
    matcher = backend.matcher(grammar)
    assert all(matcher.accept(t) for t in tokens)
    before = _mask_of(backend, matcher)
    with pytest.raises(ValueError, match="cannot roll back 3 tokens: .*max_rollback = 2"):
        matcher.rollback(3)
    assert torch.equal(_mask_of(backend, matcher), before)
    assert torch.equal(_mask_of(backend, matcher.copy()), before), "the copy replays a token list that lost tokens"
    matcher.rollback(2)
    fresh = backend.matcher(grammar)
    assert all(fresh.accept(t) for t in tokens[:2])
    assert torch.equal(_mask_of(backend, matcher), _mask_of(backend, fresh))
