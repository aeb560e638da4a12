"""The scheduler loop: one discrete-event model of SGLang's and vLLM's schedulers.

One :class:`Scheduler` runs every mechanism; :class:`~cdbench.harness.policies.SchedulerConfig`
says which variant of each (a preset is a configuration, not a code path of its own).

Each iteration, at virtual time ``t``:

1. **Grammar readiness.** SGLang: when the grammar queue is not empty, one
   blocking poll (readiness checks every ``interval/naps``, an early exit when
   everything is ready, ``max_poll_iterations`` before a timeout), then with
   ``R`` ranks an all_gather: ready = ready on every rank, failed = failed on
   any (priced at ``all_gather_s``, or run for real among ``R`` rank processes
   with ``collectives="gloo"`` or ``"nccl"``, :mod:`~cdbench.harness.collectives`). vLLM: each waiting request whose grammar is not ready costs up to
   ``check_timeout_s`` when the admission loop inspects it.
2. **Batch.** Decode rows and continuing prefill chunks, then new requests in
   waiting-queue order while rows and the token budget last (chunked
   prefill). With ``mixed_batches=False`` a prefill batch runs alone.
3. **Grammar work** from the executor: mask fill per row (serial, or on a
   thread pool above a row threshold: the executor prices or times the pool's
   wall time, :class:`~cdbench.harness.executors.base.ParallelFill`), drafts
   (1 + k mask rows), verification, rollback, jump-forward — as arrays over
   the step's rows. The engine's own host code around it (measured,
   ``policies.py``): batch forming per row, the mask wrapper per structured
   row (serial: it holds the GIL), a per-iteration mask allocation per byte,
   the bitmask's serialization to another process (``mask_transfer="ipc"``,
   on the mask path), result processing per row and per structured row.
4. **Time.** Without overlap: ``pre + max(forward, fill + copy) + apply +
   sample + process``. With overlap, a batch holding any grammar row waits
   for the previous step's processing and this step's mask:
   ``max(forward, pre + process(prev) + fill + copy) + apply + sample``; a
   batch without one: ``max(forward + sample, pre + process(prev))``. Either
   way the host's launch of the step (``launch_s``; ``launch_prefill_s`` for a
   step with prefill chunks) is added: the GPU waits for it. A
   decode step's forward is priced at the next CUDA-graph capture size
   (``cuda_graph_sizes``), as the engines pad it.
5. **Host contention** (``model`` and ``hybrid``): while the compiles running
   at the step's start and the scheduler loop outnumber ``host_cpus``, the
   step's host CPU work (batch forming, fills and their wrapper, transfer,
   processing, launch) takes demand / cores as long, and a parallel fill's
   wall counts its pool's threads instead of the loop
   (:mod:`~cdbench.harness.contention`).

Per-request Python runs only at events (arrival, release, admission, finish,
abort); everything per token is a numpy operation over the running batch,
which is kept as a struct of arrays.
"""

from __future__ import annotations

import gc
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from cdbench.harness.batch import RunningBatch
from cdbench.harness.collectives import RankAgreement
from cdbench.harness.compile_service import CompilePools, GrammarCache
from cdbench.harness.contention import HostCores
from cdbench.harness.costs.gpu import GpuCosts
from cdbench.harness.events import EventKind, EventQueue
from cdbench.harness.executors.base import (
    CompileOutcome,
    GrammarExecutor,
    ParallelFill,
    Settlement,
    SpecKeys,
    StepRows,
    StepWork,
    constant_ints,
)
from cdbench.harness.metrics import LogHistogram
from cdbench.harness.policies import SchedulerConfig, padded_decode
from cdbench.harness.records import (
    ABORT_REASONS,
    CACHE_RESULTS,
    DraftPositionCounts,
    RequestTable,
    StepLog,
)
from cdbench.harness.step_time import step_time
from cdbench.harness.timeline import Timeline
from cdbench.workloads.request import Request

if TYPE_CHECKING:
    from cdbench.harness.live.step import LiveStep

# Per-step calls on small arrays cost mostly call overhead: count_nonzero is the cheapest
# "any" (several times cheaper than a ufunc reduction), and the direct ufunc reduction the
# cheapest sum (ndarray.sum adds a Python-level wrapper).
_any = np.count_nonzero
_sum = np.add.reduce

_ABORT = {name: i for i, name in enumerate(ABORT_REASONS)}
_CACHE = {name: i for i, name in enumerate(CACHE_RESULTS)}
_KIND_DECODE, _KIND_PREFILL, _KIND_MIXED = "decode", "prefill", "mixed"
_NO_ROWS = np.zeros(0, np.int64)
_TALLY_ROWS = 1 << 16  # sampled rows whose counters are buffered before they are summed per request


class Scheduler:
    """Simulate ``requests`` under ``config``.

    Parameters
    ----------
    config : the policy (every mechanism's parameters).
    requests : the workload, in any order (sorted by arrival here).
    executor : the grammar cost source (model profile or real backend).
    gpu : the GPU cost model.
    seed : fixes every random choice (compile jitter, sampled costs, draft acceptance).
    max_concurrency : closed loop — at most this many requests in the engine
        at once; the next is issued when one ends (``None``: open loop).
    timeline : spans to record (``None``: none).
    on_progress : called with the number of ended requests every few hundred iterations.
    live : ``live`` mode: each step runs for real on this machine and its wall time is its duration
        (:mod:`cdbench.harness.live.step`); ``gpu`` then prices nothing.
    """

    def __init__(self, config: SchedulerConfig, requests: Sequence[Request], executor: GrammarExecutor,
                 gpu: GpuCosts, seed: int = 0, max_concurrency: int | None = None,
                 timeline: Timeline | None = None, on_progress: Callable[[int], None] | None = None,
                 live: LiveStep | None = None) -> None:
        self.cfg, self.executor, self.gpu, self.live = config, executor, gpu, live
        self._row_bytes = gpu.mask_row_bytes  # the engines' per-byte host costs (mask allocation, IPC)
        self.timeline, self.on_progress = timeline, on_progress
        self._ranks: RankAgreement | None = None  # the rank processes of real collectives, while run() runs
        self.max_concurrency = max_concurrency
        seeds = np.random.SeedSequence(seed).spawn(2)
        self.rng_compile = np.random.default_rng(seeds[0])
        self.rng_step = np.random.default_rng(seeds[1])

        ordered = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        self.requests = ordered
        n = self.n = len(ordered)
        rec = self.rec = RequestTable(n)
        rec.request_id[:] = [r.request_id for r in ordered]
        rec.arrival_s[:] = [r.arrival_s for r in ordered]
        rec.prompt_len[:] = [max(1, r.prompt_len) for r in ordered]
        rec.output_len[:] = [max(1, r.output_len) for r in ordered]
        rec.structured[:] = [r.structured for r in ordered]
        think_len = np.array([r.think_len for r in ordered], np.int64)
        budget = np.array([r.thinking_budget if r.thinking_budget is not None else -1 for r in ordered], np.int64)
        capped = np.where((budget >= 0) & (think_len > budget), budget, think_len)
        rec.think_tokens[:] = np.where(think_len > 0, capped + 1, 0)  # +1: the think-end token
        rec.forced_think_end[:] = (think_len > 0) & (budget >= 0) & (think_len > budget)
        self.gen_total = rec.think_tokens + rec.output_len

        self.keys = SpecKeys.of(ordered)
        rec.spec_key[:] = self.keys.request_key
        parallel = config.fill_parallel_threshold is not None and config.spec_tokens == 0  # (vLLM: no spec decoding)
        executor.prepare(ordered, self.keys, jump_forward=config.jump_forward,
                         parallel_fill=ParallelFill(config.fill_parallel_threshold, config.fill_chunk,
                                                    config.fill_threads) if parallel else None)
        self._outcomes: dict[int, CompileOutcome] = {}

        R = config.ranks
        self.done_at = np.full((n, R), np.inf)
        self._ready_at = [math.inf] * n  # done_at's maximum per request (the last rank's end), for checks
        self.grammar_ok = np.ones(n, bool)
        self.wait_ct = np.zeros((n, R), np.int64)
        # the host's cores, where its threads can outnumber them (live mode runs its steps for real)
        host = HostCores(config.host_cpus, config.compile_cores, R)
        fill_threads = config.fill_threads if parallel else 1
        self._host = host if (config.host_contention and live is None
                              and host.can_exceed(R * config.compile_threads, fill_threads)) else None
        self._stretch = 1.0  # this iteration's stretch of the loop's CPU work (contention.py)
        self._stretch_until = math.inf  # when a compile thread frees and the stretch may change
        self._compiles, self._counted_until, self._counted_assigned = 0, -math.inf, -1  # the last count's
        self.pools = CompilePools(R, config.compile_threads, config.rank_jitter, config.rank_compile_scale,
                                  self._host)
        self.cache = GrammarCache(config.cache, config.cache_write, config.cache_dedup_inflight,
                                  config.cache_capacity, config.cache_failures)

        self.queue = EventQueue()
        self.waiting: deque[int] = deque()
        self.grammar_queue: list[int] = []
        # each request's batch columns as it is admitted, so admission is one gather
        entry_ints = np.zeros((len(RunningBatch.INTS), n), np.int64)
        entry_ints[0], entry_ints[1] = np.arange(n), rec.prompt_len
        entry_ints[3], entry_ints[4] = self.gen_total, rec.think_tokens
        self.batch = RunningBatch(entry_ints)
        self._rows = np.arange(config.max_running_requests if config.max_running_requests < 1 << 16 else 0)
        self.steps = StepLog()
        self.itl = LogHistogram()
        self.fill_hist = LogHistogram()
        self.draft_positions = DraftPositionCounts(config.spec_tokens)
        # per step: the sampled rows' request ids, then their counters for these request-table columns;
        # summed per request every _TALLY_ROWS rows (a few bulk operations instead of several small ones
        # every step)
        counted = (("output_tokens",) + (("drafted", "accepted", "rolled_back") if config.spec_tokens else ())
                   + (("jump_forward_tokens",) if config.jump_forward else ()))
        self._tally_columns = [getattr(rec, name) for name in counted]
        self._tallies: list[list[np.ndarray]] = []
        self._tallied_rows = 0
        self.ended = 0
        self.idle_iterations = 0
        self._carry_process_s = 0.0  # overlap: last step's result processing, paid in the next iteration
        self._carry_cpu_s = 0.0  # scheduler-thread work done at events (cache-hit copies)
        self._next_arrival = 0
        self._in_flight = 0
        self._idle = True

    # ------------------------------------------------------------------ driver

    def run(self) -> None:
        """Run until every request has finished or aborted.

        The cyclic garbage collector is paused meanwhile: the loop allocates many
        short-lived objects but no reference cycles, and the collector's passes
        over the growing step log cost about 5 % of a long run.
        """
        collecting = gc.isenabled()
        gc.disable()
        if self.cfg.collectives != "model" and self.cfg.ranks > 1:
            self._ranks = RankAgreement(self.cfg.ranks, self.cfg.collectives)
        try:
            self._run()
            self._sum_tallies()
            for rid, valid in self.executor.validity():
                self.rec.valid[rid] = int(valid)
        finally:
            if self._ranks is not None:
                self._ranks.close()
                self._ranks = None
            if collecting:
                gc.enable()

    def _run(self) -> None:
        q = self.queue
        for _ in range(self.max_concurrency or 1):
            self._issue_next(0.0)
        iterations = 0
        while len(q):
            t, kind, payload = q.pop()
            if kind is EventKind.ARRIVAL:
                self._arrive(payload, t)
                if self.max_concurrency is None:
                    self._issue_next(t)
                if self._idle:
                    self._idle = False
                    q.push(t, EventKind.ITERATION)
            else:
                duration = self._iterate(t)
                if duration is None:
                    self._idle = True
                else:
                    q.push(t + duration, EventKind.ITERATION)
                iterations += 1
                if self.on_progress is not None and iterations % 256 == 0:
                    self.on_progress(self.ended)
        if self.on_progress is not None:
            self.on_progress(self.ended)

    def _issue_next(self, now: float) -> None:
        """Put the next request's arrival on the event queue (under a closed loop, only if a slot is free)."""
        if self._next_arrival >= self.n:
            return
        if self.max_concurrency is not None:
            if self._in_flight >= self.max_concurrency:
                return
            self._in_flight += 1
        i = self._next_arrival
        self._next_arrival += 1
        self.queue.push(max(now, float(self.rec.arrival_s[i])), EventKind.ARRIVAL, i)

    # ------------------------------------------------------------------ arrival and compile

    def _outcome(self, key: int) -> CompileOutcome:
        outcome = self._outcomes.get(key)
        if outcome is None:
            outcome = self._outcomes[key] = self.executor.compile(key)
        return outcome

    @property
    def compile_errors(self) -> dict[str, str]:
        """Specs that failed to compile (cache key text → the backend's reason)."""
        return {self.keys.texts[k]: o.error for k, o in sorted(self._outcomes.items()) if o.error is not None}

    def _arrive(self, rid: int, t: float) -> None:
        rec, cfg = self.rec, self.cfg
        rec.issued_s[rid] = t
        if not rec.structured[rid]:
            self.waiting.append(rid)
            return
        key = int(rec.spec_key[rid])
        found, shared_end = self.cache.lookup(key, t)
        rec.cache[rid] = _CACHE["hit" if found in ("hit", "invalid") else found]
        if found == "invalid":
            self._abort(rid, "cached_invalid", t)
            return
        if found == "hit" and cfg.cache_hit_path == "direct":
            self._carry_cpu_s += cfg.cache_hit_s
            self.done_at[rid] = t
            self._ready_at[rid] = t
            rec.grammar_ready_s[rid] = t
            rec.rank_skew_s[rid] = 0.0
            self.waiting.append(rid)
            return
        if found == "inflight":
            end = shared_end
            self.grammar_ok[rid] = self._outcome(key).error is None
            first, last, skew = t, float(end.max()), float(end.max() - end.min())
        else:
            # a pooled cache hit makes a round trip through the compile pool; a miss compiles
            seconds = cfg.cache_hit_s if found == "hit" else self._outcome(key).seconds
            if cfg.ranks == 1:  # scalars: one-element arrays cost more than the bookkeeping itself
                first, last, thread = self.pools.submit_one(t, seconds, self.rng_compile)
                end, skew = None, 0.0
                self._trace_compile((first,), (last,), (thread,), key, found)
            else:
                start, end, threads = self.pools.submit(t, seconds, self.rng_compile)
                first, last, skew = float(start.min()), float(end.max()), float(end.max() - end.min())
                self._trace_compile(start, end, threads, key, found)
            if found == "miss":
                self.grammar_ok[rid] = self._outcome(key).error is None
                self.cache.submitted(key, np.array([last]) if end is None else end, bool(self.grammar_ok[rid]))
        self.done_at[rid] = last if end is None else end
        self._ready_at[rid] = last
        rec.compile_start_s[rid] = first
        rec.compile_end_s[rid] = last
        rec.rank_skew_s[rid] = skew
        if cfg.grammar_wait == "grammar_queue":
            self.grammar_queue.append(rid)
        else:
            self.waiting.append(rid)

    def _trace_compile(self, start, end, thread, key: int, found: str) -> None:
        tl = self.timeline
        if tl is not None and tl.recording:
            name = "cache hit" if found == "hit" else f"compile {self.keys.texts[key][:40]}"
            for r in range(len(start)):
                tl.span(f"rank{r}/compile{thread[r]}", name, float(start[r]), float(end[r] - start[r]))

    def _abort(self, rid: int, reason: str, t: float) -> None:
        self.rec.abort[rid] = _ABORT[reason]
        self.executor.abort(rid)
        self.rec.finish_s[rid] = t
        self._end(rid, t)

    def _end(self, rid: int, t: float) -> None:
        self.ended += 1
        if self.max_concurrency is not None:
            self._in_flight -= 1
            self._issue_next(t)

    def _release(self, rid: int, t: float) -> bool:
        """A finished compile is taken by the scheduler; False when it failed (the request aborts)."""
        key = int(self.rec.spec_key[rid])
        ok = bool(self.grammar_ok[rid])
        self.cache.harvested(key, ok)
        if not ok:
            self._abort(rid, "compile_error", t)
            return False
        self.rec.grammar_ready_s[rid] = t
        return True

    # ------------------------------------------------------------------ readiness

    def _poll(self, t0: float) -> tuple[float, float]:
        """SGLang's blocking poll of the grammar queue at ``t0``; returns (poll seconds, all_gather seconds)."""
        cfg = self.cfg
        queued = np.array(self.grammar_queue, np.int64)
        nap = cfg.poll_interval_s / cfg.poll_naps
        last = cfg.poll_naps - 1
        # index of the first readiness check (every nap) that sees each compile done, per rank
        with np.errstate(invalid="ignore"):
            first_seen = np.maximum(np.ceil((self.done_at[queued] - t0) / nap - 1e-9), 0.0)
        seen = first_seen <= last
        if cfg.poll_early_exit:
            all_seen = seen.all(axis=0)
            exit_check = np.where(seen, first_seen, 0.0).max(axis=0)
            per_rank = np.where(all_seen, exit_check * nap, cfg.poll_interval_s)
        else:
            per_rank = np.full(cfg.ranks, cfg.poll_interval_s)
        poll_s = float(per_rank.max())
        sync_s = cfg.all_gather_s if cfg.ranks > 1 else 0.0
        self.wait_ct[queued] += ~seen
        if cfg.max_poll_iterations is not None:
            gave_up = self.wait_ct[queued] >= cfg.max_poll_iterations  # per rank
        else:
            gave_up = np.zeros_like(seen)
        if self._ranks is None:
            failed = gave_up.any(axis=1)
            ready = seen.all(axis=1) & ~failed
        else:
            ready, failed, sync_s = self._agree_for_real(queued, seen, gave_up)
        t_release = t0 + poll_s + sync_s
        if _any(ready) or _any(failed):
            keep = []
            for rid, is_ready, has_failed in zip(queued.tolist(), ready.tolist(), failed.tolist()):
                if is_ready:
                    if self._release(rid, t_release):
                        self.waiting.append(rid)  # rejoins at the tail
                elif has_failed:
                    self.cache.timed_out(int(self.rec.spec_key[rid]))
                    self._abort(rid, "grammar_timeout", t_release)
                else:
                    keep.append(rid)
            self.grammar_queue = keep
        return poll_s, sync_s

    def _check(self, rid: int, t: float) -> tuple[bool, float]:
        """vLLM's readiness check of one request at ``t``: (ready, seconds it cost)."""
        done = self._ready_at[rid]
        if done <= t:
            return True, 0.0
        if done <= t + self.cfg.check_timeout_s:
            return True, done - t
        return False, self.cfg.check_timeout_s

    def _check_grammar_queue(self, t: float) -> float:
        """Per-request checks over a grammar queue (a ``grammar_queue`` + ``per_request_check`` policy)."""
        cost = 0.0
        keep = []
        for rid in self.grammar_queue:
            ready, c = self._check(rid, t + cost)
            cost += c
            if not ready:
                keep.append(rid)
            elif self._release(rid, t + cost):
                self.waiting.append(rid)
        self.grammar_queue = keep
        return cost

    # ------------------------------------------------------------------ admission

    def _admit(self, t: float, budget: int, room: int) -> tuple[list[int], list[int], float, bool]:
        """New requests from the waiting queue: (ids, prefill chunks, readiness-check seconds, whether
        every admitted prompt runs whole in this step)."""
        cfg, rec = self.cfg, self.rec
        waiting = self.waiting
        admitted: list[int] = []
        chunks: list[int] = []
        skipped: list[int] = []
        check_s = 0.0
        whole = True
        while waiting and budget > 0 and room > 0:
            rid = waiting.popleft()
            if rec.structured[rid] and math.isnan(rec.grammar_ready_s[rid]):
                ready, cost = self._check(rid, t + check_s)
                check_s += cost
                if not ready:
                    skipped.append(rid)  # keeps its place; later requests may pass it
                    continue
                if not self._release(rid, t + check_s):
                    continue
            prompt = int(rec.prompt_len[rid])
            if prompt <= budget:
                chunk = prompt
            elif cfg.chunked_prefill:
                chunk = budget
                whole = False
            elif not admitted and len(self.batch) == 0:
                chunk = prompt  # a prompt over the budget still runs alone
            else:
                waiting.appendleft(rid)
                break
            admitted.append(rid)
            chunks.append(chunk)
            budget -= chunk
            room -= 1
        if skipped:
            waiting.extendleft(reversed(skipped))
        return admitted, chunks, check_s, whole

    # ------------------------------------------------------------------ one iteration

    def _iterate(self, t: float) -> float | None:
        """Run one scheduler iteration starting at ``t``; its duration, or ``None`` when idle."""
        cfg, rec, batch = self.cfg, self.rec, self.batch
        if self._host is not None:
            pools = self.pools
            # the running count holds until a thread frees or a compile is assigned: counted only then
            if t >= self._counted_until or pools.assigned != self._counted_assigned:
                self._compiles = pools.running(t)
                self._stretch = self._host.stretch(self._compiles)
                self._counted_until, self._counted_assigned = pools.next_free(t), pools.assigned
                # idle strides repeat this iteration's stretch only while no compile thread frees
                self._stretch_until = self._counted_until if self._stretch > 1.0 else math.inf
            compiles, stretch = self._compiles, self._stretch
        else:
            stretch = 1.0
        schedule_s = (cfg.schedule_s + self._carry_cpu_s) * stretch
        self._carry_cpu_s = 0.0
        poll_s = sync_s = check_s = 0.0
        if self.grammar_queue:
            if cfg.readiness == "blocking_poll":
                poll_s, sync_s = self._poll(t + schedule_s)
            else:
                check_s = self._check_grammar_queue(t + schedule_s)
        pre = schedule_s + poll_s + sync_s + check_s

        k = cfg.spec_tokens
        n_rows = len(batch)
        room = cfg.max_running_requests - n_rows
        if _any(batch.prefill_left):
            decoding = batch.prefill_left == 0
            pf_rows = (~decoding).nonzero()[0]
            dec_rows = decoding.nonzero()[0]
            all_decode = False
        else:  # the common case: no prefill in flight
            pf_rows = _NO_ROWS
            if n_rows > len(self._rows):
                self._rows = np.arange(2 * n_rows)
            dec_rows = self._rows[:n_rows]
            all_decode = True
        new_ids: list[int] = []
        new_chunks: list[int] = []
        new_whole = True
        if cfg.mixed_batches:
            if k:
                drafts = np.minimum(k, (batch.gen_left if all_decode else batch.gen_left[dec_rows]) - 1)
                n_drafts = int(_sum(drafts))
            else:
                n_drafts = 0
            budget = cfg.max_batched_tokens - len(dec_rows) - n_drafts
            if len(pf_rows):
                pf_chunks = self._allocate(pf_rows, budget)
                budget -= int(_sum(pf_chunks))
            else:
                pf_chunks = _NO_ROWS
            if self.waiting and room > 0 and budget > 0:
                new_ids, new_chunks, c, new_whole = self._admit(t + pre, budget, room)
                check_s += c
        else:
            pf_chunks = self._allocate(pf_rows, cfg.max_batched_tokens)
            if len(pf_rows) or (self.waiting and room > 0):
                budget = cfg.max_batched_tokens - int(_sum(pf_chunks))
                if self.waiting and room > 0 and budget > 0:
                    new_ids, new_chunks, c, new_whole = self._admit(t + pre, budget, room)
                    check_s += c
            if new_chunks or (len(pf_chunks) and _sum(pf_chunks) > 0):
                dec_rows = _NO_ROWS
                all_decode = False
            if k:
                drafts = np.minimum(k, (batch.gen_left if all_decode else batch.gen_left[dec_rows]) - 1)
                n_drafts = int(_sum(drafts))
            else:
                n_drafts = 0
        if cfg.schedule_row_s:
            schedule_s += cfg.schedule_row_s * (n_rows + len(new_ids)) * stretch
        pre = schedule_s + poll_s + sync_s + check_s

        if len(pf_rows):  # continuing prompts: those the budget reached run a chunk
            live = pf_chunks > 0
            pf_rows, pf_chunks = pf_rows[live], pf_chunks[live]
        continuing = len(pf_rows) > 0
        if new_ids:
            ids = np.array(new_ids, np.int64)
            rec.admitted_s[ids] = t + pre
            first_new = len(batch)
            batch.append(ids)
            new_rows = np.arange(first_new, len(batch))
            # (admitted chunks are never empty)
            new_chunk_arr = np.array(new_chunks, np.int64)
            if continuing:
                pf_rows = np.concatenate((pf_rows, new_rows))
                pf_chunks = np.concatenate((pf_chunks, new_chunk_arr))
            else:
                pf_rows, pf_chunks = new_rows, new_chunk_arr
        # indexes the prefill rows' columns: a slice (views, not gathers) when they are the new rows alone
        pf_sel = slice(first_new, None) if new_ids and not continuing else pf_rows

        if len(dec_rows) == 0 and len(pf_rows) == 0:
            return self._idle_iteration(t, pre, schedule_s, poll_s, sync_s, check_s)

        # rows that sample: decode rows and prefill rows whose last chunk runs now
        if new_ids and new_whole and not continuing:  # just the new prompts, each whole
            first_rows = pf_rows
        elif len(pf_rows):
            completing = pf_chunks == batch.prefill_left[pf_sel]
            first_rows = pf_rows[completing]
        else:
            first_rows = pf_rows
        n_dec = len(dec_rows)
        n_first = len(first_rows)
        everyone = n_first == 0 and n_dec == len(batch)
        # decode rows are the batch's first n_dec rows when no prefill was in flight before this step
        dec_sel = slice(0, n_dec) if all_decode else dec_rows
        if everyone or (all_decode and n_dec + n_first == len(batch)):
            # the common steps (all decode; or every new prompt fits now): the sampling rows are the
            # whole batch, in order, so slices (views) instead of gathers
            s_rows = slice(None)
        elif n_first:
            s_rows = np.concatenate((dec_rows, first_rows))
        else:
            s_rows = dec_rows
        if not k:
            s_drafts = constant_ints(0, n_dec + n_first)
        elif n_first:
            s_drafts = np.concatenate((drafts, constant_ints(0, n_first)))
        else:
            s_drafts = drafts
        s_rid = batch.rid[s_rows]
        n_sample = len(s_rid)
        think_left = batch.think_left[s_rows]
        structured = rec.structured[s_rid]  # (one gather a step: cheaper than a batch column to add and drop)
        any_thinking = _any(think_left)  # (never negative)
        if any_thinking:
            thinking = think_left > 0
            grammar = structured & ~thinking
        else:
            grammar = structured
        # one grammar row makes the whole batch wait (without thinking rows, every structured row builds a mask)
        has_grammar = bool(_any(structured) if any_thinking else _any(grammar))
        sync = (not cfg.overlap) or (k > 0 and has_grammar and not cfg.spec_grammar_overlap)
        live = self.live
        if live is not None:  # the forward runs on the GPU while the grammar works below
            self.executor.defer_accepts = sync
            live.begin(batch.cached[dec_sel], drafts if k else constant_ints(0, n_dec), pf_chunks,
                       batch.cached[pf_sel] if len(pf_rows) else pf_chunks, sync,
                       pre if sync else pre + self._carry_process_s)
        work = self.executor.step(StepRows(s_rid, grammar, s_drafts, batch.gen_left[s_rows], think_left),
                                  self.rng_step)

        # --- mask building (CPU)
        if any_thinking:
            filtered = structured & thinking
            if not cfg.strict_thinking:
                filtered &= rec.forced_think_end[s_rid] & (think_left == 1)
            n_filter = int(np.count_nonzero(filtered))
        else:
            n_filter = 0
        row_fill, row_masks = work.fill_s, work.mask_rows
        grammar_rows = len(row_fill)
        mask_rows = n_filter
        fill_s = 0.0
        if grammar_rows:  # (the executor times or prices a parallel fill: its pool's wall time)
            if work.fill_wall_s is None:
                fill_s = float(_sum(row_fill)) * stretch
            elif self._host is not None:  # the loop waits on the pool, whose busy threads share the cores
                tasks = -(-grammar_rows // cfg.fill_chunk)
                fill_s = work.fill_wall_s * self._host.stretch(compiles, min(cfg.fill_threads, tasks))
            else:
                fill_s = work.fill_wall_s
            self.fill_hist.add(row_fill / row_masks, row_masks)
            mask_rows += int(_sum(row_masks))
        host_fill_s = n_filter * cfg.think_filter_s
        if mask_rows:  # the engine's own wrapper around the fills: Python under the GIL, so serial even with a pool
            host_fill_s += cfg.fill_step_s + cfg.fill_row_s * grammar_rows + cfg.mask_alloc_byte_s * self._row_bytes * n_sample
        host_fill_s *= stretch
        fill_s += host_fill_s

        # --- GPU
        if work.drafted is not None:
            # the batch reserved k tokens per decode row; the forward verifies the drafts actually
            # proposed (hybrid: fewer near an oracle's end, none for a random walk)
            n_drafts = int(_sum(work.drafted))
        dec_tokens = len(dec_rows) + n_drafts
        if everyone:
            kv = int(_sum(batch.cached))
        else:
            kv = int(_sum(batch.cached[dec_sel])) if n_dec else 0
        pf_tokens = int(_sum(pf_chunks)) if len(pf_rows) else 0
        sample_rows = n_sample + n_drafts
        # a bitmask built in another process than the sampler's travels serialized, on the mask path
        transfer_s = (cfg.ipc_s + cfg.ipc_byte_s * self._row_bytes * mask_rows) * stretch \
            if mask_rows and cfg.mask_transfer == "ipc" else 0.0
        engine_process_s = (cfg.process_step_s + cfg.process_row_s * n_sample + cfg.accept_row_s * grammar_rows) * stretch
        carry = self._carry_process_s
        if live is None:
            fw_tokens, fw_kv = dec_tokens, kv
            if dec_tokens and not pf_tokens:  # a decode step replays the graph of the next captured size
                fw_tokens, fw_kv = padded_decode(cfg.cuda_graph_sizes, dec_tokens, kv)
            forward_s = self.gpu.forward_s(pf_chunks, batch.cached[pf_sel] if pf_tokens else pf_chunks, fw_tokens,
                                           fw_kv)
            copy_s = self.gpu.copy_s(mask_rows, cfg.pinned_mask) if mask_rows else 0.0
            apply_s = self.gpu.apply_s(mask_rows) if mask_rows else 0.0
            sample_s = self.gpu.sample_s(sample_rows)
            process_s = work.process_s * stretch + engine_process_s
            # --- the step's duration (see the module docstring)
            launch_s = (cfg.launch_s if not pf_tokens or cfg.launch_prefill_s is None else cfg.launch_prefill_s) * stretch
            duration, after_token, exposed, hidden, self._carry_process_s = step_time(
                sync, has_grammar, pre, carry, forward_s, fill_s, copy_s + transfer_s, apply_s, sample_s, process_s,
                launch_s)
        else:
            (duration, after_token, exposed, hidden, forward_s, copy_s, apply_s, sample_s, process_s,
             launch_s) = self._live_end(
                live, work, sync, has_grammar, pre, carry, fill_s, host_fill_s + transfer_s, transfer_s, mask_rows,
                sample_rows, engine_process_s)
        t_token = t + duration - after_token

        # --- advance the batch
        produced = work.produced
        if pf_tokens:
            batch.prefill_left[pf_sel] -= pf_chunks
            batch.cached[pf_sel] += pf_chunks
        batch.gen_left[s_rows] -= produced
        if any_thinking:
            batch.think_left[s_rows] = np.maximum(think_left - produced, 0)
        batch.cached[s_rows] += produced
        if len(dec_rows):
            self.itl.add(t_token - (batch.last_tok if everyone else batch.last_tok[dec_sel]), None)
        batch.last_tok[s_rows] = t_token
        if len(first_rows):
            rec.first_token_s[batch.rid[first_rows]] = t_token
        # kept until summed (the executor's arrays are new each step; rid columns are never written)
        tally = [s_rid, produced]
        if k:
            tally += (s_drafts if work.drafted is None else work.drafted, work.accepted, work.rolled_back)
        if cfg.jump_forward:
            tally.append(work.jumped)
        self._tallies.append(tally)
        self._tallied_rows += n_sample
        if self._tallied_rows >= _TALLY_ROWS:
            self._sum_tallies()

        done = batch.gen_left[s_rows] <= 0
        if work.ended is not None:
            done |= work.ended
        rejected = work.rejected if cfg.abort_on_reject else None
        if rejected is not None or _any(done):
            if rejected is not None:
                for rid in s_rid[rejected].tolist():
                    self._abort(rid, "grammar_rejected", t_token)
                done &= ~rejected
            finished = s_rid[done]
            rec.finish_s[finished] = t_token
            for rid in finished.tolist():
                self.executor.finish(rid)
                self._end(rid, t_token)
            left = done if rejected is None else done | rejected  # per sampled row
            if isinstance(s_rows, slice):  # the sampled rows are the whole batch, in order
                gone = left
            else:
                gone = np.zeros(len(batch), bool)
                gone[s_rows[left]] = True
            batch.keep((~gone).nonzero()[0])

        kind = _KIND_MIXED if len(dec_rows) and len(pf_rows) else (_KIND_DECODE if len(dec_rows) else _KIND_PREFILL)
        self.steps.rows.append((t, duration, kind, n_sample, len(dec_rows), pf_tokens, grammar_rows,
                                mask_rows, int(_sum(produced)), schedule_s, poll_s, sync_s, check_s, forward_s,
                                fill_s, copy_s, apply_s, sample_s, process_s, exposed, hidden, transfer_s,
                                launch_s, dec_tokens, kv, stretch))
        tl = self.timeline
        if tl is not None and tl.recording:
            tl.steps_seen += 1
            tl.step_spans(t, sync, has_grammar, schedule_s, poll_s + sync_s + check_s, carry, launch_s, forward_s,
                          fill_s, copy_s + transfer_s, apply_s, sample_s, process_s, duration)
        return duration

    def _live_end(self, live: LiveStep, work: StepWork, sync: bool, has_grammar: bool, pre: float, carry: float,
                  fill_s: float, host_s: float, transfer_s: float, mask_rows: int, sample_rows: int,
                  engine_process_s: float) -> tuple[float, ...]:
        """Finish a live step (:mod:`cdbench.harness.live.step`): the measured duration and parts, the
        grammar's deferred accepts merged into ``work``, and the CPU split by the overlap rules; the
        launch is the measured duration beyond what those rules make of the measured parts."""
        settled: list[Settlement | None] = []
        times = live.end(mask_rows, sample_rows, host_s, sync, after_sample=lambda: settled.append(self.executor.settle()),
                         after_s=engine_process_s)
        if settled and settled[0] is not None:
            work.process_s += settled[0].process_s
            if settled[0].rejected is not None:
                work.rejected = settled[0].rejected if work.rejected is None else work.rejected | settled[0].rejected
        process_s = work.process_s + engine_process_s
        parts, _, exposed, hidden, _ = step_time(sync, has_grammar, pre, carry, times.forward_s, fill_s,
                                                 times.copy_s + transfer_s, times.apply_s, times.sample_s, process_s)
        launch_s = times.duration - parts
        # with overlap the grammar's accepts ran beside this forward; the engine's processing is paid next step
        self._carry_process_s = 0.0 if sync else engine_process_s
        return (times.duration, times.after_token_s, exposed + launch_s, hidden, times.forward_s, times.copy_s,
                times.apply_s, times.sample_s, process_s, launch_s)

    def _sum_tallies(self) -> None:
        """Add the buffered steps' counters to the request table and the draft-position counts."""
        if not self._tallies:
            return
        rid, *counters = (np.concatenate(column) for column in zip(*self._tallies))
        for column, values in zip(self._tally_columns, counters):
            np.add.at(column, rid, values)
        if self.cfg.spec_tokens:
            self.draft_positions.add(*counters[1:4])
        self._tallies.clear()
        self._tallied_rows = 0

    def _allocate(self, rows: np.ndarray, budget: int) -> np.ndarray:
        """Prefill chunks for continuing rows, first come first served, within ``budget`` tokens."""
        if len(rows) == 0:
            return _NO_ROWS
        left = self.batch.prefill_left[rows]
        if not self.cfg.chunked_prefill:
            fits = np.add.accumulate(left) <= max(budget, 0)
            return np.where(fits, left, 0)
        before = np.add.accumulate(left) - left
        return np.clip(budget - before, 0, left)

    def _idle_iteration(self, t, pre, schedule_s, poll_s, sync_s, check_s) -> float | None:
        """Nothing to run: spin while requests wait for grammars, else sleep until the next arrival.

        While nothing can change (no arrival, no compile ending, no poll
        ending early), the loop repeats identical iterations; they are taken
        in one stride, their polls counted as if run one by one.
        """
        carry = self._carry_process_s
        self._carry_process_s = 0.0
        if not (self.grammar_queue or self.waiting):
            if pre > 0:  # a last poll (e.g. the one that timed the queue out) still ran
                self.idle_iterations += 1
                self.steps.rows.append((t, pre + carry, "idle", 0, 0, 0, 0, 0, 0, schedule_s, poll_s, sync_s,
                                        check_s, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, pre + carry, 0.0, 0.0, 0.0, 0, 0,
                                        self._stretch))
            return None
        cfg = self.cfg
        duration = max(pre + carry, cfg.idle_spin_s)
        repeats = self._idle_repeats(t + duration, poll_s, check_s)
        if repeats:
            step = max(cfg.schedule_s * self._stretch + poll_s + sync_s + check_s, cfg.idle_spin_s)
            duration += repeats * step
            poll_s, sync_s, check_s = (1 + repeats) * poll_s, (1 + repeats) * sync_s, (1 + repeats) * check_s
        self.idle_iterations += 1 + repeats
        self.steps.rows.append((t, duration, "idle", 0, 0, 0, 0, 0, 0, schedule_s, poll_s, sync_s, check_s,
                                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, duration, 0.0, 0.0, 0.0, 0, 0, self._stretch))
        return duration

    def _agree_for_real(self, queued: np.ndarray, seen: np.ndarray, gave_up: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, float]:
        """Each rank's ready and failed sets through the real all_gather: (ready, failed, measured seconds)."""
        cfg = self.cfg
        agreement = self._ranks.agree([queued[seen[:, r]].tolist() for r in range(cfg.ranks)],
                                     [queued[gave_up[:, r]].tolist() for r in range(cfg.ranks)])
        return np.isin(queued, agreement.ready), np.isin(queued, agreement.failed), agreement.seconds

    def _idle_repeats(self, t_next: float, poll_s: float, check_s: float) -> int:
        """How many identical idle iterations follow one that ends at ``t_next`` (0 when unsure)."""
        cfg = self.cfg
        full_poll = self.grammar_queue and cfg.readiness == "blocking_poll" and poll_s == cfg.poll_interval_s
        if full_poll and self._ranks is not None:
            return 0  # every poll runs its own real all_gather
        waiting_unready = [rid for rid in self.waiting if math.isnan(self.rec.grammar_ready_s[rid])]
        if not full_poll and not (check_s > 0 and len(waiting_unready) == len(self.waiting)):
            return 0
        if cfg.readiness == "blocking_poll" and self.waiting:
            return 0
        schedule_s = cfg.schedule_s * self._stretch
        step = max(schedule_s + poll_s + (cfg.all_gather_s if cfg.ranks > 1 and full_poll else 0.0) + check_s,
                   cfg.idle_spin_s)
        pending = np.array(self.grammar_queue + waiting_unready, np.int64)
        done = self.done_at[pending]
        change = min(self.queue.peek_time(), float(done.max(axis=1).min()))
        change = min(change, self._stretch_until)
        if full_poll and cfg.poll_early_exit:
            change = min(change, float(done.max(axis=0).min()))
        repeats = int((change - t_next) // step) - 1
        if repeats <= 0:
            return 0
        if full_poll:
            queued = np.array(self.grammar_queue, np.int64)
            if cfg.max_poll_iterations is not None:
                repeats = min(repeats, cfg.max_poll_iterations - 1 - int(self.wait_ct[queued].max()))
                if repeats <= 0:
                    return 0
            # poll j (1..repeats) starts at t_next + (j-1)·step; its last check sees compiles done by then
            last_check = t_next + schedule_s + (cfg.poll_naps - 1) * cfg.poll_interval_s / cfg.poll_naps
            seen_at = np.ceil((self.done_at[queued] - last_check) / step - 1e-9) + 1
            self.wait_ct[queued] += np.clip(seen_at - 1, 0, repeats).astype(np.int64)
        return repeats
