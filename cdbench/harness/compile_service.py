"""The asynchronous compile service: per-rank thread pools and the compiled-grammar cache.

Compiles are submitted in time order, so a pool of ``N`` threads is exact as a
heap of thread free times: a compile starts on the earliest free thread (FIFO
when all are busy) and ends ``seconds`` later. Each of ``R`` ranks has its own
pool and compiles every spec itself, with its own jitter. With the host's
cores given (:class:`~cdbench.harness.contention.HostCores`), a compile that
starts while the running compiles and the scheduler loops outnumber the cores
takes longer by their demand over the cores.

>>> pools = CompilePools(ranks=1, threads=1)
>>> pools.submit(0.0, 0.010, np.random.default_rng(0))[1].tolist()   # ends
[0.01]
>>> pools.submit(0.002, 0.010, np.random.default_rng(0))[0].tolist()  # queued behind the first
[0.01]
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_left, bisect_right, insort
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import numpy as np

from cdbench.harness.contention import HostCores


class CompilePools:
    """``ranks`` independent pools of ``threads`` compile threads each.

    ``jitter`` is the sigma of each rank's compile time about the spec's (a lognormal); the time given is
    one rank's draw (rank 0's: a grammar profile is measured in one process), so each other rank's is it
    times the ratio of two draws, a lognormal of sigma ``jitter * sqrt(2)``, and one rank alone has none;
    ``jitter_by_size``: ``(seconds, sigma)`` points that give a compile of its seconds its own sigma
    (interpolated in log seconds, flat beyond) in place of ``jitter``;
    ``scale`` multiplies each rank's compile times (a slow rank); ``host``:
    the cores every rank's pool shares, which stretch a compile that starts
    beside too many others (``None``: compiles never contend).

    >>> pools = CompilePools(ranks=1, threads=4, host=HostCores(cores=2))
    >>> [pools.submit_one(0.0, 1.0)[1] for _ in range(3)]  # 1 + 1 loop, 2 + 1, 3 + 1 threads on 2 cores
    [1.0, 1.5, 2.0]
    >>> pools.running(0.5), pools.running(1.2), pools.next_free(1.2)
    (3, 2, 1.5)
    """

    def __init__(self, ranks: int, threads: int, jitter: float = 0.0,
                 scale: tuple[float, ...] | None = None, host: HostCores | None = None,
                 jitter_by_size: tuple[tuple[float, float], ...] | None = None) -> None:
        self.ranks, self.threads, self.jitter, self.host = ranks, threads, jitter, host
        self._by_size = None if not jitter_by_size else (np.log([p[0] for p in jitter_by_size]),
                                                          np.array([p[1] for p in jitter_by_size]))
        self.scale = np.ones(ranks) if scale is None else np.asarray(scale, dtype=np.float64)
        self._free = [[(0.0, tid) for tid in range(threads)] for _ in range(ranks)]
        self._ends = [0.0] * (ranks * threads)  # every thread's free time, sorted (counted at every step)
        self.assigned = 0  # compiles given to a thread so far: the running count changes only with it or time

    def running(self, t: float) -> int:
        """Compile threads busy at ``t``, over every rank's pool.

        ``t`` is no earlier than the last submission: a thread then runs from
        before ``t`` without a gap until its free time, so it is busy exactly
        when that time is later than ``t``.
        """
        return len(self._ends) - bisect_right(self._ends, t)

    def next_free(self, t: float) -> float:
        """The first time after ``t`` that a busy thread frees (``inf``: none is busy): the running
        count stays :meth:`running` ``(t)`` until then unless a compile is submitted."""
        i = bisect_right(self._ends, t)
        return self._ends[i] if i < len(self._ends) else math.inf

    def _assign(self, heap: list[tuple[float, int]], end: float) -> int:
        """Give ``heap``'s earliest free thread a compile that ends at ``end``; the thread's id."""
        self.assigned += 1
        tid = heap[0][1]
        free_at, _ = heapq.heapreplace(heap, (end, tid))
        ends = self._ends
        del ends[bisect_left(ends, free_at)]
        insort(ends, end)
        return tid

    def submit(self, t: float, seconds: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Queue a compile of ``seconds`` at ``t``; per rank ``(start, end, thread)``."""
        if self.ranks == 1:
            start, end, thread = self.submit_one(t, seconds)
            return np.array([start]), np.array([end]), np.array([thread])
        durations = (float(seconds) * self.scale).tolist()
        jitter = self.jitter if self._by_size is None or seconds <= 0 else \
            float(np.interp(math.log(seconds), *self._by_size))
        if jitter > 0:
            others = rng.lognormal(0.0, jitter * math.sqrt(2.0), size=self.ranks - 1).tolist()
            durations = [durations[0], *(d * f for d, f in zip(durations[1:], others))]
        begins = [t if t > heap[0][0] else heap[0][0] for heap in self._free]
        if self.host is not None:  # at each rank's start: the compiles running then, this one's on every rank too
            durations = [d * self.host.stretch(self.running(b) + sum(other <= b for other in begins))
                         for d, b in zip(durations, begins)]
        start, end, thread = [], [], []
        for heap, begin, duration in zip(self._free, begins, durations):
            tid = self._assign(heap, begin + duration)
            start.append(begin)
            end.append(begin + duration)
            thread.append(tid)
        return np.array(start), np.array(end), np.array(thread)

    def submit_one(self, t: float, seconds: float) -> tuple[float, float, int]:
        """:meth:`submit` for a single rank, as scalars: ``(start, end, thread)``.

        The scheduler calls this once per compile or pooled cache hit; building
        and reducing one-element arrays would cost more than the compile's bookkeeping.
        """
        if self.ranks != 1:
            raise ValueError(f"submit_one needs one rank, these pools have {self.ranks}")
        duration = float(seconds) * float(self.scale[0])
        heap = self._free[0]
        free_at = heap[0][0]
        begin = t if t > free_at else free_at
        if self.host is not None:
            duration *= self.host.stretch(self.running(begin) + 1)
        return begin, begin + duration, self._assign(heap, begin + duration)


Lookup = Literal["hit", "invalid", "inflight", "miss"]


@dataclass(slots=True)
class _InFlight:
    done_at: np.ndarray  # per rank
    ok: bool
    last: float  # done_at.max(), compared on every lookup of the key


class GrammarCache:
    """The compiled-grammar cache, keyed by spec.

    Parameters
    ----------
    enabled : with ``False`` every request compiles (no sharing at all).
    write : ``"harvest"`` — an entry appears when the scheduler harvests a
        finished compile (SGLang); ``"compile"`` — when the compile ends
        (xgrammar's own cache, used by vLLM).
    dedup : a miss on a key that is compiling waits for that compile.
    capacity : LRU entry limit (``None``: unbounded).
    cache_failures : failed and timed-out keys are cached as invalid.

    >>> cache = GrammarCache(True, "compile", dedup=True)
    >>> cache.submitted(7, np.array([0.01]), ok=True)
    >>> cache.lookup(7, 0.005)[0], cache.lookup(7, 0.02)[0]
    ('inflight', 'hit')
    """

    def __init__(self, enabled: bool, write: Literal["harvest", "compile"], dedup: bool,
                 capacity: int | None = None, cache_failures: bool = False) -> None:
        self.enabled, self.write, self.dedup = enabled, write, dedup
        self.capacity, self.cache_failures = capacity, cache_failures
        self._entries: OrderedDict[int, bool] = OrderedDict()  # key -> valid
        self._inflight: dict[int, _InFlight] = {}
        # write="compile": running compiles by end time, to enter the cache in the order they finish
        self._finishing: list[tuple[float, int, int, _InFlight]] = []
        self._seq = itertools.count()

    def lookup(self, key: int, t: float) -> tuple[Lookup, np.ndarray | None]:
        """What a request for ``key`` finds at ``t``; for ``inflight`` also the compile's per-rank end."""
        if not self.enabled:
            return "miss", None
        if self._finishing and self._finishing[0][0] <= t:
            self._settle(t)
        flight = self._inflight.get(key)
        valid = self._entries.get(key)
        if valid is not None:
            self._entries.move_to_end(key)
            return ("hit" if valid else "invalid"), None
        if flight is not None and self.dedup:
            return "inflight", flight.done_at
        return "miss", None

    def submitted(self, key: int, done_at: np.ndarray, ok: bool) -> None:
        """A compile of ``key`` was queued; it ends at ``done_at`` (per rank) with outcome ``ok``."""
        if self.enabled and key not in self._inflight:
            flight = self._inflight[key] = _InFlight(done_at, ok, float(done_at.max()))
            if self.write == "compile":
                heapq.heappush(self._finishing, (flight.last, next(self._seq), key, flight))

    def _settle(self, t: float) -> None:
        """Compiles finished by ``t`` enter the cache in the order they finished (``write="compile"``),
        so that a capacity evicts by when entries were written, whichever key is looked up."""
        finishing = self._finishing
        while finishing and finishing[0][0] <= t:
            _, _, key, flight = heapq.heappop(finishing)
            if self._inflight.get(key) is not flight:  # timed out meanwhile
                continue
            del self._inflight[key]
            if flight.ok:
                self._put(key, True)
            elif self.cache_failures:
                self._put(key, False)

    def harvested(self, key: int, ok: bool) -> None:
        """The scheduler took a finished compile of ``key``; with ``write="harvest"`` it enters the cache."""
        if not self.enabled or self.write != "harvest":
            return
        self._inflight.pop(key, None)
        if ok:
            self._put(key, True)
        elif self.cache_failures:
            self._put(key, False)

    def forget(self, key: int) -> None:
        """No request will look ``key`` up again: its entry (or its running compile) goes, as if evicted
        unseen (a capacity then counts only keys that can be looked up again)."""
        self._entries.pop(key, None)
        self._inflight.pop(key, None)

    def timed_out(self, key: int) -> None:
        """Waiting for ``key`` timed out; cached as invalid when failures are cached."""
        if not self.enabled:
            return
        self._inflight.pop(key, None)
        if self.cache_failures:
            self._put(key, False)

    def _put(self, key: int, valid: bool) -> None:
        self._entries[key] = valid
        self._entries.move_to_end(key)
        if self.capacity is not None:
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
