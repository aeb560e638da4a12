"""Compile cache and async compiler: hits, counters, de-duplication, error and timeout caching.

Compiles are counted by a test-only backend whose compile blocks on a
``threading.Event`` the test opens, so concurrency is controlled, not timed.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import threading

import pytest
import torch

from cdbench.backends.base import (
    CompiledGrammar,
    CompileError,
    ConstraintSpec,
    GrammarBackend,
    Matcher,
)
from cdbench.backends.cache import (
    AsyncCompiler,
    CacheStats,
    CompileCache,
    CompileTimeout,
)
from cdbench.backends.registry import create_backend
from cdbench.backends.vocab import Vocabulary, load_vocab

WAIT_S = 30.0  # generous bound on waits for other threads; never reached when things work

TINY = Vocabulary(
    name="tiny",
    size=40,
    eos_token_ids=(0,),
    special_token_ids=frozenset({0}),
    unused_token_ids=frozenset(),
    token_bytes=(b"<eos>",) + tuple(bytes([97 + i % 26]) for i in range(39)),
)


class GatedBackend(GrammarBackend):
    """Counts compiles; each compile waits until ``gate`` is set; spec ``"bad"`` fails."""

    name = "gated"

    def __init__(self, vocab: Vocabulary = TINY) -> None:
        super().__init__(vocab)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)  # released once per compile that started
        self._lock = threading.Lock()
        self.compiles = 0

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        with self._lock:
            self.compiles += 1
        self.entered.release()
        assert self.gate.wait(WAIT_S), "test never opened the gate"
        if spec.spec == "bad":
            raise CompileError(self.name, spec.kind, "invalid", "bad pattern")
        return CompiledGrammar(self.name, spec, handle=spec.spec)

    def matcher(self, grammar: CompiledGrammar) -> Matcher:
        return CountingMatcher()


class CountingMatcher(Matcher):
    """Allows token ``n + 1`` after ``n`` accepted tokens."""

    def __init__(self) -> None:
        self.n = 0

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        mask[row].zero_()
        mask[row, (self.n + 1) // 32] = 1 << ((self.n + 1) % 32)

    def accept(self, token: int) -> bool:
        if token != self.n + 1:
            return False
        self.n += 1
        return True

    @property
    def history_length(self) -> int:
        return self.n

    def rollback(self, k: int) -> None:
        self.n -= k

    def jump_forward(self) -> list[int]:
        return []

    def is_terminated(self) -> bool:
        return False

    def copy(self) -> Matcher:
        twin = CountingMatcher()
        twin.n = self.n
        return twin


def spec(pattern: str) -> ConstraintSpec:
    return ConstraintSpec("regex", pattern)


def _mask(backend: GrammarBackend, m: Matcher) -> torch.Tensor:
    out = backend.allocate_mask(1)
    m.fill_mask(out, 0)
    return out[0]


# --- CompileCache -------------------------------------------------------------------------


def test_hit_returns_the_same_grammar_and_independent_matchers():
    backend = GatedBackend()
    cache = CompileCache(backend)
    assert cache.get(spec("a+")) is cache.get(spec("a+"))
    first, second = cache.matcher(spec("a+")), cache.matcher(spec("a+"))
    before = _mask(backend, second).clone()
    assert first.accept(1)
    assert torch.equal(_mask(backend, second), before)
    assert backend.compiles == 1
    assert cache.stats == CacheStats(hits=3, misses=1, entries=1)


def test_key_is_options_and_canonical_spec():
    backend = GatedBackend()
    cache = CompileCache(backend)
    a = ConstraintSpec("json_schema", '{"type": "object", "required": ["x"]}')
    b = ConstraintSpec("json_schema", {"type": "object", "required": ["x"]})
    assert cache.key(a) == cache.key(b) == (backend.options_key(), a.canonical())
    cache.get(a)
    assert b in cache and spec("other") not in cache and "text" not in cache
    assert cache.get(b) is cache.get(a)
    assert backend.compiles == 1


def test_option_order_does_not_change_the_key():
    one = ConstraintSpec("ebnf", "root ::= x", {"dialect": "gbnf", "note": 1})
    other = ConstraintSpec("ebnf", "root ::= x", {"note": 1, "dialect": "gbnf"})
    assert one.canonical() == other.canonical() and one == other


def test_property_order_is_part_of_the_key():
    """Engines generate properties in declaration order, so reordered properties are another grammar."""
    backend = GatedBackend()
    cache = CompileCache(backend)
    ab = ConstraintSpec("json_schema", {"type": "object", "properties": {"a": {}, "b": {}}})
    ba = ConstraintSpec("json_schema", {"type": "object", "properties": {"b": {}, "a": {}}})
    assert cache.key(ab) != cache.key(ba) and ab != ba
    assert cache.get(ab) is not cache.get(ba)
    assert backend.compiles == 2


def test_stats_hit_rate():
    cache = CompileCache(GatedBackend())
    assert cache.stats.hit_rate == 0.0
    for pattern in ["a", "a", "a", "b"]:
        cache.get(spec(pattern))
    assert cache.stats.lookups == 4 and cache.stats.hit_rate == 0.5


@pytest.mark.parametrize("cache_errors", [False, True])
def test_errors_are_cached_only_when_asked(cache_errors):
    backend = GatedBackend()
    cache = CompileCache(backend, cache_errors=cache_errors)
    raised = []
    for _ in range(3):
        with pytest.raises(CompileError, match="bad pattern") as info:
            cache.get(spec("bad"))
        raised.append(info.value)
    assert cache.get(spec("fine")).handle == "fine"  # one bad spec never stops the rest
    stats = cache.stats
    if cache_errors:
        assert backend.compiles == 2 and raised[0] is raised[2]
        assert (stats.errors, stats.invalid_hits, stats.misses) == (1, 2, 2)
    else:
        assert backend.compiles == 4
        assert (stats.errors, stats.invalid_hits, stats.misses, stats.entries) == (3, 0, 4, 1)


def test_backend_bug_reaches_the_caller_and_is_not_cached():
    class Broken(GatedBackend):
        def compile(self, spec):
            super().compile(spec)
            raise KeyError("engine bug")

    backend = Broken()
    cache = CompileCache(backend, cache_errors=True)
    for _ in range(2):
        with pytest.raises(KeyError):
            cache.get(spec("a"))
    assert backend.compiles == 2 and len(cache) == 0


def test_lru_eviction_and_zero_entries():
    backend = GatedBackend()
    cache = CompileCache(backend, max_entries=2)
    for pattern in ["a", "b", "a", "c"]:  # "a" was used last before "c", so "b" goes
        cache.get(spec(pattern))
    assert spec("a") in cache and spec("b") not in cache and spec("c") in cache
    assert cache.stats.evictions == 1 and len(cache) == 2
    forgetful = CompileCache(GatedBackend(), max_entries=0)
    forgetful.get(spec("a"))
    forgetful.get(spec("a"))
    assert forgetful.backend.compiles == 2 and len(forgetful) == 0
    with pytest.raises(ValueError, match="max_entries"):
        CompileCache(backend, max_entries=-1)
    cache.clear()
    assert len(cache) == 0


@pytest.mark.parametrize("dedupe", [True, False])
def test_sync_lookups_from_two_threads_share_one_compile_only_with_dedupe(dedupe):
    backend = GatedBackend()
    backend.gate.clear()
    cache = CompileCache(backend, dedupe_in_flight=dedupe)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(cache.get, spec("a"))
        assert backend.entered.acquire(timeout=WAIT_S)  # the first compile is running
        second = pool.submit(cache.get, spec("a"))
        if dedupe:
            _wait_until(lambda: cache.stats.joined == 1)
        else:
            assert backend.entered.acquire(timeout=WAIT_S)  # a second compile started
        backend.gate.set()
        grammars = {id(first.result(WAIT_S)), id(second.result(WAIT_S))}
    assert backend.compiles == len(grammars) == (1 if dedupe else 2)
    assert id(cache.get(spec("a"))) in grammars  # the first grammar stored stays for later hits


def _wait_until(condition) -> None:
    done = threading.Event()
    for _ in range(int(WAIT_S * 100)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition never became true")


# --- AsyncCompiler ------------------------------------------------------------------------


@pytest.mark.parametrize("dedupe, compiles", [(True, 1), (False, 8)])
def test_concurrent_submits_of_one_key(dedupe, compiles):
    backend = GatedBackend()
    backend.gate.clear()
    with AsyncCompiler(backend, threads=4, cache=CompileCache(backend), dedupe_in_flight=dedupe) as pool:
        futures = [pool.submit(spec("a")) for _ in range(8)]
        assert (len({id(f) for f in futures}) == 1) is dedupe
        backend.gate.set()
        grammars = [f.result(WAIT_S) for f in futures]
    assert backend.compiles == compiles
    assert all(g.handle == "a" for g in grammars)
    assert pool.stats.joined == (7 if dedupe else 0)
    assert pool.stats.misses == compiles


def test_without_a_cache_nothing_is_remembered_but_in_flight_is_shared():
    backend = GatedBackend()
    backend.gate.clear()
    with AsyncCompiler(backend, threads=2) as pool:
        a, b = pool.submit(spec("a")), pool.submit(spec("a"))
        assert a is b
        backend.gate.set()
        a.result(WAIT_S)
        pool.submit(spec("a")).result(WAIT_S)
    assert backend.compiles == 2


def test_cached_grammar_comes_back_as_a_done_future():
    backend = GatedBackend()
    cache = CompileCache(backend)
    cache.get(spec("a"))
    with AsyncCompiler(backend, threads=1, cache=cache) as pool:
        future = pool.submit(spec("a"))
        assert future.done() and future.result() is cache.get(spec("a"))
    assert backend.compiles == 1


def test_compile_error_comes_through_the_future():
    backend = GatedBackend()
    with AsyncCompiler(backend, threads=2, cache=CompileCache(backend, cache_errors=True)) as pool:
        with pytest.raises(CompileError, match="bad pattern"):
            pool.submit(spec("bad")).result(WAIT_S)
        assert isinstance(pool.submit(spec("bad")).exception(WAIT_S), CompileError)
        assert pool.submit(spec("ok")).result(WAIT_S).handle == "ok"
    assert backend.compiles == 2


def test_timeout_caches_the_key_as_invalid():
    backend = GatedBackend()
    backend.gate.clear()
    pool = AsyncCompiler(backend, threads=2, cache=CompileCache(backend))
    slow = pool.submit(spec("a"))
    with pytest.raises(concurrent.futures.TimeoutError):
        slow.result(timeout=0.01)  # cannot finish: the gate is closed
    err = pool.mark_timed_out(spec("a"), 0.01)
    assert isinstance(err, CompileTimeout) and err.reason == "timeout" and "0.01 s" in str(err)
    again = pool.submit(spec("a"))
    assert again.done() and again.exception() is err
    backend.gate.set()
    assert slow.result(WAIT_S).handle == "a"  # whoever still waits gets the grammar
    with pytest.raises(CompileTimeout):
        pool.submit(spec("a")).result(WAIT_S)  # the late grammar does not replace the mark
    pool.shutdown()
    assert backend.compiles == 1
    assert pool.stats.timeouts == 1 and pool.stats.invalid_hits == 2


def test_many_threads_many_keys():
    backend = GatedBackend()
    cache = CompileCache(backend)
    patterns = [f"p{i}" for i in range(5)]
    start = threading.Barrier(16)
    with AsyncCompiler(backend, threads=4, cache=cache) as pool:

        def client(seed: int) -> list[CompiledGrammar]:
            start.wait(WAIT_S)
            futures = [pool.submit(spec(patterns[(seed + i) % 5])) for i in range(40)]
            return [f.result(WAIT_S) for f in futures]

        with concurrent.futures.ThreadPoolExecutor(16) as clients:
            results = [g for r in clients.map(client, range(16)) for g in r]
    assert backend.compiles == 5
    by_pattern = {g.handle: g for g in results}
    assert all(g is by_pattern[g.handle] for g in results)  # one grammar object per key
    stats = cache.stats
    assert stats.lookups == 16 * 40 and stats.misses == 5 and stats.entries == 5


def test_shutdown_cancels_queued_compiles():
    backend = GatedBackend()
    backend.gate.clear()
    pool = AsyncCompiler(backend, threads=1, cache=CompileCache(backend))
    running = pool.submit(spec("a"))
    assert backend.entered.acquire(timeout=WAIT_S)
    queued = pool.submit(spec("b"))
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    backend.gate.set()
    assert running.result(WAIT_S).handle == "a"
    assert backend.compiles == 1
    assert pool.cache.get(spec("b")).handle == "b"  # the cancelled key is not stuck in flight


def test_bad_arguments():
    backend = GatedBackend()
    with pytest.raises(ValueError, match="threads"):
        AsyncCompiler(backend, threads=0)
    with pytest.raises(ValueError, match="cache belongs"):
        AsyncCompiler(backend, threads=1, cache=CompileCache(GatedBackend()))


# --- real engines -------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance", "outlines"])
def test_real_engine_hit_gives_independent_matchers(engine):
    if importlib.util.find_spec(f"cdbench.backends.{engine}") is None:
        pytest.skip(f"cdbench.backends.{engine} is not there yet")
    backend = create_backend(engine, load_vocab("cl100k"))
    cache = CompileCache(backend, cache_errors=True)
    phone = spec("[0-9]{3}-[0-9]{4}")
    with AsyncCompiler(backend, threads=2, cache=cache) as pool:
        grammars = [f.result(WAIT_S) for f in [pool.submit(phone) for _ in range(4)]]
    assert all(g is grammars[0] for g in grammars)
    first, second = cache.matcher(phone), cache.matcher(phone)
    before = _mask(backend, second).clone()
    for tok in backend.vocab.encode("555-12"):
        assert first.accept(tok)
    assert torch.equal(_mask(backend, second), before)
    assert not torch.equal(_mask(backend, first), before)
    for _ in range(2):
        with pytest.raises(CompileError):
            cache.get(spec("[a-z"))
    stats = cache.stats
    assert (stats.misses, stats.errors, stats.invalid_hits) == (2, 1, 1)


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance", "outlines"])
def test_real_engine_keeps_schemas_with_reordered_properties_apart(engine):
    """A cache that folded property order would hand the a-first grammar to the b-first schema."""
    backend = create_backend(engine, load_vocab("cl100k"))
    cache = CompileCache(backend)
    properties = {"a": {"type": "integer"}, "b": {"type": "integer"}}

    def schema(order: str) -> ConstraintSpec:
        return ConstraintSpec("json_schema", {"type": "object", "properties": {k: properties[k] for k in order},
                                              "required": ["a", "b"], "additionalProperties": False})

    for order in ("ab", "ba"):
        matcher = cache.matcher(schema(order))
        text = "{" + ", ".join(f'"{k}": {i}' for i, k in enumerate(order, 1)) + "}"
        tokens = [*backend.vocab.encode(text), backend.vocab.eos_token_ids[0]]
        assert all(matcher.accept(t) for t in tokens), f"{text} refused under properties order {order!r}"
    assert cache.stats.misses == 2
