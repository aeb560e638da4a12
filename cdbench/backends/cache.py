"""The compile cache and the asynchronous compile pool.

:class:`CompileCache` remembers compiled grammars per ``(backend.options_key(),
spec.canonical())``; :class:`AsyncCompiler` compiles on a thread pool and
returns futures, like SGLang's grammar backend (``ThreadPoolExecutor`` plus a
dict cache) and vLLM's structured-output manager.

>>> from cdbench.backends import ConstraintSpec, create_backend
>>> cache = CompileCache(create_backend("xgrammar", "qwen3.6"))
>>> spec = ConstraintSpec("regex", "[0-9]{3}")
>>> first, second = cache.matcher(spec), cache.matcher(spec)   # one compile, two matchers
>>> cache.stats.misses, cache.stats.hits
(1, 1)
>>> with AsyncCompiler(cache.backend, threads=4, cache=cache) as pool:
...     grammar = pool.submit(spec).result(timeout=1.0)        # a hit: already done

Threading
---------
Shared between threads: the backend's ``compile`` and ``matcher``, every
:class:`~cdbench.backends.base.CompiledGrammar`, a :class:`CompileCache` and an
:class:`AsyncCompiler` (their tables are guarded by a lock). One thread at a
time: a :class:`~cdbench.backends.base.Matcher` (llguidance raises "Already
borrowed" when two threads use one), so every caller takes its own matcher from
a shared grammar.

Cancelling a future that de-duplication shares cancels it for every request
that shares it; to abort one request, drop its future instead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

from cdbench.backends.base import (
    CompiledGrammar,
    CompileError,
    ConstraintSpec,
    GrammarBackend,
    Matcher,
)

__all__ = ["AsyncCompiler", "CacheStats", "CompileCache", "CompileTimeout"]

CacheKey = tuple[str, str]


class CompileTimeout(CompileError):
    """A key whose compile outlived the caller's timeout, cached as invalid (as SGLang does)."""

    def __init__(self, backend: str, kind: str, timeout_s: float | None = None) -> None:
        after = f"after {timeout_s:g} s" if timeout_s is not None else "by the caller"
        super().__init__(backend, kind, "timeout", f"compile timed out {after}; key cached as invalid")
        self.timeout_s = timeout_s


@dataclass(frozen=True)
class CacheStats:
    """Counters of one :class:`CompileCache` (a snapshot).

    ``hits`` were served a finished grammar, ``invalid_hits`` a cached error,
    ``joined`` an in-flight compile of the same key; ``misses`` started a
    compile; ``errors`` counts compiles that raised :class:`CompileError`.
    """

    hits: int = 0
    invalid_hits: int = 0
    joined: int = 0
    misses: int = 0
    errors: int = 0
    timeouts: int = 0
    evictions: int = 0
    entries: int = 0

    @property
    def lookups(self) -> int:
        return self.hits + self.invalid_hits + self.joined + self.misses

    @property
    def hit_rate(self) -> float:
        """Share of lookups that did not start a compile (0.0 before any lookup)."""
        return 0.0 if not self.lookups else 1.0 - self.misses / self.lookups


class CompileCache:
    """Compiled grammars of one backend, keyed by its options and the spec's canonical text.

    Parameters
    ----------
    backend : the backend that compiles on a miss.
    dedupe_in_flight : a lookup of a key that is being compiled waits for that
        compile instead of starting another (SGLang does not de-duplicate).
    cache_errors : remember a :class:`CompileError` and raise it again on the
        next lookup, without compiling (SGLang caches an ``InvalidGrammarObject``).
    max_entries : keep at most this many keys, dropping the least recently used;
        ``None`` is unbounded, ``0`` remembers nothing.

    A hit returns the very same :class:`CompiledGrammar`; take a matcher per
    request from it (:meth:`matcher`), never share one.
    """

    def __init__(
        self,
        backend: GrammarBackend,
        *,
        dedupe_in_flight: bool = True,
        cache_errors: bool = False,
        max_entries: int | None = None,
    ) -> None:
        if max_entries is not None and max_entries < 0:
            raise ValueError(f"max_entries must be None or >= 0, got {max_entries}")
        self.backend = backend
        self.dedupe_in_flight = dedupe_in_flight
        self.cache_errors = cache_errors
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[CacheKey, CompiledGrammar | CompileError] = OrderedDict()
        self._in_flight: dict[CacheKey, Future[CompiledGrammar]] = {}
        self._counts = dict.fromkeys(("hits", "invalid_hits", "joined", "misses", "errors", "timeouts", "evictions"), 0)

    def key(self, spec: ConstraintSpec) -> CacheKey:
        return (self.backend.options_key(), spec.canonical())

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**self._counts, entries=len(self._entries))

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, spec: object) -> bool:
        if not isinstance(spec, ConstraintSpec):
            return False
        key = self.key(spec)
        with self._lock:
            return key in self._entries

    def clear(self) -> None:
        """Forget every finished entry (compiles in flight still complete)."""
        with self._lock:
            self._entries.clear()

    def get(self, spec: ConstraintSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec``, compiling in this thread on a miss.

        Raises the :class:`CompileError` of the compile (or the cached one).
        """
        future, owner = self.claim(spec)
        if owner:
            self.compile_into(spec, future)
        return future.result()

    def matcher(self, spec: ConstraintSpec) -> Matcher:
        """A fresh matcher on the (possibly cached) compiled grammar of ``spec``."""
        return self.backend.matcher(self.get(spec))

    def claim(self, spec: ConstraintSpec, *, dedupe: bool | None = None) -> tuple[Future[CompiledGrammar], bool]:
        """Look ``spec`` up: a future of its grammar, and whether the caller must compile it.

        A finished entry gives a done future; an in-flight compile (with
        de-duplication; ``dedupe`` overrides the cache's setting) gives its
        future; otherwise a new pending future the caller completes with
        :meth:`compile_into`.
        """
        key = self.key(spec)
        dedupe = self.dedupe_in_flight if dedupe is None else dedupe
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                done: Future[CompiledGrammar] = Future()
                if isinstance(entry, CompileError):
                    self._counts["invalid_hits"] += 1
                    done.set_exception(entry)
                else:
                    self._counts["hits"] += 1
                    done.set_result(entry)
                return done, False
            if dedupe and key in self._in_flight:
                self._counts["joined"] += 1
                return self._in_flight[key], False
            self._counts["misses"] += 1
            future: Future[CompiledGrammar] = Future()
            if dedupe:
                self._in_flight[key] = future
            return future, True

    def compile_into(self, spec: ConstraintSpec, future: Future[CompiledGrammar]) -> None:
        """Compile ``spec`` and complete ``future`` (from :meth:`claim`), storing the outcome."""
        key = self.key(spec)
        if not future.set_running_or_notify_cancel():
            self._forget_in_flight(key, future)
            return
        try:
            grammar = self.backend.compile(spec)
        except CompileError as err:
            with self._lock:
                self._counts["errors"] += 1
                if self.cache_errors:
                    self._store(key, err)
                self._forget_in_flight(key, future, locked=True)
            future.set_exception(err)
        except BaseException as err:  # a backend bug: surface it to every waiter, cache nothing
            self._forget_in_flight(key, future)
            future.set_exception(err)
        else:
            with self._lock:
                self._store(key, grammar)
                self._forget_in_flight(key, future, locked=True)
            future.set_result(grammar)

    def mark_timed_out(self, spec: ConstraintSpec, timeout_s: float | None = None) -> CompileTimeout:
        """Cache ``spec``'s key as invalid because its compile took too long.

        Later lookups raise the returned :class:`CompileTimeout` without
        compiling, also after the slow compile finishes (unless ``max_entries``
        is 0: then nothing is remembered). Callers still waiting on its future
        get its result.
        """
        key = self.key(spec)
        err = CompileTimeout(self.backend.name, spec.kind, timeout_s)
        with self._lock:
            self._counts["timeouts"] += 1
            self._entries.pop(key, None)
            self._store(key, err)
            self._in_flight.pop(key, None)
        return err

    def _store(self, key: CacheKey, value: CompiledGrammar | CompileError) -> None:
        # Called under the lock. A timeout mark wins over a compile finishing later,
        # and the first grammar stored stays, so hits keep returning the same object.
        if self.max_entries == 0 or key in self._entries:
            return
        self._entries[key] = value
        if self.max_entries is not None and len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self._counts["evictions"] += 1

    def _forget_in_flight(self, key: CacheKey, future: Future[CompiledGrammar], locked: bool = False) -> None:
        if locked:
            if self._in_flight.get(key) is future:
                del self._in_flight[key]
            return
        with self._lock:
            self._forget_in_flight(key, future, locked=True)


class AsyncCompiler:
    """Compiles specs on a pool of ``threads`` worker threads.

    Parameters
    ----------
    backend : the backend whose ``compile`` the workers call.
    threads : pool size (SGLang: ``min(32, CPUs + 4)``; vLLM: ``(CPUs + 1) // 2``).
    cache : finished grammars to reuse and store; ``None`` remembers nothing, so
        every submit that is not de-duplicated compiles.
    dedupe_in_flight : concurrent submits of one key share one future; ``None``
        takes the cache's setting (on without a cache).

    A scheduler's poll, SGLang style::

        with AsyncCompiler(backend, threads=8, cache=CompileCache(backend)) as pool:
            future = pool.submit(spec)
            try:
                grammar = future.result(timeout=30.0)
            except concurrent.futures.TimeoutError:
                pool.mark_timed_out(spec, 30.0)  # later submits of spec fail at once
    """

    def __init__(
        self,
        backend: GrammarBackend,
        threads: int,
        cache: CompileCache | None = None,
        dedupe_in_flight: bool | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if cache is not None and cache.backend is not backend:
            raise ValueError(
                f"cache belongs to backend {cache.backend.options_key()!r}, not {backend.options_key()!r}"
            )
        self.backend = backend
        self.threads = threads
        self.cache = cache if cache is not None else CompileCache(
            backend, dedupe_in_flight=True if dedupe_in_flight is None else dedupe_in_flight, max_entries=0
        )
        self.dedupe_in_flight = self.cache.dedupe_in_flight if dedupe_in_flight is None else dedupe_in_flight
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"compile-{backend.name}")

    def submit(self, spec: ConstraintSpec) -> Future[CompiledGrammar]:
        """A future of ``spec``'s grammar; it raises :class:`CompileError` for a bad spec."""
        future, owner = self.cache.claim(spec, dedupe=self.dedupe_in_flight)
        if owner:
            job = self._pool.submit(self.cache.compile_into, spec, future)
            # A job dropped by shutdown(cancel_futures=True) must not leave its waiters hanging.
            job.add_done_callback(lambda j: self._abandon(spec, future) if j.cancelled() else None)
        return future

    def _abandon(self, spec: ConstraintSpec, future: Future[CompiledGrammar]) -> None:
        self.cache._forget_in_flight(self.cache.key(spec), future)
        future.cancel()

    def mark_timed_out(self, spec: ConstraintSpec, timeout_s: float | None = None) -> CompileTimeout:
        """Cache ``spec``'s key as invalid (see :meth:`CompileCache.mark_timed_out`)."""
        return self.cache.mark_timed_out(spec, timeout_s)

    @property
    def stats(self) -> CacheStats:
        return self.cache.stats

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the workers; ``cancel_futures`` cancels compiles not yet started."""
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)

    def __enter__(self) -> AsyncCompiler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown(wait=True)
