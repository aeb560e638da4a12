"""One conformance suite for every backend × vocabulary × constraint kind it supports.

Subjects are the three engines, the ``none`` backend (where a test means
something for it) and the reasoner over each engine, either with thinking off
or after a think span the grammar would forbid (``'</think>'`` is one token in
deepseek-v4 and qwen3.6 only, so the reasoner skips cl100k). Ids read
``<subject>-<vocab>-<kind>-<case>``, e.g. ``xgrammar-qwen3.6-regex-phone`` or
``reasoner-think-llguidance-qwen3.6-json_schema-person``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from cases import (
    EMBEDDED,
    ENGINES,
    MALFORMED,
    VOCABS,
    Case,
    allowed_ids,
    case_id,
    corpus_cases,
    is_allowed,
    is_complete,
    mask_bits,
    shared_dir,
)

from cdbench.backends import CompileError

CASES = EMBEDDED + corpus_cases()
# Thinking the answer's grammar forbids: the constraint must not apply to it.
THOUGHT = 'Hmm, {"not": the answer} <tool_call> 42?'


@dataclass(frozen=True)
class Subject:
    """What a test drives: ``engine`` alone, or the reasoner over it (``reasoner`` = ``off`` or ``think``)."""

    engine: str
    reasoner: str | None = None

    @property
    def id(self) -> str:
        return f"reasoner-{self.reasoner}-{self.engine}" if self.reasoner else self.engine


ENGINE_SUBJECTS = tuple(Subject(e) for e in ENGINES)
NONE = Subject("none")
REASONERS = tuple(Subject(e, mode) for e in ENGINES for mode in ("off", "think"))
ALL = ENGINE_SUBJECTS + (NONE,) + REASONERS


def _supports(subject: Subject, vocab: str, case: Case) -> bool:
    if subject.reasoner and vocab == "cl100k":
        return False  # '</think>' is three tokens there; the reasoner refuses it (test_reasoner.py)
    return not (subject.engine == "outlines" and case.kind == "ebnf")


def _slow(subject: Subject, vocab: str, case: Case) -> bool:
    # outlines builds a token index per grammar: ~1 s per corpus item on the
    # large vocabularies; the embedded cases keep them covered by default.
    # The reasoner runs on qwen3.6 by default, deepseek-v4 with the slow tests;
    # with thinking off it hands every call to the engine, so by default it
    # runs over one engine only.
    corpus = case in corpus_cases()
    return ((subject.engine == "outlines" and vocab != "cl100k" and corpus)
            or (subject.reasoner is not None and (vocab == "deepseek-v4" or corpus))
            or (subject.reasoner == "off" and subject.engine != "xgrammar"))


def _params(cases=CASES, subjects=ALL, vocabs=VOCABS, slow_subjects=()):
    """``slow_subjects`` run only with the slow tests (where the test only repeats what the wrapped engine does)."""
    return [
        pytest.param(subject, vocab, case, id=f"{subject.id}-{vocab}-{case_id(case)}",
                     marks=[pytest.mark.slow] if subject in slow_subjects or _slow(subject, vocab, case) else [])
        for subject in subjects for vocab in vocabs for case in cases if _supports(subject, vocab, case)
    ]


def _setup(engines, subject: Subject, vocab: str, case: Case):
    """The backend, a factory of matchers at the start of the answer, and the tokens each accepted before it."""
    grammar = engines.compiled(subject.engine, vocab, case.spec)
    if subject.reasoner is None:
        backend = engines.backend(subject.engine, vocab)
        return backend, lambda: backend.matcher(grammar), 0
    backend = engines.reasoner(subject.engine, vocab)
    if subject.reasoner == "off":
        return backend, lambda: backend.matcher(grammar, thinking=False), 0
    thought = backend.vocab.encode(THOUGHT)

    def after_thinking():
        matcher = backend.matcher(grammar)
        assert all(matcher.accept(t) for t in thought) and matcher.accept(backend.think_end_id)
        assert not matcher.thinking
        return matcher

    return backend, after_thinking, len(thought) + 1


def _check_thinking_allows_everything(engines, subject: Subject, vocab: str, case: Case) -> None:
    """While thinking every token is allowed, the grammar's and EOS included."""
    backend = engines.reasoner(subject.engine, vocab)
    matcher = backend.matcher(engines.compiled(subject.engine, vocab, case.spec))
    mask = backend.allocate_mask(1)
    for token in backend.vocab.encode(THOUGHT):
        mask.zero_()
        matcher.fill_mask(mask, 0)
        assert bool((mask == -1).all()), f"{subject.id}: a thinking row forbids something"
        assert matcher.accept(token)


@pytest.mark.parametrize(("subject", "vocab", "case"), _params())
def test_valid_instances_are_accepted_token_by_token(engines, subject, vocab, case):
    """Each token is allowed before it is accepted, EOS is allowed exactly where
    the text so far is itself an instance (where an oracle exists), and EOS ends it."""
    backend, start, before_answer = _setup(engines, subject, vocab, case)
    voc = backend.vocab
    if subject.reasoner == "think":
        _check_thinking_allows_everything(engines, subject, vocab, case)
    mask = backend.allocate_mask(1)
    eos = voc.eos_token_ids[0]
    for text in case.valid:
        matcher = start()
        tokens = voc.encode(text)
        for i, token in enumerate(tokens):
            matcher.fill_mask(mask, 0)
            assert is_allowed(mask, 0, token), f"token {i} {voc.decode([token])!r} of {text!r} is masked"
            if subject is NONE:
                assert bool((mask == -1).all()), "the none backend forbade a token"
            else:
                _check_eos_where_complete(case, voc, tokens[:i], is_allowed(mask, 0, eos))
            assert matcher.accept(token), f"token {i} {voc.decode([token])!r} of {text!r} rejected"
            assert not matcher.is_terminated()
            assert matcher.history_length == before_answer + i + 1
        matcher.fill_mask(mask, 0)
        assert is_allowed(mask, 0, eos), f"EOS masked at the end of {text!r}"
        assert matcher.accept(eos)
        assert matcher.is_terminated() and matcher.history_length == before_answer + len(tokens) + 1
        assert not matcher.accept(tokens[0]), "a terminated matcher accepted a token"


def _check_eos_where_complete(case: Case, voc, prefix: list[int], eos_allowed: bool) -> None:
    try:
        text = b"".join(voc.token_bytes[t] for t in prefix).decode("utf-8")
    except UnicodeDecodeError:
        complete = False  # half a character is never a whole instance
    else:
        complete = is_complete(case, text)
    if complete is not None:
        assert eos_allowed == complete, f"EOS {'masked' if complete else 'allowed'} after {text!r}"


# The reasoner hands an answer-phase accept and jump_forward straight to the engine: slow only.
@pytest.mark.parametrize(("subject", "vocab", "case"), _params([c for c in CASES if c.invalid],
                                                                 subjects=ENGINE_SUBJECTS + REASONERS,
                                                                 slow_subjects=REASONERS))
def test_invalid_strings_are_rejected_at_the_first_bad_token(engines, subject, vocab, case):
    backend, start, before_answer = _setup(engines, subject, vocab, case)
    voc = backend.vocab
    mask, after = backend.allocate_mask(1), backend.allocate_mask(1)
    for prefix, bad in case.invalid:
        matcher = start()
        for token in voc.encode(prefix):
            assert matcher.accept(token), f"valid prefix {prefix!r} rejected"
        bad_token = voc.encode(bad)[0]
        matcher.fill_mask(mask, 0)
        assert not is_allowed(mask, 0, bad_token), f"{voc.decode([bad_token])!r} allowed after {prefix!r}"
        assert matcher.accept(bad_token) is False
        assert matcher.history_length == before_answer + len(voc.encode(prefix))
        matcher.fill_mask(after, 0)
        assert torch.equal(mask, after), "a rejected token changed the state"


@pytest.mark.parametrize(("subject", "vocab", "case"), _params())
def test_rollback_restores_the_exact_mask(engines, subject, vocab, case):
    backend, start, before_answer = _setup(engines, subject, vocab, case)
    voc = backend.vocab
    tokens = voc.encode(case.valid[0])
    matcher = start()
    row = backend.allocate_mask(1)
    history = []
    for token in tokens:
        matcher.fill_mask(row, 0)
        history.append(row.clone())
        assert matcher.accept(token)
    matcher.fill_mask(row, 0)
    history.append(row.clone())
    assert matcher.accept(voc.eos_token_ids[0])
    matcher.rollback(1)
    assert not matcher.is_terminated()
    n = len(tokens)
    for k in sorted({1, 2, n // 2, n} - {0}):
        if k > n:
            continue
        matcher.rollback(k)
        assert matcher.history_length == before_answer + n - k
        matcher.fill_mask(row, 0)
        assert torch.equal(row, history[n - k]), f"mask after rollback({k}) differs from step {n - k}"
        for token in tokens[n - k:]:
            assert matcher.accept(token)
        matcher.fill_mask(row, 0)
        assert torch.equal(row, history[n])
    for k in (n + before_answer + 1, -1):  # refused, and nothing changes
        with pytest.raises(ValueError):
            matcher.rollback(k)
        matcher.fill_mask(row, 0)
        assert torch.equal(row, history[n]), f"a refused rollback({k}) changed the mask"
        assert matcher.history_length == before_answer + n
    if subject.reasoner == "think":  # back across think-end into thinking, and forward again
        matcher.rollback(n + 1)
        assert matcher.thinking
        matcher.fill_mask(row, 0)
        assert bool((row == -1).all())
        assert matcher.accept(backend.think_end_id) and all(matcher.accept(t) for t in tokens)
        matcher.fill_mask(row, 0)
        assert torch.equal(row, history[n])


@pytest.mark.parametrize(("subject", "vocab", "case"), _params(slow_subjects=REASONERS))
def test_jump_forward_tokens_are_allowed_and_accepted(engines, subject, vocab, case):
    backend, start, _ = _setup(engines, subject, vocab, case)
    voc = backend.vocab
    matcher = start()
    mask, before, after = (backend.allocate_mask(1) for _ in range(3))
    text = case.valid[0]
    for token in [*voc.encode(text), None]:
        matcher.fill_mask(before, 0)
        forced = matcher.jump_forward()
        matcher.fill_mask(after, 0)
        assert torch.equal(before, after), "jump_forward changed the state"
        probe = matcher.copy()
        for i, f in enumerate(forced):
            probe.fill_mask(mask, 0)
            assert is_allowed(mask, 0, f), f"forced token {i} {voc.decode([f])!r} is masked"
            assert probe.accept(f), f"forced token {i} {voc.decode([f])!r} rejected"
        if token is not None:
            assert matcher.accept(token)


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("case", [c for c in EMBEDDED if c.id in ("person", "tool-call")], ids=case_id)
def test_jump_forward_forces_the_fixed_opening(engines, engine, case):
    backend, start, _ = _setup(engines, Subject(engine), "cl100k", case)
    forced = backend.vocab.decode(start().jump_forward())
    assert len(forced) >= 3 and case.valid[0].startswith(forced), forced


@pytest.mark.parametrize(
    ("engine", "vocab", "case_name", "spec", "reason"),
    [pytest.param(engine, vocab, name, spec,
                  "unsupported" if engine == "outlines" and spec.kind == "ebnf" else reason,
                  id=f"{engine}-{vocab}-{name}")
     for engine in ENGINES for vocab in VOCABS for name, spec, reason in MALFORMED],
)
def test_malformed_specs_raise_compile_error(engines, engine, vocab, case_name, spec, reason):
    with pytest.raises(CompileError) as info:
        engines.backend(engine, vocab).compile(spec)
    error = info.value
    assert (error.backend, error.kind, error.reason) == (engine, spec.kind, reason), error


def _comparable_params():
    cases = [c for c in CASES if c.comparable]
    return [pytest.param(vocab, case, id=f"{vocab}-{case_id(case)}",
                         marks=[pytest.mark.slow] if _slow(Subject("outlines"), vocab, case) else [])
            for vocab in VOCABS for case in cases]


@pytest.mark.parametrize(("vocab", "case"), _comparable_params())
def test_engines_allow_identical_tokens_at_every_step(engines, vocab, case):
    """Same language, same whitespace: the engines must agree bit for bit.

    outlines must equal xgrammar everywhere. llguidance must too, except where
    the next bytes are forced (xgrammar's jump-forward is not empty): there
    llguidance by design allows only the canonical tokenization of the forced
    text (after "Ped" of "Pedestrian" it allows "est" but not "e" or "es"), so
    its set must be a non-empty subset of xgrammar's.

    Only cases marked ``comparable`` take part: free JSON strings differ
    legitimately (outlines forbids raw U+007F-U+009F), and outlines-core 0.2.14
    drops tokens that leave a final state for a non-final one (see
    test_engines.py), so instances never pass through such a state.
    """
    backends = {e: engines.backend(e, vocab) for e in ENGINES}
    voc = backends["xgrammar"].vocab
    mask = backends["xgrammar"].allocate_mask(1)
    for text in case.valid[:2]:
        matchers = {e: b.matcher(engines.compiled(e, vocab, case.spec)) for e, b in backends.items()}
        tokens = voc.encode(text)
        for step, token in enumerate([*tokens, voc.eos_token_ids[0]]):
            bits = {}
            for engine, matcher in matchers.items():
                matcher.fill_mask(mask, 0)
                bits[engine] = mask_bits(mask, 0, voc.size)
            where = f"after {voc.decode(tokens[:step])!r}"
            _assert_same(bits["outlines"], bits["xgrammar"], voc, f"outlines vs xgrammar {where}")
            if matchers["xgrammar"].jump_forward():
                assert bits["llguidance"].any(), f"llguidance allows nothing {where}"
                _assert_same(bits["llguidance"] & bits["xgrammar"], bits["llguidance"], voc,
                             f"llguidance allows tokens xgrammar does not {where}")
            else:
                _assert_same(bits["llguidance"], bits["xgrammar"], voc, f"llguidance vs xgrammar {where}")
            for matcher in matchers.values():
                assert matcher.accept(token)


def _assert_same(bits: np.ndarray, reference: np.ndarray, voc, message: str) -> None:
    differ = np.flatnonzero(bits != reference)
    assert differ.size == 0, f"{message}: {[voc.decode([int(t)]) for t in differ[:10]]} ({differ.size} ids differ)"


TEXT_CASES = [c for c in EMBEDDED if c.free_text]


THINKERS = tuple(s for s in REASONERS if s.reasoner == "think")


# After thinking the inner grammar is the engine's own; one engine checks it by default.
@pytest.mark.parametrize(("subject", "vocab", "case"),
                         _params(TEXT_CASES, subjects=ENGINE_SUBJECTS + THINKERS,
                                 slow_subjects=(Subject("xgrammar", "think"), Subject("outlines", "think"))))
def test_no_special_token_is_ever_allowed_inside_text(engines, subject, vocab, case):
    backend, start, _ = _setup(engines, subject, vocab, case)
    voc = backend.vocab
    forbidden = np.array(sorted(voc.forbidden_token_ids))
    eos = np.array(voc.eos_token_ids)
    matcher = start()
    mask = backend.allocate_mask(1)
    tokens = voc.encode(case.valid[0])
    for step, token in enumerate(tokens):
        matcher.fill_mask(mask, 0)
        leaked = np.intersect1d(allowed_ids(mask, 0, voc.size), forbidden)
        assert leaked.size == 0, f"after {voc.decode(tokens[:step])!r}: {[voc.token_bytes[i] for i in leaked[:5]]}"
        assert matcher.accept(token)
    matcher.fill_mask(mask, 0)
    np.testing.assert_array_equal(np.intersect1d(allowed_ids(mask, 0, voc.size), forbidden), eos)


COPY_CASES = [c for c in EMBEDDED if c.kind != "ebnf"] + [c for c in EMBEDDED if c.kind == "ebnf"][:1]


@pytest.mark.parametrize(("subject", "vocab", "case"),
                         _params(COPY_CASES, subjects=ENGINE_SUBJECTS + (NONE,), vocabs=("cl100k",))
                         + _params(COPY_CASES, subjects=REASONERS, vocabs=("qwen3.6",)))
def test_copy_is_independent_of_the_original(engines, subject, vocab, case):
    backend, start, _ = _setup(engines, subject, vocab, case)
    voc = backend.vocab
    tokens = voc.encode(case.valid[0])
    half = len(tokens) // 2
    original = start()
    for token in tokens[:half]:
        assert original.accept(token)
    twin = original.copy()
    at_copy, mask = backend.allocate_mask(1), backend.allocate_mask(1)
    original.fill_mask(at_copy, 0)
    twin.fill_mask(mask, 0)
    assert torch.equal(at_copy, mask)
    for token in [*tokens[half:], voc.eos_token_ids[0]]:
        assert original.accept(token)
    assert original.is_terminated() and not twin.is_terminated()
    twin.fill_mask(mask, 0)
    assert torch.equal(at_copy, mask), "advancing the original moved the copy"
    for token in [*tokens[half:], voc.eos_token_ids[0]]:
        assert twin.accept(token)
    twin.rollback(1)
    assert original.is_terminated() and not twin.is_terminated()


def test_corpus_cases_are_used_when_the_corpus_is_present():
    if not (shared_dir() / "corpora").exists():
        pytest.skip(f"no corpus at {shared_dir() / 'corpora'}")
    kinds = {case.kind for case in corpus_cases()}
    assert kinds == {"regex", "json_schema", "ebnf", "choice"}
