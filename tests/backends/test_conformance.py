"""One conformance suite for every engine × vocabulary × constraint kind it supports.

Ids read ``<engine>-<vocab>-<kind>-<case>``, e.g. ``xgrammar-qwen3.6-regex-phone``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cases import (ENGINES, EMBEDDED, MALFORMED, VOCABS, Case, allowed_ids, case_id, corpus_cases, is_allowed,
                   mask_bits, shared_dir)

from cdbench.backends import CompileError

CASES = EMBEDDED + corpus_cases()


def _supports(engine: str, case: Case) -> bool:
    return not (engine == "outlines" and case.kind == "ebnf")


def _slow(engine: str, vocab: str, case: Case) -> bool:
    # outlines builds a token index per grammar: ~1 s per corpus item on the
    # large vocabularies; the embedded cases keep them covered by default.
    return engine == "outlines" and vocab != "cl100k" and case in corpus_cases()


def _params(cases=CASES, engines=ENGINES, vocabs=VOCABS):
    return [
        pytest.param(engine, vocab, case, id=f"{engine}-{vocab}-{case_id(case)}",
                     marks=[pytest.mark.slow] if _slow(engine, vocab, case) else [])
        for engine in engines for vocab in vocabs for case in cases if _supports(engine, case)
    ]


def _setup(engines, engine: str, vocab: str, case: Case):
    backend = engines.backend(engine, vocab)
    return backend, engines.compiled(engine, vocab, case.spec), backend.vocab


@pytest.mark.parametrize(("engine", "vocab", "case"), _params())
def test_valid_instances_are_accepted_token_by_token(engines, engine, vocab, case):
    backend, grammar, voc = _setup(engines, engine, vocab, case)
    mask = backend.allocate_mask(1)
    eos = voc.eos_token_ids[0]
    for text in case.valid:
        matcher = backend.matcher(grammar)
        tokens = voc.encode(text)
        for i, token in enumerate(tokens):
            matcher.fill_mask(mask, 0)
            assert is_allowed(mask, 0, token), f"token {i} {voc.decode([token])!r} of {text!r} is masked"
            if case.eos_only_at_end:
                assert not is_allowed(mask, 0, eos), f"EOS allowed after {voc.decode(tokens[:i])!r}"
            assert matcher.accept(token), f"token {i} {voc.decode([token])!r} of {text!r} rejected"
            assert not matcher.is_terminated()
        matcher.fill_mask(mask, 0)
        assert is_allowed(mask, 0, eos), f"EOS masked at the end of {text!r}"
        assert matcher.accept(eos)
        assert matcher.is_terminated()
        assert not matcher.accept(tokens[0]), "a terminated matcher accepted a token"


@pytest.mark.parametrize(("engine", "vocab", "case"), _params([c for c in CASES if c.invalid]))
def test_invalid_strings_are_rejected_at_the_first_bad_token(engines, engine, vocab, case):
    backend, grammar, voc = _setup(engines, engine, vocab, case)
    mask, after = backend.allocate_mask(1), backend.allocate_mask(1)
    for prefix, bad in case.invalid:
        matcher = backend.matcher(grammar)
        for token in voc.encode(prefix):
            assert matcher.accept(token), f"valid prefix {prefix!r} rejected"
        bad_token = voc.encode(bad)[0]
        matcher.fill_mask(mask, 0)
        assert not is_allowed(mask, 0, bad_token), f"{voc.decode([bad_token])!r} allowed after {prefix!r}"
        assert matcher.accept(bad_token) is False
        matcher.fill_mask(after, 0)
        assert torch.equal(mask, after), "a rejected token changed the state"


@pytest.mark.parametrize(("engine", "vocab", "case"), _params())
def test_rollback_restores_the_exact_mask(engines, engine, vocab, case):
    backend, grammar, voc = _setup(engines, engine, vocab, case)
    tokens = voc.encode(case.valid[0])
    matcher = backend.matcher(grammar)
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
        matcher.fill_mask(row, 0)
        assert torch.equal(row, history[n - k]), f"mask after rollback({k}) differs from step {n - k}"
        for token in tokens[n - k:]:
            assert matcher.accept(token)
        matcher.fill_mask(row, 0)
        assert torch.equal(row, history[n])


@pytest.mark.parametrize(("engine", "vocab", "case"), _params())
def test_jump_forward_tokens_are_allowed_and_accepted(engines, engine, vocab, case):
    backend, grammar, voc = _setup(engines, engine, vocab, case)
    matcher = backend.matcher(grammar)
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
    backend, grammar, voc = _setup(engines, engine, "cl100k", case)
    forced = voc.decode(backend.matcher(grammar).jump_forward())
    assert len(forced) >= 3 and case.valid[0].startswith(forced), forced


@pytest.mark.parametrize(
    ("engine", "case_name", "spec", "reason"),
    [pytest.param(engine, name, spec, "unsupported" if engine == "outlines" and spec.kind == "ebnf" else reason,
                  id=f"{engine}-{name}")
     for engine in ENGINES for name, spec, reason in MALFORMED],
)
def test_malformed_specs_raise_compile_error(engines, engine, case_name, spec, reason):
    with pytest.raises(CompileError) as info:
        engines.backend(engine, "cl100k").compile(spec)
    error = info.value
    assert (error.backend, error.kind, error.reason) == (engine, spec.kind, reason), error


def _comparable_params():
    cases = [c for c in CASES if c.comparable]
    return [pytest.param(vocab, case, id=f"{vocab}-{case_id(case)}",
                         marks=[pytest.mark.slow] if _slow("outlines", vocab, case) else [])
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


@pytest.mark.parametrize(("engine", "vocab", "case"), _params(TEXT_CASES))
def test_no_special_token_is_ever_allowed_inside_text(engines, engine, vocab, case):
    backend, grammar, voc = _setup(engines, engine, vocab, case)
    forbidden = np.array(sorted(voc.forbidden_token_ids))
    eos = np.array(voc.eos_token_ids)
    matcher = backend.matcher(grammar)
    mask = backend.allocate_mask(1)
    tokens = voc.encode(case.valid[0])
    for step, token in enumerate(tokens):
        matcher.fill_mask(mask, 0)
        leaked = np.intersect1d(allowed_ids(mask, 0, voc.size), forbidden)
        assert leaked.size == 0, f"after {voc.decode(tokens[:step])!r}: {[voc.token_bytes[i] for i in leaked[:5]]}"
        assert matcher.accept(token)
    matcher.fill_mask(mask, 0)
    np.testing.assert_array_equal(np.intersect1d(allowed_ids(mask, 0, voc.size), forbidden), eos)


@pytest.mark.parametrize(("engine", "vocab", "case"), _params([c for c in EMBEDDED if c.kind != "ebnf"] +
                                                                [c for c in EMBEDDED if c.kind == "ebnf"][:1],
                                                                vocabs=("cl100k",)))
def test_copy_is_independent_of_the_original(engines, engine, vocab, case):
    backend, grammar, voc = _setup(engines, engine, vocab, case)
    tokens = voc.encode(case.valid[0])
    half = len(tokens) // 2
    original = backend.matcher(grammar)
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
