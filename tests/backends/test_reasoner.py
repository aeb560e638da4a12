"""The reasoner wrapper: phases, strict thinking, budgets, rollback across the think boundary.

The phase machine is checked against a reference model (phase, think count,
inner history replayed on a fresh inner matcher) with hypothesis, on a tiny
test-only engine and on the real xgrammar, llguidance and outlines engines.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdbench.backends.base import (
    CompiledGrammar,
    ConstraintSpec,
    GrammarBackend,
    MaskFormat,
    Matcher,
)
from cdbench.backends.reasoner import ReasonerBackend, ReasonerMatcher
from cdbench.backends.registry import create_backend, register_backend
from cdbench.backends.vocab import Vocabulary, load_vocab

# --- a tiny vocabulary and a tiny engine -------------------------------------------------

_SPECIALS = ["<eos>", "<think>", "</think>"]
_CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 ,")
_TOKENS = [s.encode() for s in _SPECIALS] + [c.encode() for c in _CHARS]
EOS, THINK_END = 0, 2


def _tiny_vocab() -> Vocabulary:
    index = {c: i + len(_SPECIALS) for i, c in enumerate(_CHARS)}
    return Vocabulary(
        name="tiny",
        size=len(_TOKENS) + 5,  # 5 trailing unused ids, so masks have a padding tail
        eos_token_ids=(EOS,),
        special_token_ids=frozenset(range(len(_SPECIALS))),
        unused_token_ids=frozenset(range(len(_TOKENS), len(_TOKENS) + 5)),
        token_bytes=tuple(_TOKENS) + (b"",) * 5,
        _encode=lambda text: [index[c] for c in text],
        _decode=lambda ids: b"".join(_TOKENS[i] for i in ids).decode(),
    )


TINY = _tiny_vocab()


class LiteralBackend(GrammarBackend):
    """Accepts exactly one string (a one-item ``choice``), then EOS."""

    name = "tiny-literal"

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        return CompiledGrammar(self.name, spec, tuple(self.vocab.encode(spec.spec[0])))

    def matcher(self, grammar: CompiledGrammar) -> Matcher:
        return LiteralMatcher(self, grammar.handle)


class LiteralMatcher(Matcher):
    def __init__(self, backend: LiteralBackend, target: tuple[int, ...]) -> None:
        self.backend, self.target, self.history = backend, target, []

    def _next(self) -> int | None:
        n = len(self.history)
        if n < len(self.target):
            return self.target[n]
        return EOS if n == len(self.target) else None

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        nxt = self._next()
        mask[row] = _row_allowing(self.backend, set() if nxt is None else {nxt})  # (bit 31 as int32's sign)

    def accept(self, token: int) -> bool:
        if token != self._next():
            return False
        self.history.append(token)
        return True

    @property
    def history_length(self) -> int:
        return len(self.history)

    def rollback(self, k: int) -> None:
        del self.history[len(self.history) - k :]

    def jump_forward(self) -> list[int]:
        return list(self.target[len(self.history) :])

    def is_terminated(self) -> bool:
        return len(self.history) > len(self.target)

    def copy(self) -> Matcher:
        twin = LiteralMatcher(self.backend, self.target)
        twin.history = list(self.history)
        return twin


register_backend("tiny-literal", LiteralBackend)
LITERAL = ConstraintSpec("choice", ["ab1 2"])


def _allowed(backend: GrammarBackend, m: Matcher) -> list[int]:
    mask = backend.allocate_mask(1)
    m.fill_mask(mask, 0)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    ids = bits.flatten().nonzero().flatten()
    return ids[ids < backend.vocab.size].tolist()


def _row_allowing(backend: GrammarBackend, allowed: set[int]) -> torch.Tensor:
    words = [0] * ((backend.vocab.size + 31) // 32)
    for tok in allowed:
        words[tok // 32] |= 1 << (tok % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def _reasoner(**kw) -> ReasonerBackend:
    return ReasonerBackend(TINY, inner="tiny-literal", **kw)


# --- construction -------------------------------------------------------------------------


def test_created_through_the_registry_by_name():
    backend = create_backend("reasoner", TINY, inner="tiny-literal", thinking_budget=3)
    assert isinstance(backend, ReasonerBackend)
    assert isinstance(backend.inner, LiteralBackend)
    assert backend.think_end_id == THINK_END
    assert backend.options_key() == backend.inner.options_key()


def test_inner_instance_is_used_as_given():
    inner = LiteralBackend(TINY)
    assert ReasonerBackend(TINY, inner=inner).inner is inner
    with pytest.raises(TypeError, match="already built"):
        ReasonerBackend(TINY, inner=inner, whitespace="compact")


def test_inner_built_for_another_vocabulary_is_refused():
    other = LiteralBackend(Vocabulary(**{**TINY.__dict__, "name": "other"}))
    with pytest.raises(ValueError, match="'other'"):
        ReasonerBackend(TINY, inner=other)


def test_think_end_that_is_not_one_token_names_marker_and_vocabulary():
    with pytest.raises(ValueError, match=r"think-end marker 'ab'.*vocabulary 'tiny'"):
        _reasoner(think_end="ab")


def test_think_end_not_one_token_in_cl100k():
    with pytest.raises(ValueError, match=r"'</think>'.*'cl100k'"):
        ReasonerBackend(load_vocab("cl100k"), inner="tiny-literal")


@pytest.mark.parametrize("budget", [-1, 1.5, True])
def test_bad_budget_is_refused(budget):
    with pytest.raises(ValueError, match="thinking budget"):
        _reasoner(thinking_budget=budget)
    with pytest.raises(ValueError, match="thinking budget"):
        _reasoner().matcher(_reasoner().compile(LITERAL), thinking_budget=budget)


def test_strict_filter_ids_outside_vocabulary_are_refused():
    with pytest.raises(ValueError, match=r"\[999\].*'tiny'"):
        _reasoner(strict_thinking_tokens=[5, 999])


def test_compile_returns_the_inner_grammar():
    backend = _reasoner()
    grammar = backend.compile(LITERAL)
    assert grammar.backend == "tiny-literal"


# --- phases -------------------------------------------------------------------------------


def test_thinking_allows_everything_and_ignores_the_grammar():
    backend = _reasoner()
    m = backend.matcher(backend.compile(LITERAL))
    assert m.thinking
    assert _allowed(backend, m) == list(range(TINY.size))
    for tok in TINY.encode("zzz 999") + [EOS]:  # EOS too: the engines leave thinking rows all-allowed
        assert m.accept(tok)
    assert m.think_tokens == 8 and not m.is_terminated() and m.jump_forward() == []
    assert m.accept(THINK_END) and not m.thinking
    assert m.inner.history == []  # the think-end token was not passed to the grammar
    assert _allowed(backend, m) == [TINY.encode("a")[0]]
    assert not m.accept(TINY.encode("z")[0])
    assert m.jump_forward() == TINY.encode("ab1 2")


def test_answer_phase_delegates_to_inner_until_termination():
    backend = _reasoner()
    m = backend.matcher(backend.compile(LITERAL))
    assert m.accept(THINK_END)
    for tok in TINY.encode("ab1 2"):
        assert m.accept(tok)
    assert _allowed(backend, m) == [EOS]
    assert m.accept(EOS) and m.is_terminated()
    assert not m.accept(THINK_END)  # in the answer, think-end is ordinary (rejected) input


def test_matcher_can_start_in_the_answer_phase():
    backend = _reasoner()
    m = backend.matcher(backend.compile(LITERAL), thinking=False)
    assert not m.thinking and m.answer_tokens == 0
    assert _allowed(backend, m) == [TINY.encode("a")[0]]
    assert not m.accept(THINK_END)
    assert m.accept(TINY.encode("a")[0])
    with pytest.raises(ValueError, match="cannot roll back 2"):
        m.rollback(2)  # no think span to roll back into
    m.rollback(1)
    assert m.history_length == 0 and not m.thinking


def test_strict_thinking_allows_only_the_filter_and_think_end():
    allowed = TINY.encode("abc")
    backend = _reasoner(strict_thinking_tokens=allowed)
    m = backend.matcher(backend.compile(LITERAL))
    assert _allowed(backend, m) == sorted(allowed + [THINK_END])
    assert not m.accept(TINY.encode("z")[0]) and not m.accept(EOS)
    assert m.accept(allowed[0]) and m.think_tokens == 1
    assert m.accept(THINK_END)
    assert _allowed(backend, m) == [TINY.encode("a")[0]]  # the filter is not applied to the answer


def test_strict_filter_of_think_end_alone_forces_it():
    backend = _reasoner(strict_thinking_tokens=[])
    m = backend.matcher(backend.compile(LITERAL))
    assert _allowed(backend, m) == [THINK_END]
    assert m.jump_forward() == [THINK_END]


def test_budget_forces_think_end_once_spent():
    backend = _reasoner(thinking_budget=2)
    m = backend.matcher(backend.compile(LITERAL))
    assert m.accept(5) and m.jump_forward() == []
    assert m.accept(6)
    assert _allowed(backend, m) == [THINK_END]
    assert m.jump_forward() == [THINK_END]
    assert not m.accept(5) and m.think_tokens == 2
    m.rollback(1)
    assert _allowed(backend, m) == list(range(TINY.size))


def test_fill_mask_bound_while_thinking_still_fills_the_answer():
    backend = _reasoner()
    m = backend.matcher(backend.compile(LITERAL))
    fill = m.fill_mask
    m.accept(THINK_END)
    mask = backend.allocate_mask(1)
    fill(mask, 0)
    assert torch.equal(mask[0], _row_allowing(backend, set(TINY.encode("a"))))


def test_accept_bound_while_thinking_still_accepts_the_answer():
    backend = _reasoner()
    m = backend.matcher(backend.compile(LITERAL))
    accept = m.accept
    assert accept(5) and accept(THINK_END)
    assert accept(TINY.encode("a")[0]) and not accept(5)
    assert m.answer_tokens == 1 and m.history_length == 3


def test_answer_phase_calls_go_straight_to_the_inner_matcher():
    """No wrapper frame per answer token; the class's methods return with thinking."""
    backend = _reasoner()
    m = backend.matcher(backend.compile(LITERAL))
    assert m.accept(THINK_END)
    assert m.accept == m.inner.accept and m.fill_mask == m.inner.fill_mask
    m.rollback(1)
    assert m.thinking and m.accept != m.inner.accept and m.fill_mask != m.inner.fill_mask
    assert m.accept(5) and m.think_tokens == 1


def test_budget_is_overridable_per_matcher():
    backend = _reasoner(thinking_budget=2)
    grammar = backend.compile(LITERAL)
    assert backend.matcher(grammar, thinking_budget=0).jump_forward() == [THINK_END]
    unlimited = backend.matcher(grammar, thinking_budget=None)
    assert all(unlimited.accept(5) for _ in range(10))
    assert backend.matcher(grammar).thinking_budget == 2


def test_budget_with_strict_thinking_allows_only_think_end():
    backend = _reasoner(thinking_budget=1, strict_thinking_tokens=[5, 6])
    m = backend.matcher(backend.compile(LITERAL))
    assert m.accept(5)
    assert _allowed(backend, m) == [THINK_END]


def test_out_of_range_tokens_are_rejected_while_thinking():
    backend = _reasoner()
    m = backend.matcher(backend.compile(LITERAL))
    assert not m.accept(-1) and not m.accept(TINY.size)
    assert m.history_length == 0


def test_rollback_across_the_boundary_restores_phase_and_inner():
    backend = _reasoner(thinking_budget=3)
    m = backend.matcher(backend.compile(LITERAL))
    for tok in [5, 6, THINK_END, *TINY.encode("ab")]:
        assert m.accept(tok)
    m.rollback(2)
    assert not m.thinking and m.inner.history == []
    m.rollback(1)
    assert m.thinking and m.think_tokens == 2 and m.inner.history == []
    for tok in [7, THINK_END, *TINY.encode("ab1")]:
        assert m.accept(tok)
    m.rollback(5)  # three inner tokens, think-end, one think token
    assert m.thinking and m.think_tokens == 2 and m.inner.history == []
    with pytest.raises(ValueError, match="cannot roll back 3"):
        m.rollback(3)
    with pytest.raises(ValueError):
        m.rollback(-1)
    assert m.think_tokens == 2  # failed rollbacks change nothing


def test_copy_copies_phase_and_inner_independently():
    backend = _reasoner(thinking_budget=5)
    m = backend.matcher(backend.compile(LITERAL))
    m.accept(5)
    thinking_twin = m.copy()
    m.accept(THINK_END)
    m.accept(TINY.encode("a")[0])
    answer_twin = m.copy()
    assert thinking_twin.thinking and thinking_twin.think_tokens == 1
    assert answer_twin.inner.history == m.inner.history and answer_twin.inner is not m.inner
    m.accept(TINY.encode("b")[0])
    assert answer_twin.inner.history == TINY.encode("a")
    answer_twin.rollback(2)
    assert answer_twin.thinking and not m.thinking
    assert answer_twin.thinking_budget == 5


# --- the bool mask format ----------------------------------------------------------------


class BoolLiteralBackend(LiteralBackend):
    """The literal engine with bool mask rows (one bool per id, True = allowed)."""

    name = "tiny-literal-bool"
    mask_format = MaskFormat.BOOL

    def matcher(self, grammar: CompiledGrammar) -> Matcher:
        return BoolLiteralMatcher(self, grammar.handle)


class BoolLiteralMatcher(LiteralMatcher):
    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        mask[row].zero_()
        nxt = self._next()
        if nxt is not None:
            mask[row, nxt] = True


def _bool_allowed(backend: GrammarBackend, m: Matcher) -> list[int]:
    mask = backend.allocate_mask(2)
    mask.zero_()
    m.fill_mask(mask, 1)
    assert not mask[0].any(), "a fill wrote outside its row"
    return mask[1].nonzero().flatten().tolist()


def test_bool_mask_format_goes_through_every_phase():
    """A bool-format inner makes the reasoner's own rows bool too: free, strict, budget-spent and the answer."""
    inner = BoolLiteralBackend(TINY)
    free = ReasonerBackend(TINY, inner=inner, thinking_budget=1)
    strict = ReasonerBackend(TINY, inner=inner, strict_thinking_tokens=[5, 6])
    assert free.mask_format is MaskFormat.BOOL
    mask = free.allocate_mask(3)
    assert mask.dtype == torch.bool and mask.shape == (3, TINY.size) and bool(mask.all())
    m = free.matcher(free.compile(LITERAL))
    assert _bool_allowed(free, m) == list(range(TINY.size))
    assert m.accept(5)
    assert _bool_allowed(free, m) == [THINK_END]  # budget spent
    assert m.accept(THINK_END)
    assert _bool_allowed(free, m) == [TINY.encode("a")[0]]
    assert _bool_allowed(strict, strict.matcher(strict.compile(LITERAL))) == [THINK_END, 5, 6]


def test_bool_reasoner_refuses_a_bitmask():
    backend = ReasonerBackend(TINY, inner=BoolLiteralBackend(TINY))
    m = backend.matcher(backend.compile(LITERAL))
    bitmask = torch.full((1, (TINY.size + 31) // 32), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"reasoner fill_mask: .*torch.bool tensor of shape \[batch, {TINY.size}\]"):
        m.fill_mask(bitmask, 0)


# --- property test: the phase machine against a reference model --------------------------


class Reference:
    """Phase, think count and inner history; the inner state is a fresh matcher replayed."""

    def __init__(self, backend: ReasonerBackend, grammar: CompiledGrammar, budget, strict, thinking):
        self.backend, self.grammar, self.budget, self.strict = backend, grammar, budget, strict
        self.events: list[tuple[str, int]] = []  # ("think", t) | ("end", t) | ("inner", t)
        self.started_thinking = thinking
        self.thinking = thinking

    def inner(self) -> Matcher:
        m = self.backend.inner.matcher(self.grammar)
        for kind, tok in self.events:
            if kind == "inner":
                assert m.accept(tok)
        return m

    def think_count(self) -> int:
        return sum(kind == "think" for kind, _ in self.events)

    def accept(self, tok: int) -> bool:
        if not self.thinking:
            ok = self.inner().accept(tok)
            if ok:
                self.events.append(("inner", tok))
            return ok
        if tok == self.backend.think_end_id:
            self.events.append(("end", tok))
            self.thinking = False
            return True
        if self.budget is not None and self.think_count() >= self.budget:
            return False
        if self.strict is not None and tok not in self.strict:
            return False
        self.events.append(("think", tok))
        return True

    def rollback(self, k: int) -> None:
        del self.events[len(self.events) - k :]
        self.thinking = self.started_thinking and not any(kind == "end" for kind, _ in self.events)

    def mask(self, inner: Matcher) -> torch.Tensor:
        backend = self.backend
        row = backend.allocate_mask(1)
        if not self.thinking:
            inner.fill_mask(row, 0)
            return row[0]
        if self.budget is not None and self.think_count() >= self.budget:
            return _row_allowing(backend, {backend.think_end_id})
        if self.strict is not None:
            return _row_allowing(backend, self.strict)
        return row[0]


def _ops(candidates: list[int]):
    accept = st.tuples(st.just("accept"), st.sampled_from(candidates))
    rollback = st.tuples(st.just("rollback"), st.integers(0, 4))
    copy = st.tuples(st.just("copy"), st.just(0))
    return st.lists(st.one_of(accept, accept, rollback, copy), max_size=30)


def _check_against_reference(backend, spec, candidates, data):
    grammar = backend.compile(spec)
    budget = data.draw(st.one_of(st.none(), st.integers(0, 4)), label="budget")
    strict = data.draw(st.one_of(st.none(), st.sets(st.sampled_from(candidates), max_size=4)), label="strict")
    thinking = data.draw(st.booleans(), label="thinking")
    if strict is not None:
        backend = ReasonerBackend(backend.vocab, inner=backend.inner, strict_thinking_tokens=sorted(strict))
        strict = set(strict) | {backend.think_end_id}
    m = backend.matcher(grammar, thinking=thinking, thinking_budget=budget)
    ref = Reference(backend, grammar, budget, strict, thinking)
    seen: dict[tuple, torch.Tensor] = {}  # mask per accepted sequence, to compare after rollbacks
    out = backend.allocate_mask(1)
    for op, arg in data.draw(_ops(candidates), label="ops"):
        if op == "accept":
            assert m.accept(arg) == ref.accept(arg), (op, arg)
        elif op == "copy":
            m = m.copy()  # the copy carries on; the reference is unchanged
        else:
            k = min(arg, len(ref.events))
            m.rollback(k)
            ref.rollback(k)
        assert m.thinking == ref.thinking
        assert m.think_tokens == ref.think_count()
        assert m.history_length == len(ref.events)
        m.fill_mask(out, 0)
        history = tuple(ref.events)
        if history in seen:
            assert torch.equal(out[0], seen[history]), f"mask after {history} changed"
        seen[history] = out[0].clone()
        ref_inner = ref.inner()
        assert torch.equal(out[0], ref.mask(ref_inner)), f"mask differs from the reference after {history}"
        assert m.is_terminated() == ref_inner.is_terminated()
        if m.thinking:
            forced = budget is not None and ref.think_count() >= budget
            assert m.jump_forward() == ([backend.think_end_id] if forced or strict == {backend.think_end_id} else [])
        else:
            assert m.jump_forward() == ref_inner.jump_forward()


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_phase_machine_matches_reference_on_tiny_engine(data):
    backend = _reasoner()
    candidates = [EOS, THINK_END, 1, *TINY.encode("ab1 2z")]
    _check_against_reference(backend, LITERAL, candidates, data)


# --- real engines -------------------------------------------------------------------------

ENGINES = ["xgrammar", "llguidance", "outlines"]
# No repeated group: outlines-core 0.2.14 allows only EOS after a final state
# that a starred group could continue (`[0-9](a[0-9])*` after "1"). Bounded, so
# "12,345" leaves llguidance stopped by itself before EOS, a case its rollback
# must count right.
REGEX = ConstraintSpec("regex", "[0-9]{1,3},[0-9]{1,3}")


def _engine_available(name: str) -> bool:
    return importlib.util.find_spec(f"cdbench.backends.{name}") is not None


@pytest.fixture(scope="module", params=ENGINES)
def qwen_reasoner(request) -> ReasonerBackend:
    if not _engine_available(request.param):
        pytest.skip(f"cdbench.backends.{request.param} is not there yet")
    return ReasonerBackend(load_vocab("qwen3.6"), inner=request.param, thinking_budget=64)


def test_real_engine_think_then_answer(qwen_reasoner):
    backend = qwen_reasoner
    vocab = backend.vocab
    m = backend.matcher(backend.compile(REGEX))
    think = vocab.encode("Let me count: hello {world}") + vocab.encode("abc")  # text the grammar forbids
    assert all(m.accept(t) for t in think)
    assert m.accept(backend.think_end_id)
    assert not m.accept(vocab.encode("abc")[0])
    answer = vocab.encode("12,345")
    for tok in answer:
        assert tok in _allowed(backend, m)
        assert m.accept(tok)
    eos = vocab.eos_token_ids[0]
    assert eos in _allowed(backend, m)
    before_eos = _allowed(backend, m)
    assert m.accept(eos) and m.is_terminated()
    m.rollback(1)
    assert _allowed(backend, m) == before_eos
    m.rollback(len(answer) + 2)  # answer, think-end, one think token
    assert m.thinking and m.think_tokens == len(think) - 1
    assert _allowed(backend, m) == list(range(vocab.size))
    assert m.accept(backend.think_end_id) and all(m.accept(t) for t in answer)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_phase_machine_matches_reference_on_real_engine(qwen_reasoner, data):
    vocab = qwen_reasoner.vocab
    candidates = [
        vocab.eos_token_ids[0],
        qwen_reasoner.think_end_id,
        *{t for text in ("12,345", "7", ",", "a", " 9") for t in vocab.encode(text)},
    ]
    _check_against_reference(qwen_reasoner, REGEX, candidates, data)


def test_reasoner_matcher_is_a_matcher():
    backend = _reasoner()
    assert isinstance(backend.matcher(backend.compile(LITERAL)), ReasonerMatcher)
