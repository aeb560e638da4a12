"""Hybrid runs keep a bounded number of compiled grammars and drop every ended request's matcher."""

from __future__ import annotations

import gc
import weakref

import pytest

from cdbench.backends import create_backend
from cdbench.backends.base import ConstraintSpec
from cdbench.backends.registry import register_backend
from cdbench.backends.vocab import load_vocab
from cdbench.backends.xgrammar import XGrammarBackend
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.hybrid import HybridExecutor
from cdbench.harness.policies import policy
from cdbench.harness.run import simulate
from cdbench.workloads.request import Request


class _CountedXGrammar(XGrammarBackend):
    """xgrammar, with weak references to every compiled grammar and matcher it hands out."""

    name = "counted-xgrammar"

    def __init__(self, vocab, **options) -> None:
        super().__init__(vocab, **options)
        self.grammars: weakref.WeakSet = weakref.WeakSet()
        self.matchers: weakref.WeakSet = weakref.WeakSet()
        self.compiles = 0

    def compile(self, spec):
        grammar = super().compile(spec)
        self.compiles += 1
        self.grammars.add(grammar)
        return grammar

    def matcher(self, grammar):
        made = super().matcher(grammar)
        self.matchers.add(made)
        return made


@pytest.fixture(scope="module")
def backend():
    register_backend(_CountedXGrammar.name, _CountedXGrammar)
    return create_backend(_CountedXGrammar.name, load_vocab("cl100k"))


def _digits(vocab, i: int, width: int, spaced: float = 0.02) -> Request:
    """A request for exactly ``width`` digits (its own spec per width), answered with sevens."""
    tokens = tuple(vocab.encode("7" * width)) + (vocab.eos_token_ids[0],)
    return Request(i, spaced * i, 20, len(tokens), ConstraintSpec("regex", rf"\d{{{width}}}"), f"d{width}", tokens)


def _run(backend, requests, name="vllm", kept_grammars=4):
    executor = HybridExecutor(backend, seed=1, kept_grammars=kept_grammars)
    result = simulate(requests, policy(name), executor, FixedGpuCosts(forward_base_s=0.01), seed=1, trace_steps=0)
    gc.collect()
    return executor, result


def _alive(refs) -> int:
    return sum(1 for _ in refs)


def test_ended_requests_leave_no_matcher_and_no_compiled_grammar_behind(backend):
    before = _alive(backend.grammars)
    executor, result = _run(backend, [_digits(backend.vocab, i, i + 1) for i in range(24)])
    assert (result.requests["abort_reason"] == "").all() and result.requests["valid"].all()
    assert _alive(backend.matchers) == 0
    assert _alive(backend.grammars) == before  # 24 specs compiled, none kept once its requests ended
    assert executor.recompiles == 0


def test_a_request_aborted_by_a_refused_token_drops_its_matcher(backend):
    vocab = backend.vocab
    good = _digits(vocab, 0, 3)
    refused = tuple(vocab.encode("ab")) + (vocab.eos_token_ids[0],)
    bad = Request(1, 0.0, 20, len(refused), ConstraintSpec("regex", r"\d{3}"), "d3", refused)
    _, result = _run(backend, [good, bad], "sglang")
    assert result.requests["abort_reason"].tolist() == ["", "grammar_rejected"]
    assert _alive(backend.matchers) == 0


def test_evicted_grammars_are_recompiled_untimed_and_the_timed_compiles_do_not_change(backend):
    # three specs in turn, each arriving after the others were compiled: a bound of one evicts them all
    requests = [_digits(backend.vocab, i, 2 + i % 3, spaced=0.0) for i in range(9)]
    runs = {}
    for kept in (1, 16):
        backend.compiles = 0
        executor, result = _run(backend, requests, kept_grammars=kept)
        runs[kept] = executor, result, backend.compiles
        assert result.requests["valid"].all()
        assert _alive(backend.matchers) == 0
    (small, small_result, small_compiles), (large, large_result, large_compiles) = runs[1], runs[16]
    assert large.recompiles == 0 and large_compiles == 3
    assert small.recompiles > 0 and small_compiles == 3 + small.recompiles
    # one timed compile per spec either way (the others were the untimed recompiles counted above)
    timed = [sorted(r.grammar_profile.compile_by_spec) for r in (small_result, large_result)]
    assert timed[0] == timed[1] == ["d2", "d3", "d4"]
    columns = ["request_id", "output_tokens", "valid", "abort_reason", "cache"]
    assert small_result.requests[columns].equals(large_result.requests[columns])


def test_kept_grammars_must_be_positive(backend):
    with pytest.raises(ValueError, match="kept_grammars"):
        HybridExecutor(backend, kept_grammars=0)
