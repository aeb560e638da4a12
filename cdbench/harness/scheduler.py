"""The scheduler loop: one discrete-event model of SGLang's and vLLM's schedulers.

One :class:`Scheduler` runs every mechanism; :class:`~cdbench.harness.policies.SchedulerConfig`
says which variant of each (a preset is a configuration, not a code path of its own). Events are
arrivals (a request's grammar compiles meanwhile, :meth:`Scheduler._arrive`) and iterations. Each
iteration at virtual time ``t`` runs these phases (:meth:`Scheduler._iterate`):

1. **Contention.** The compiles running now stretch the loop's CPU work where they and the loops
   outnumber ``host_cpus`` (``model`` and ``hybrid``, :mod:`~cdbench.harness.contention`): batch
   forming, fills and their wrapper, transfer, processing and launch take demand / cores as long,
   and a parallel fill's wall counts its pool's threads instead of the loop.
2. **Readiness** (:mod:`~cdbench.harness.readiness`). SGLang: when the grammar queue is not empty,
   one blocking poll (readiness checks every ``interval/naps``, an early exit when everything is
   ready, ``max_poll_iterations`` before a timeout), then with ``R`` ranks an all_gather: ready =
   ready on every rank, failed = failed on any (priced at ``all_gather_s``, or run for real among
   ``R`` rank processes with ``collectives="gloo"`` or ``"nccl"``,
   :mod:`~cdbench.harness.collectives`). vLLM: each waiting request whose grammar is not ready costs
   up to ``check_timeout_s`` when the admission loop inspects it.
3. **Admission and batch** (:mod:`~cdbench.harness.admission`). Decode rows and continuing prefill
   chunks, then new requests in waiting-queue order while rows and the token budget last (chunked
   prefill). With ``mixed_batches=False`` a prefill batch runs alone. With a KV cache
   (:mod:`~cdbench.harness.kv_cache`), the rows' blocks first: vLLM preempts, SGLang retracts, and
   admission stops where blocks run out. Nothing to run: an idle iteration, identical ones taken in
   one stride.
4. **Grammar work** from the executor: mask fill per row (serial, or on a thread pool above a row
   threshold: the executor prices or times the pool's wall time,
   :class:`~cdbench.harness.executors.base.ParallelFill`), drafts (1 + k mask rows), verification,
   rollback, jump-forward — as arrays over the step's rows. In ``live`` mode the forward starts on
   the GPU first and runs beside it.
5. **Time** (:mod:`~cdbench.harness.step_cost`), priced, or measured in ``live`` mode, with the
   engine's own host code around the grammar work (measured, ``policies.py``). Without overlap:
   ``pre + max(forward, fill + copy) + apply + sample + process``. With overlap, a batch holding any
   grammar row waits for the previous step's processing and this step's mask: ``max(forward, pre +
   process(prev) + fill + copy) + apply + sample``; a batch without one: ``max(forward + sample,
   pre + process(prev))``; vLLM 0.10 / 0.11's pageable bitmask copy waits for the forward (with overlap the loop
   waits too, and may schedule the next step while the GPU applies and samples), and its model runner builds the
   copied array beside the forward. Either way the host's launch of the step (``launch_s``;
   ``launch_prefill_s`` for a step with prefill chunks) is added: the GPU waits for it. A decode
   step's forward is priced at the next CUDA-graph capture size (``cuda_graph_sizes``), as the
   engines pad it.
6. **Results.** The batch advances by the tokens produced; counters are kept per step and summed
   in bulk (:mod:`~cdbench.harness.tallies`); finished and refused requests leave; the step is logged.

Per-request Python runs only at events (arrival, release, admission, finish, abort); everything per
token is a numpy operation over the running batch, which is kept as a struct of arrays.

Between events most iterations are the same decode step again: every row decodes one token, nothing
waits (and any compile polled is not seen done), and only the rows' positions and context move. Such a
run of steps is taken at once
(:meth:`Scheduler._decode_run`: the executor's fills, the pricing and the records of each step as arrays
over the steps), on past the steps where rows emit their last token (they leave, the others decode on),
and never past the next event; the steps are the ones the iterations above give, value for value. Every
other iteration runs the phases.
"""

from __future__ import annotations

import gc
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import pandas as pd

from cdbench.harness.admission import BatchFormer, StepPlan
from cdbench.harness.batch import RunningBatch
from cdbench.harness.collectives import RankAgreement
from cdbench.harness.compile_errors import CompileErrors
from cdbench.harness.compile_service import CompilePools, GrammarCache
from cdbench.harness.contention import HostCores
from cdbench.harness.costs.gpu import FixedGpuCosts, GpuCosts, RooflineGpuCosts
from cdbench.harness.events import EventKind, EventQueue
from cdbench.harness.executors.base import (
    CompileOutcome,
    GrammarExecutor,
    ParallelFill,
    SpecKeys,
    StepRows,
    StepWork,
    constant_ints,
)
from cdbench.harness.kv_cache import (
    SGLANG_MIN_NEW_TOKEN_RATIO,
    SGLANG_NEW_TOKEN_RATIO_DECAY,
    KVCache,
    kv_step_columns,
)
from cdbench.harness.metrics import LogHistogram
from cdbench.harness.policies import SchedulerConfig
from cdbench.harness.readiness import (
    blocking_poll,
    blocking_poll_one_rank,
    check,
    first_checks,
    idle_repeats,
)
from cdbench.harness.records import (
    ABORT_REASONS,
    CACHE_RESULTS,
    DraftPositionCounts,
    RequestTable,
    StepLog,
)
from cdbench.harness.step_cost import StepCost, StepPricer
from cdbench.harness.tallies import StepTallies
from cdbench.harness.timeline import Timeline
from cdbench.workloads.request import Request

if TYPE_CHECKING:
    from cdbench.harness.live.step import LiveStep

# Per-step calls on small arrays cost mostly call overhead: count_nonzero is the cheapest
# "any" (several times cheaper than a ufunc reduction), and the direct ufunc reduction the
# cheapest sum (ndarray.sum adds a Python-level wrapper).
_any = np.count_nonzero
_sum = np.add.reduce
_min = np.minimum.reduce
_max = np.maximum.reduce

_ABORT = {name: i for i, name in enumerate(ABORT_REASONS)}
_CACHE = {name: i for i, name in enumerate(CACHE_RESULTS)}
_KIND_DECODE, _KIND_PREFILL, _KIND_MIXED = "decode", "prefill", "mixed"


class Scheduler:
    """Simulate ``requests`` under ``config``.

    Parameters
    ----------
    config : the policy (every mechanism's parameters).
    requests : the workload, in any order (sorted by arrival here); or, not held, an iterable yielding
        ``count`` of them in scheduler order (by arrival, then id: a generated workload's stream), read once
        here a chunk at a time, so that no more than a chunk of them is held at once.
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

    def __init__(self, config: SchedulerConfig, requests: Sequence[Request] | Iterable[Request], executor: GrammarExecutor,
                 gpu: GpuCosts, seed: int = 0, max_concurrency: int | None = None,
                 timeline: Timeline | None = None, on_progress: Callable[[int], None] | None = None,
                 live: LiveStep | None = None, count: int | None = None) -> None:
        self.cfg, self.executor, self.gpu, self.live = config, executor, gpu, live
        self.timeline, self.on_progress = timeline, on_progress
        self._ranks: RankAgreement | None = None  # the rank processes of real collectives, while run() runs
        self.max_concurrency = max_concurrency
        seeds = np.random.SeedSequence(seed).spawn(2)
        self.rng_compile = np.random.default_rng(seeds[0])
        self.rng_step = np.random.default_rng(seeds[1])

        n = self.n = count if count is not None else len(requests)  # type: ignore[arg-type]
        held = isinstance(requests, Sequence)
        if held:
            requests = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        # an executor reading the requests by position: each its own slot, entered up front; otherwise a request
        # takes a slot as it is issued and gives it back once its row is handed out (take_finished), so the
        # slots held are those from the oldest request not handed out to the newest issued
        self.reuse = not executor.reads_requests
        capacity = min(n, _SLOTS) if self.reuse else n
        rec = self.rec = RequestTable(capacity)
        if self.reuse:
            self.keys = SpecKeys(fresh_copies=not held)
        else:
            self.keys = SpecKeys.of(_entering(requests, rec), n)
            rec.spec_key[:] = self.keys.request_key
        self._incoming = iter(requests)  # the requests not entered yet
        self._ahead: list[int] = []  # the slots of the requests entered and not issued yet, in order
        self._ahead_at = 0  # (from this one on)
        self._last_arrival = -math.inf
        self.gen_total = rec.think_tokens + rec.output_len
        parallel = config.fill_parallel_threshold is not None and config.spec_tokens == 0  # (vLLM: no spec decoding)
        pool = ParallelFill(config.fill_parallel_threshold, config.fill_chunk, config.fill_threads,
                            config.accept_parallel)
        executor.prepare(requests if held else (), self.keys, capacity,
                         jump_forward=config.jump_forward, parallel_fill=pool if parallel else None,
                         drafts=config.spec_tokens > 0)
        self._outcomes: dict[int, CompileOutcome] = {}
        self._errors = CompileErrors()  # failed copies' (forgotten otherwise), compactly: about 1 % of a run of copies
        self._order: deque[int] = deque()  # issued slots whose rows were not handed out, in scheduler order
        self._free: list[int] = []  # slots to reuse
        self._used = 0  # slots handed out so far
        self._retired: list[pd.DataFrame] = []  # rows handed out of their slots, not taken yet (take_finished)

        R = config.ranks
        self.done_at = np.full((capacity, R), np.inf)
        self._ready_at = [math.inf] * capacity  # done_at's maximum per request (the last rank's end), for checks
        self.grammar_ok = np.ones(capacity, bool)
        self.wait_ct = np.zeros((capacity, R), np.int64)
        # the host's cores, where its threads can outnumber them (live mode runs its steps for real)
        host = HostCores(config.host_cpus, config.compile_cores, R)
        fill_threads = config.fill_threads if parallel else 1
        self._host = host if (config.host_contention and live is None
                              and host.can_exceed(R * config.compile_threads, fill_threads)) else None
        self._stretch = 1.0  # this iteration's stretch of the loop's CPU work (contention.py)
        self._stretch_until = math.inf  # when a compile thread frees and the stretch may change
        self._compiles, self._counted_until, self._counted_assigned = 0, -math.inf, -1  # the last count's
        self.pools = CompilePools(R, config.compile_threads, config.rank_jitter, config.rank_compile_scale,
                                  self._host, config.rank_jitter_by_size)
        self.cache = GrammarCache(config.cache, config.cache_write, config.cache_dedup_inflight,
                                  config.cache_capacity, config.cache_failures)

        self.queue = EventQueue()
        self.waiting: deque[int] = deque()
        self.grammar_queue: list[int] = []
        # each request's batch columns as it is admitted, so admission is one gather
        entry_ints = np.zeros((len(RunningBatch.INTS), capacity), np.int64)
        entry_ints[0], entry_ints[1] = np.arange(capacity), rec.prompt_len
        entry_ints[3], entry_ints[4] = self.gen_total, rec.think_tokens
        self.batch = RunningBatch(entry_ints)
        self.kv = KVCache.build(config, gpu, live, rec, self.batch, self.gen_total)
        self._refused = self.kv.too_long(config.spec_tokens) if self.kv is not None else None
        self.former = BatchFormer(config, rec, self.batch, self.waiting, self._check, self._release, self.kv)
        self.pricer = StepPricer(config, gpu, self._host, executor.settle, seed)
        self.steps = StepLog()
        self.itl = LogHistogram()
        self.fill_hist = LogHistogram()
        self.draft_positions = DraftPositionCounts(config.spec_tokens)
        self.tallies = StepTallies(rec, self.draft_positions if config.spec_tokens else None, config.jump_forward)
        self.ended = 0
        self.idle_iterations = 0
        self._carry_process_s = 0.0  # overlap: last step's result processing, paid in the next iteration
        self._carry_cpu_s = 0.0  # scheduler-thread work done at events (cache-hit copies)
        self._next_arrival = 0
        self._in_flight = 0
        self._idle = True
        # whether runs of identical decode steps may be taken at once (_decode_run): not where a step's draws,
        # rows' tokens or KV bookkeeping vary in ways the run does not follow
        kv = self.kv
        # ... and through SGLang's polls of one rank that see no compile done (the same seconds each, a count each)
        self._blind_polls = config.readiness == "blocking_poll" and config.ranks == 1
        # ... and on past a row's last token (its leaving issues nothing in an open loop; a pinned bitmask's copy
        # waits for nothing, so a step's parts depend on the rows through their counts only)
        self._past_finish = max_concurrency is None and config.pinned_mask
        self._step_s = 0.0  # the last step taken in a run: how long the next run's steps may take, roughly
        self._step_col = np.arange(_RUN)[:, None]  # a run's step numbers, as a column
        # whether a prompt run alone takes its step in Python scalars (_lone_prompt): not with drafts or live steps
        self._lone_prompts = live is None and not config.spec_tokens
        self._runs = (live is None and isinstance(gpu, RooflineGpuCosts | FixedGpuCosts)  # (priced, not measured)
                      and not config.spec_tokens and not config.jump_forward
                      and config.mask_apply == "batched" and not self.pricer.fill_waits
                      and (kv is None or (kv.max_seqs is None
                                          and (kv.policy == "vllm" or (kv.policy == "sglang" and kv.block == 1)))))

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
            self.tallies.flush()
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
                run = self._decode_run(t) if self._runs else None
                if run is not None:  # identical decode steps, taken at once
                    end, steps = run
                    q.push(end, EventKind.ITERATION)
                else:
                    duration = self._iterate(t)
                    if duration is None:
                        self._idle = True
                    else:
                        q.push(t + duration, EventKind.ITERATION)
                    steps = 1
                if self.on_progress is not None and (iterations + steps) >> 8 != iterations >> 8:
                    self.on_progress(self.ended)
                iterations += steps
        if self.on_progress is not None:
            self.on_progress(self.ended)
        if next(self._incoming, None) is not None:
            raise ValueError(f"the workload gave more requests than the {self.n} it said it holds")

    def _issue_next(self, now: float) -> None:
        """Put the next request's arrival on the event queue (under a closed loop, only if a slot is free)."""
        if self._next_arrival >= self.n:
            return
        if self.max_concurrency is not None:
            if self._in_flight >= self.max_concurrency:
                return
            self._in_flight += 1
        if self._ahead_at == len(self._ahead):
            self._enter_ahead()
        rid = self._ahead[self._ahead_at]
        self._ahead_at += 1
        self._next_arrival += 1
        self._order.append(rid)
        self.queue.push(max(now, float(self.rec.arrival_s[rid])), EventKind.ARRIVAL, rid)

    def _enter_ahead(self) -> None:
        """Enter the next requests, up to :data:`_AHEAD` of them, into their slots at once (array writes), to
        be issued one by one."""
        start = self._next_arrival
        want = min(_AHEAD, self.n - start)
        chunk = list(islice(self._incoming, want))
        if len(chunk) < want:
            raise ValueError(f"the workload gave {start + len(chunk)} requests, not the {self.n} it said it holds")
        if self.reuse:
            rids = self._take_slots(len(chunk))
            rec = self.rec
            self._last_arrival = _enter(rec, rids, chunk, self._last_arrival)
            entered = [self.keys.enter(r) for r in chunk]
            keys = np.fromiter((key for key, _ in entered), np.int64, len(chunk))
            instances = [instance for _, instance in entered]
            rec.spec_key[rids] = keys
            prompt, think = rec.prompt_len[rids], rec.think_tokens[rids]
            gen_total = self.gen_total[rids] = think + rec.output_len[rids]
            self.batch.enter(rids, prompt, gen_total, think)
            if self._refused is not None:
                self._refused[rids] = self.kv.too_long(self.cfg.spec_tokens, prompt, gen_total)
        else:
            rids = np.arange(start, start + len(chunk))
            keys = self.keys.request_key[rids]
            instances = self.keys.request_instance[start:start + len(chunk)]
        self.executor.enter(rids, chunk, keys, instances)
        self._ahead, self._ahead_at = rids.tolist(), 0

    # ------------------------------------------------------------------ request slots

    def _take_slots(self, k: int) -> np.ndarray:
        """``k`` free slots: given back ones (the earliest given back first), then ones never used; when too
        few are left, the ended requests' rows are handed out, and the slots doubled where that leaves no more
        than an eighth of them free."""
        free = self._free
        if len(free) + len(self.rec.finish_s) - self._used < k:
            self._retire()
            left = len(free) + len(self.rec.finish_s) - self._used
            if left < k or left <= len(self.rec.finish_s) // 8:
                self._grow(max(2 * len(self.rec.finish_s), self._used + k))
        reused = free[:-k - 1:-1] if k <= len(free) else free[::-1]
        del free[len(free) - len(reused):]
        fresh = k - len(reused)
        self._used += fresh
        return np.array(reused + list(range(self._used - fresh, self._used)), np.int64)

    def _retire(self) -> None:
        """Hand out the rows of the ended requests that every request before them in scheduler order precedes
        (kept in :attr:`_retired` until taken), their slots given back where slots are reused."""
        self.tallies.flush()  # the ended requests' counters are in the table (summing early changes nothing)
        finish, order = self.rec.finish_s, self._order
        done = []
        while order and finish[order[0]] == finish[order[0]]:  # (not NaN: ended)
            done.append(order.popleft())
        if done:
            self._hand_out(done)

    def _hand_out(self, done: list[int]) -> None:
        rows = np.array(done, np.int64)
        self._retired.append(self.rec.to_frame(rows))
        if self.reuse:
            self._clear(rows)
            self._free.extend(reversed(done))  # (the earliest given back is reused first)

    def _clear(self, rows: np.ndarray) -> None:
        """Slots ``rows`` as before any request took them."""
        self.rec.clear(rows)
        self.done_at[rows] = np.inf
        for rid in rows.tolist():
            self._ready_at[rid] = math.inf
        self.grammar_ok[rows] = True
        self.wait_ct[rows] = 0
        if self.kv is not None:
            self.kv.clear(rows)

    def _grow(self, capacity: int) -> None:
        """Room for ``capacity`` request slots."""
        rec = self.rec
        old = len(rec.finish_s)
        rec.grow(capacity)
        self.gen_total = _grown(self.gen_total, capacity, 0)
        self.done_at = _grown(self.done_at, capacity, np.inf)
        self._ready_at.extend([math.inf] * (capacity - old))
        self.grammar_ok = _grown(self.grammar_ok, capacity, True)
        self.wait_ct = _grown(self.wait_ct, capacity, 0)
        if self._refused is not None:
            self._refused = _grown(self._refused, capacity, False)
        self.batch.grow(capacity)
        self.former.entered()
        if self.kv is not None:
            self.kv.grow(capacity, self.gen_total)
        self.tallies.entered(rec)
        self.executor.grow(capacity)

    def take_finished(self) -> pd.DataFrame:
        """The rows of the requests ended since the last call that every earlier request's row precedes, in
        scheduler order (``valid`` unchecked: outputs are checked at the end of the run)."""
        self._retire()
        return self._taken()

    def take_rest(self) -> pd.DataFrame:
        """The rows of every ended request not taken yet (a run stopped early), in scheduler order."""
        self._retire()
        finish = self.rec.finish_s
        done = [rid for rid in self._order if finish[rid] == finish[rid]]
        self._order.clear()
        if done:
            self._hand_out(done)
        return self._taken()

    def _taken(self) -> pd.DataFrame:
        frames, self._retired = self._retired, []
        if not frames:
            return self.rec.to_frame(np.zeros(0, np.int64))
        return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)

    def requests_frame(self) -> pd.DataFrame:
        """Every request's row in scheduler order, after the run (``valid`` as checked): those taken before
        are not in it."""
        if not self.reuse:
            return self.rec.to_frame()
        return self.take_finished()

    # ------------------------------------------------------------------ arrival and compile

    def _outcome(self, key: int) -> CompileOutcome:
        outcome = self._outcomes.get(key)
        if outcome is None:
            outcome = self.executor.compile(key)
            if self.keys.fresh(key):  # no other request compiles it: only a failure is kept, for compile_errors
                if outcome.error is not None:
                    self._errors.add(key, self.keys.texts[key], outcome.error)
            else:
                self._outcomes[key] = outcome
        return outcome

    @property
    def compile_errors(self) -> CompileErrors:
        """Specs that failed to compile (cache key text → the backend's reason), in key order."""
        return self._errors.merged({k: (self.keys.texts[k], o.error) for k, o in self._outcomes.items()
                                    if o.error is not None})

    def _arrive(self, rid: int, t: float) -> None:
        rec, cfg = self.rec, self.cfg
        rec.issued_s[rid] = t
        if self._refused is not None and self._refused[rid]:
            self._abort(rid, "kv_capacity", t)  # the engine refuses a context its cache can never hold
            return
        if not rec.structured[rid]:
            self.waiting.append(rid)
            return
        self.executor.arrive(rid)
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
            # a pooled cache hit makes a round trip through the compile pool; a miss compiles (once: a key no other
            # request compiles is not kept, so asking again would compile it again)
            outcome = None if found == "hit" else self._outcome(key)
            seconds = cfg.cache_hit_s if outcome is None else outcome.seconds
            if cfg.ranks == 1:  # scalars: one-element arrays cost more than the bookkeeping itself
                first, last, thread = self.pools.submit_one(t, seconds)
                end, skew = None, 0.0
                self._trace_compile((first,), (last,), (thread,), key, found)
            else:
                start, end, threads = self.pools.submit(t, seconds, self.rng_compile)
                first, last, skew = float(start.min()), float(end.max()), float(end.max() - end.min())
                self._trace_compile(start, end, threads, key, found)
            if outcome is not None:  # (a miss)
                self.grammar_ok[rid] = outcome.error is None
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
        if self.timeline is not None and self.timeline.recording:
            name = "cache hit" if found == "hit" else f"compile {self.keys.texts[key][:40]}"
            self.timeline.compile_spans(name, start, end, thread)

    def _abort(self, rid: int, reason: str, t: float) -> None:
        self.rec.abort[rid] = _ABORT[reason]
        self.executor.abort(rid)
        self.rec.finish_s[rid] = t
        self._end(rid, t)

    def _end(self, rid: int, t: float) -> None:
        if self.keys.fresh_copies:
            key = int(self.rec.spec_key[rid])
            if self.keys.fresh(key):  # no other request has its spec: what is kept of it goes
                self.keys.forget(key)
                self.cache.forget(key)
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
        """SGLang's blocking poll of the grammar queue at ``t0`` and the ranks' agreement on it, whose
        ready grammars are released and failed requests abort; returns (poll seconds, all_gather seconds)."""
        cfg = self.cfg
        if cfg.ranks == 1 and self._ranks is None and len(self.grammar_queue) <= _FEW_QUEUED:  # (no peers to agree)
            return self._poll_few(t0)
        queued = np.array(self.grammar_queue, np.int64)
        poll_s, seen = blocking_poll(self.done_at[queued], t0, cfg)
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
        if _any(ready) or _any(failed):
            self._settle_poll(queued.tolist(), ready.tolist(), failed.tolist(), t0 + poll_s + sync_s)
        return poll_s, sync_s

    def _poll_few(self, t0: float) -> tuple[float, float]:
        """:meth:`_poll` of a queue of a few requests on one rank, in Python scalars (the same values)."""
        cfg, queue, wait_ct = self.cfg, self.grammar_queue, self.wait_ct
        ready_at = self._ready_at  # (one rank: its compile's end)
        poll_s, seen = blocking_poll_one_rank([ready_at[rid] for rid in queue], t0, cfg)
        limit = cfg.max_poll_iterations
        ready, failed = [], []
        for rid, was_seen in zip(queue, seen):
            if not was_seen:
                wait_ct[rid, 0] += 1
            gave_up = limit is not None and wait_ct[rid, 0] >= limit
            ready.append(was_seen and not gave_up)
            failed.append(gave_up)
        if any(ready) or any(failed):
            self._settle_poll(queue, ready, failed, t0 + poll_s)
        return poll_s, 0.0

    def _settle_poll(self, queued: list[int], ready: list[bool], failed: list[bool], t: float) -> None:
        """After a poll of the grammar queue ``queued``: the ``ready`` requests released at ``t`` (rejoining the
        waiting line at its tail), the ``failed`` ones aborted (their grammar timed out), the rest kept queued."""
        keep = []
        for rid, is_ready, has_failed in zip(queued, ready, failed):
            if is_ready:
                if self._release(rid, t):
                    self.waiting.append(rid)  # rejoins at the tail
            elif has_failed:
                self.cache.timed_out(int(self.rec.spec_key[rid]))
                self._abort(rid, "grammar_timeout", t)
            else:
                keep.append(rid)
        self.grammar_queue = keep

    def _agree_for_real(self, queued: np.ndarray, seen: np.ndarray, gave_up: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, float]:
        """Each rank's ready and failed sets through the real all_gather: (ready, failed, measured seconds)."""
        cfg = self.cfg
        agreement = self._ranks.agree([queued[seen[:, r]].tolist() for r in range(cfg.ranks)],
                                     [queued[gave_up[:, r]].tolist() for r in range(cfg.ranks)])
        return np.isin(queued, agreement.ready), np.isin(queued, agreement.failed), agreement.seconds

    def _check(self, rid: int, t: float) -> tuple[bool, float]:
        """vLLM's readiness check of one request at ``t``: (ready, seconds it cost)."""
        return check(self._ready_at[rid], t, self.cfg.check_timeout_s)

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

    # ------------------------------------------------------------------ one iteration

    def _iterate(self, t: float) -> float | None:
        """Run one scheduler iteration starting at ``t``, phase by phase (see the module docstring);
        its duration, or ``None`` when idle."""
        cfg = self.cfg
        if self._host is not None:
            pools = self.pools
            # the running count holds until a thread frees or a compile is assigned: counted only then
            if t >= self._counted_until or pools.assigned != self._counted_assigned:
                self._count_compiles(t)
            stretch = self._stretch
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
        plan = self.former.form_lone(t, stretch, schedule_s, poll_s, sync_s, check_s) if self.waiting else None
        if plan is None:
            plan = self.former.form(t, stretch, schedule_s, poll_s, sync_s, check_s)
        elif self._lone_prompts and not self.batch.think_left[-1]:  # (the prompt's row is the batch's last)
            return self._lone_prompt(t, plan, stretch)
        if not plan.runs:
            return self._idle_iteration(t, plan.pre, plan.schedule_s, plan.poll_s, plan.sync_s, plan.check_s)
        carry = self._carry_process_s
        work, sync, has_grammar, n_filter, think_left, any_thinking = self._start_step(plan, carry)
        cost = self.pricer.price(plan, work, self.batch.cached, n_filter, sync, has_grammar, carry, stretch,
                                 self._compiles, self.live)
        self._carry_process_s = cost.carry_out
        self._apply(plan, work, t + cost.duration - cost.after_token, think_left, any_thinking)
        self._record(t, plan, work, cost, sync, has_grammar, carry, stretch)
        return cost.duration

    def _lone_prompt(self, t: float, plan: StepPlan, stretch: float) -> float:
        """The rest of :meth:`_iterate` for a batch of one prompt alone, whole, not thinking
        (:meth:`BatchFormer.form_lone`): :meth:`_start_step` and :meth:`_apply` in Python scalars (the same
        values), the step priced and logged as any. Its duration."""
        cfg, batch, rec = self.cfg, self.batch, self.rec
        row = len(batch) - 1
        rid = int(plan.s_rid[0])
        grammar = bool(rec.structured[rid])
        sync = not cfg.overlap
        carry = self._carry_process_s
        work = self.executor.step_one(rid, int(batch.gen_left[row]), grammar, self.rng_step)
        cost = self.pricer.price(plan, work, batch.cached, 0, sync, grammar, carry, stretch, self._compiles, None)
        self._carry_process_s = cost.carry_out
        t_token = t + cost.duration - cost.after_token
        produced = work.produced
        chunk, emitted = plan.pf_tokens, int(produced[0])
        batch.prefill_left[row] -= chunk
        batch.cached[row] += chunk
        batch.gen_left[row] -= emitted
        batch.cached[row] += emitted
        batch.last_tok[row] = t_token
        kv = self.kv
        if kv is not None and kv.recomputing:  # (a recomputed request's first token stays the first: np.fmin's)
            first = float(rec.first_token_s[rid])
            rec.first_token_s[rid] = first if first <= t_token else t_token
        else:
            rec.first_token_s[rid] = t_token
        self.tallies.add([plan.s_rid, produced, work.jumped] if cfg.jump_forward else [plan.s_rid, produced], 1)
        done = batch.gen_left[row] <= 0
        if work.ended is not None:
            done = done or bool(work.ended[0])
        rejected = work.rejected if cfg.abort_on_reject else None
        if rejected is not None or done:
            self._leave(plan.s_rows, plan.s_rid, np.array((done,)), rejected, t_token)
        self._record(t, plan, work, cost, sync, grammar, carry, stretch)
        return cost.duration

    def _decode_run(self, t: float) -> tuple[float, int] | None:
        """From ``t``, the iterations that are identical decode steps of the running batch, taken at once:
        ``(time of the iteration after them, how many)``, or ``None`` (the iteration at ``t`` runs alone).

        Such a run is every row decoding one token a step, nothing waiting, no thinking rows, and nothing in
        the grammar queue or (SGLang, one rank) only compiles that each step's poll does not see done: each
        step then pays the poll's interval and counts a poll of its requests, and the run stops before the
        step whose poll would see one done or give up on one. Where a row emits its last token, it leaves
        after that step, as after any step, and the rows left go on in the same run (a segment of fewer
        rows: an open loop issues nothing then, and with the bitmask in pinned memory a step's parts
        depend on its rows only through their counts); the run stops before a step where anything else
        could happen: a grammar that ends or refuses a token (the executor's
        :meth:`GrammarExecutor.decode_run`), the KV cache's blocks running out, the next event (an arrival),
        the host's count of running compiles changing, or no grammar row left.
        Between those, each step's costs follow from the rows' positions and context, so the steps are
        priced as arrays (:meth:`StepPricer.price_decode_run`) and their records written as the steps one by
        one write them: the step log's rows, the histograms (binned at the same steps), the counters.
        """
        batch = self.batch
        n = len(batch)
        if not n or self.waiting or _any(batch.prefill_left) or _any(batch.think_left):
            return None
        queue = self.grammar_queue
        if queue and (not self._blind_polls or self._ranks is not None):  # (a poll agreed with peers is not priced)
            return None
        tl = self.timeline
        if tl is not None and tl.recording:
            return None
        cfg = self.cfg
        if self._host is not None:  # (as the iteration would count them first)
            if t >= self._counted_until or self.pools.assigned != self._counted_assigned:
                self._count_compiles(t)
            stretch = self._stretch
            until = min(self.queue.peek_time(), self._counted_until)
        else:
            stretch = 1.0
            until = self.queue.peek_time()
        if queue and not self._polls_blind(t + (cfg.schedule_s + self._carry_cpu_s) * stretch):
            return None  # (the iteration's poll, after its scheduling, sees a compile done)
        gen_left = batch.gen_left
        first = int(_min(gen_left))  # the steps up to a row's last token
        steps = min(first, _RUN)
        if steps < _MIN_RUN:
            return None
        cached = int(_sum(batch.cached))
        kv = self.kv
        if kv is not None and kv.policy == "sglang":  # (blocks of one token) a step needs one free token a row
            steps = min(steps, (kv.blocks - cached) // n)
            if steps < _MIN_RUN:
                return None
        limit = _RUN
        if queue and cfg.max_poll_iterations is not None:  # nor does any request give up
            limit = cfg.max_poll_iterations - 1 - max(int(self.wait_ct[q, 0]) for q in queue)
            steps = min(steps, limit)
            if steps < _MIN_RUN:
                return None
        rid = batch.rid
        structured = self.rec.structured[rid]
        horizon = steps
        if steps == first and self._past_finish:  # past the first row's last token the others go on, up to the
            horizon = min(int(_max(gen_left)), _RUN, limit)  # last one's, or about as far as the next event
            if until - t < horizon * self._step_s:  # (steps priced past it are priced in vain: the guess only
                horizon = min(horizon, max(first, int((until - t) / self._step_s * 1.25) + 1))  # bounds the work)
        run = self.executor.decode_run(rid, structured, gen_left, horizon)
        if run is None or run.steps < _MIN_RUN:
            return None
        has_grammar = bool(_any(structured))
        steps = min(run.steps, horizon)
        fill, accept = run.fill_s, run.accept_s
        grammar_rows = fill.shape[1]
        if steps > first:  # rows leave within the run: its segments
            seg = self._segments(steps, cached, structured, has_grammar)
            if seg is None:
                return None
            steps = seg.steps
        if steps <= first:  # (the whole batch throughout)
            seg = None
            n_step = g_step = None
            context = cached + n * self._step_col[:steps, 0]  # the rows' context: one token more a row a step
            if kv is not None and kv.policy == "vllm":  # each row allocates the blocks of its next token
                used = _sum((batch.cached + kv.block + self._step_col[:steps]) // kv.block, axis=1)
                fits = int(np.searchsorted(used > kv.blocks, True))  # (used grows step by step)
                if fits < _MIN_RUN:
                    return None
                steps, context, used = fits, context[:fits], used[:fits] * kv.block
            elif kv is not None:
                used = context + n
            # (a row-wise reduction of a C-ordered array sums each row as the reduction of that row alone)
            fill_sum = _sum(fill[:steps], axis=1) if grammar_rows else None
            process = _sum(accept[:steps], axis=1)
            rows, g_rows, lengths = n, grammar_rows, (steps,)
        else:  # each segment's grammar rows summed as a run of those rows alone sums them
            n_step, g_step, context, used = seg.n_step, seg.g_step, seg.context, seg.used
            if grammar_rows < _SUMMED_IN_TURN:  # (the rows gone as 0.0, which adds nothing to a sum left to right)
                g_alive = seg.g_alive[:steps]
                fill_sum = _sum(np.where(g_alive, fill[:steps], 0.0), axis=1) if grammar_rows else None
                process = _sum(np.where(g_alive, accept[:steps], 0.0), axis=1)
            else:
                fill_sum = np.empty(steps) if grammar_rows else None
                process = np.empty(steps)
                for a, b in zip(seg.starts, seg.stops):
                    cols = None if g_step[a] == grammar_rows else seg.g_alive[a].nonzero()[0]
                    if grammar_rows:
                        _sum(fill[a:b] if cols is None else fill[a:b].take(cols, axis=1), axis=1, out=fill_sum[a:b])
                    _sum(accept[a:b] if cols is None else accept[a:b].take(cols, axis=1), axis=1, out=process[a:b])
            rows, g_rows, lengths = n_step, g_step, [b - a for a, b in zip(seg.starts, seg.stops)]
        # the loop's batch forming as the iteration prices it; the first step also pays the work done at events
        schedule = np.empty(steps)
        schedule.fill(cfg.schedule_s * stretch)  # (np.full's own Python costs more, per run)
        schedule[0] = (cfg.schedule_s + self._carry_cpu_s) * stretch
        poll_s = 0.0
        if queue:  # each step's poll sees no compile done (the first's, seen above), or the run stops before it
            polled_at = schedule.copy()  # (a step polls after its scheduling, before the rows' share of it)
            poll_s = cfg.poll_interval_s
        if cfg.schedule_row_s:
            schedule += cfg.schedule_row_s * rows * stretch
        cost = self.pricer.price_decode_run(rows, g_rows, lengths, schedule + poll_s if queue else schedule,
                                            self._carry_process_s, fill_sum, process, context, not cfg.overlap,
                                            has_grammar, stretch)
        starts = np.empty(steps + 1)
        starts[0] = t
        starts[1:] = cost.duration
        np.add.accumulate(starts, out=starts)  # (np.cumsum's sequential adds: each start as the loop adds it)
        k = 1 + int(starts[1:steps].searchsorted(until))  # steps that start before the next event
        if queue:  # up to the step whose poll would see a compile done (the first's does not)
            polled_at += starts[:steps]
            k = min(k, self._polls_blind_until(polled_at[:k]))
            for queued in queue:  # (each poll a count of its requests not seen)
                self.wait_ct[queued, 0] += k
        starts = starts[:k + 1]
        after = cost.after_token  # (step_time's fields are arrays, or one value for every step)
        t_token = starts[1:] - (after[:k] if isinstance(after, np.ndarray) else after)
        if seg is None or k <= first:
            itl = np.empty(k * n)
            itl[:n] = t_token[0] - batch.last_tok
            itl[n:] = (t_token[1:] - t_token[:-1]).repeat(n)
            self.itl.add_steps(itl, n)
            batch.gen_left -= k
            batch.cached += k
            batch.last_tok[:] = t_token[-1]
            self.tallies.add([rid, constant_ints(k, n)], n * k)  # (shared, read-only: the counters only read them)
            if grammar_rows:
                self.fill_hist.add_steps(fill[:k].ravel(), grammar_rows, constant_ints(1, k * grammar_rows))
            done = batch.gen_left <= 0
            if _any(done):  # (the run's last step) rows that emitted their last token leave
                self._leave(slice(None), rid, done, None, float(t_token[-1]))
        else:  # each row's tokens up to its last or the run's end; rows leave after their last token's step
            n_step, g_step = n_step[:k], g_step[:k]
            itl = np.empty(int(_sum(n_step)))
            itl[:n] = t_token[0] - batch.last_tok
            itl[n:] = (t_token[1:] - t_token[:-1]).repeat(n_step[1:])
            self.itl.add_steps(itl, n_step)
            tokens = np.minimum(gen_left, k)
            self.tallies.add([rid, tokens], len(itl))
            if grammar_rows:
                values = fill[:k][seg.g_alive[:k]]  # (step by step, each step's rows in order)
                self.fill_hist.add_steps(values, g_step, constant_ints(1, len(values)))
            left = gen_left <= k
            leaving = rid[left]
            last = tokens[left] - 1  # (the step of each one's last token)
            batch.gen_left -= tokens
            batch.cached += tokens
            batch.last_tok[:] = t_token[tokens - 1]
            self.rec.finish_s[leaving] = t_token[last]
            for i in last.argsort(kind="stable").tolist():  # (in the order the steps one by one end them)
                self._finished(int(leaving[i]), float(t_token[last[i]]))
            batch.keep((~left).nonzero()[0])
        if kv is None:
            kv_used = 0
        else:
            kv_used = used[:k]
            kv.free = kv.blocks - int(used[k - 1]) // kv.block
            kv.settled, kv.evicted = True, 0
            if kv.policy == "sglang":
                ratio = kv.ratio
                for _ in range(k):  # (decayed step by step, as the steps round it)
                    if ratio == SGLANG_MIN_NEW_TOKEN_RATIO:
                        break
                    ratio = max(ratio - SGLANG_NEW_TOKEN_RATIO_DECAY, SGLANG_MIN_NEW_TOKEN_RATIO)
                kv.ratio = ratio
        carry = cost.carry_out
        self._carry_process_s = float(carry[k - 1]) if isinstance(carry, np.ndarray) else carry
        self._carry_cpu_s = 0.0
        c = cost
        self._step_s = float(c.duration[k - 1])
        self.steps.add_block(k, (
            starts[:k], c.duration[:k], _KIND_DECODE, _steps(c.dec_tokens, k), _steps(c.dec_tokens, k), 0,
            _steps(c.grammar_rows, k), _steps(c.mask_rows, k), _steps(c.dec_tokens, k), schedule[:k], poll_s, 0.0, 0.0,
            c.forward_s[:k], c.fill_s[:k], _steps(c.copy_s, k), _steps(c.apply_s, k), _steps(c.sample_s, k),
            c.process_s[:k], c.exposed[:k], c.hidden[:k], _steps(c.transfer_s, k), _steps(c.launch_s, k),
            _steps(c.dec_tokens, k), context[:k], stretch, kv_used, 0))
        return float(starts[k]), k

    def _segments(self, steps: int, cached: int, structured: np.ndarray, has_grammar: bool) -> _Segments | None:
        """A decode run's first ``steps`` steps, rows leaving after their last token's step, cut before a step
        where the KV cache's blocks run out or no grammar row is left; ``None`` where it is cut before its first
        step."""
        batch, kv = self.batch, self.kv
        gen_left = batch.gen_left
        col = self._step_col[:steps]
        alive = gen_left > col  # (steps, rows): a row of g tokens left emits its last at step g - 1
        n_step = _sum(alive, axis=1)  # (booleans summed as integers)
        g_alive = alive if len(structured) == _any(structured) else alive.compress(structured, axis=1)
        g_step = n_step if g_alive is alive else _sum(g_alive, axis=1)
        cut = [steps]
        if has_grammar and not g_step[-1]:  # (the grammar rows leave first)
            cut.append(int(np.searchsorted(-g_step, 0)))
        context = _sum(np.where(alive, batch.cached + col, 0), axis=1)
        used = None
        if kv is not None and kv.policy == "sglang":  # one free token a row a step
            used = context + n_step
            over = used > kv.blocks
            if _any(over):
                cut.append(int(over.argmax()))
        elif kv is not None:  # each row allocates the blocks of its next token
            used = _sum(np.where(alive, (batch.cached + kv.block + col) // kv.block, 0), axis=1)
            over = used > kv.blocks
            if _any(over):
                cut.append(int(over.argmax()))
            used *= kv.block
        steps = min(cut)
        if steps < _MIN_RUN:
            return None
        stops = sorted({left for left in gen_left.tolist() if left < steps})  # (a few rows: one numpy call)
        if not stops or stops[-1] != steps:
            stops.append(steps)
        return _Segments(steps, [0, *stops[:-1]], stops, n_step[:steps], g_step[:steps], g_alive, context[:steps],
                         None if used is None else used[:steps])

    def _polls_blind(self, t0: float) -> bool:
        """Whether the poll at ``t0`` sees none of the queued compiles done (:meth:`_poll_few`)."""
        seen = blocking_poll_one_rank([self._ready_at[rid] for rid in self.grammar_queue], t0, self.cfg)[1]
        return not any(seen)

    def _polls_blind_until(self, polled_at: np.ndarray) -> int:
        """How many of the polls at times ``polled_at`` (ascending) see none of the queued compiles done: the
        readiness check of :func:`~cdbench.harness.readiness.blocking_poll`, over the polls at once."""
        cfg = self.cfg
        done = np.array([self._ready_at[rid] for rid in self.grammar_queue])
        seen = (first_checks(done[None, :], polled_at[:, None], cfg) <= cfg.poll_naps - 1).any(axis=1)
        return int(np.searchsorted(seen, True))  # (sighted from one poll on, by every later one)

    def _count_compiles(self, t: float) -> None:
        """Count the compiles running at ``t`` and the stretch of the loop's CPU work they make."""
        pools = self.pools
        self._compiles = pools.running(t)
        self._stretch = self._host.stretch(self._compiles)
        self._counted_until, self._counted_assigned = pools.next_free(t), pools.assigned
        # idle strides repeat this iteration's stretch only while no compile thread frees
        self._stretch_until = self._counted_until if self._stretch > 1.0 else math.inf

    def _start_step(self, plan: StepPlan, carry: float) -> tuple[StepWork, bool, bool, int, np.ndarray, int]:
        """Start the step: the live forward first, then the grammar's work on the sampling rows. Returns the
        work, ``sync`` (no overlap), whether a row waits for a mask, token-filtered rows, thinking left."""
        cfg, batch = self.cfg, self.batch
        k = cfg.spec_tokens
        s_rows, s_rid = plan.s_rows, plan.s_rid
        think_left = batch.think_left[s_rows]
        structured = self.rec.structured[s_rid]  # (one gather a step: cheaper than a batch column to add and drop)
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
            pf_chunks = plan.pf_chunks
            has_pf = len(plan.pf_rows) > 0
            live.begin(batch.cached[plan.dec_sel], plan.drafts if k else constant_ints(0, len(plan.dec_rows)),
                       pf_chunks, batch.cached[plan.pf_sel] if has_pf else pf_chunks, sync,
                       plan.pre if sync else plan.pre + carry, batch.rid[plan.dec_sel],
                       batch.rid[plan.pf_sel] if has_pf else pf_chunks, batch.rid)
        work = self.executor.step(StepRows(s_rid, grammar, plan.s_drafts, batch.gen_left[s_rows], think_left),
                                  self.rng_step)
        if any_thinking:  # thinking rows under a token filter: all structured ones if strict, else forced ends
            filtered = structured & thinking
            if not cfg.strict_thinking:
                filtered &= self.rec.forced_think_end[s_rid] & (think_left == 1)
            n_filter = int(np.count_nonzero(filtered))
        else:
            n_filter = 0
        return work, sync, has_grammar, n_filter, think_left, any_thinking

    def _apply(self, plan: StepPlan, work: StepWork, t_token: float, think_left: np.ndarray,
               any_thinking: int) -> None:
        """Apply the step's results at ``t_token``, when its tokens are out: the batch advances, the
        counters are kept, and requests that finished or whose token the grammar refused leave."""
        cfg, rec, batch = self.cfg, self.rec, self.batch
        s_rows, s_rid = plan.s_rows, plan.s_rid
        produced = work.produced
        if plan.pf_tokens:
            pf_sel, pf_chunks = plan.pf_sel, plan.pf_chunks
            batch.prefill_left[pf_sel] -= pf_chunks
            batch.cached[pf_sel] += pf_chunks
        batch.gen_left[s_rows] -= produced
        if any_thinking:
            batch.think_left[s_rows] = np.maximum(think_left - produced, 0)
        batch.cached[s_rows] += produced
        if len(plan.dec_rows):
            self.itl.add(t_token - (batch.last_tok if plan.everyone else batch.last_tok[plan.dec_sel]), None)
        batch.last_tok[s_rows] = t_token
        if len(plan.first_rows):
            first = batch.rid[plan.first_rows]
            # (a recomputed request's prefill samples again: its first token stays the first)
            kv = self.kv
            rec.first_token_s[first] = np.fmin(rec.first_token_s[first], t_token) \
                if kv is not None and kv.recomputing else t_token
        # kept until summed (the executor's arrays are new each step; rid columns are never written)
        tally = [s_rid, produced]
        if cfg.spec_tokens:
            tally += (plan.s_drafts if work.drafted is None else work.drafted, work.accepted, work.rolled_back)
        if cfg.jump_forward:
            tally.append(work.jumped)
        self.tallies.add(tally, len(s_rid))

        done = batch.gen_left[s_rows] <= 0
        if work.ended is not None:
            done |= work.ended
        rejected = work.rejected if cfg.abort_on_reject else None
        if rejected is not None or _any(done):
            self._leave(s_rows, s_rid, done, rejected, t_token)

    def _leave(self, s_rows: slice | np.ndarray, s_rid: np.ndarray, done: np.ndarray, rejected: np.ndarray | None,
               t_token: float) -> None:
        """The sampled rows ``s_rows`` (requests ``s_rid``) that are ``done`` finish at ``t_token``, those whose token
        the grammar ``rejected`` abort, and both leave the batch."""
        batch = self.batch
        if rejected is not None:
            for rid in s_rid[rejected].tolist():
                self._abort(rid, "grammar_rejected", t_token)
            done &= ~rejected
        finished = s_rid[done]
        self.rec.finish_s[finished] = t_token
        for rid in finished.tolist():
            self._finished(rid, t_token)
        left = done if rejected is None else done | rejected  # per sampled row
        if isinstance(s_rows, slice):  # the sampled rows are the whole batch, in order
            gone = left
        else:
            gone = np.zeros(len(batch), bool)
            gone[s_rows[left]] = True
        batch.keep((~gone).nonzero()[0])

    def _finished(self, rid: int, t: float) -> None:
        """Request ``rid`` finished at ``t`` (its finish time written): its grammar's state and what is kept of
        its spec go."""
        self.executor.finish(rid)
        self._end(rid, t)

    def _record(self, t: float, plan: StepPlan, work: StepWork, cost: StepCost, sync: bool, has_grammar: bool,
                carry: float, stretch: float) -> None:
        """Log the step (its row of the step log, the mask-fill histogram, the timeline's spans)."""
        n_dec, n_pf = len(plan.dec_rows), len(plan.pf_rows)
        kind = _KIND_MIXED if n_dec and n_pf else (_KIND_DECODE if n_dec else _KIND_PREFILL)
        schedule_s, poll_s, sync_s, check_s = plan.schedule_s, plan.poll_s, plan.sync_s, plan.check_s
        (duration, _, exposed, hidden, _, forward_s, fill_s, copy_s, apply_s, sample_s, process_s, transfer_s,
         launch_s, grammar_rows, mask_rows, dec_tokens, kv) = cost
        self.steps.rows.append((t, duration, kind, len(plan.s_rid), n_dec, plan.pf_tokens, grammar_rows, mask_rows,
                                int(_sum(work.produced)), schedule_s, poll_s, sync_s, check_s, forward_s, fill_s,
                                copy_s, apply_s, sample_s, process_s, exposed, hidden, transfer_s, launch_s,
                                dec_tokens, kv, stretch, *kv_step_columns(self.kv)))
        if grammar_rows:
            self.fill_hist.add(work.fill_s / work.mask_rows, work.mask_rows)
        tl = self.timeline
        if tl is not None and tl.recording:
            tl.steps_seen += 1
            tl.step_spans(t, sync, has_grammar, schedule_s, poll_s + sync_s + check_s, carry, launch_s, forward_s,
                          fill_s, copy_s + transfer_s, apply_s, sample_s, process_s, duration)
            if self.kv is not None:
                tl.kv_span(t, duration, self.kv.used_tokens(), self.kv.tokens, self.kv.evicted)

    # ------------------------------------------------------------------ idle

    def _idle_iteration(self, t: float, pre: float, schedule_s: float, poll_s: float, sync_s: float,
                        check_s: float) -> float | None:
        """Nothing to run: spin while requests wait for grammars, else sleep until the next arrival.

        While nothing can change (no arrival, no compile ending, no poll
        ending early), the loop repeats identical iterations; they are taken
        in one stride, their polls counted as if run one by one.
        """
        carry = self._carry_process_s
        self._carry_process_s = 0.0
        if self.kv is not None and not len(self.batch):
            self.kv.idle()
        if not (self.grammar_queue or self.waiting):
            if pre > 0:  # a last poll (e.g. the one that timed the queue out) still ran
                self.idle_iterations += 1
                self._log_idle(t, pre + carry, schedule_s, poll_s, sync_s, check_s)
            return None
        cfg = self.cfg
        duration = max(pre + carry, cfg.idle_spin_s)
        repeats = self._idle_repeats(t + duration, poll_s, check_s)
        if repeats:
            step = max(cfg.schedule_s * self._stretch + poll_s + sync_s + check_s, cfg.idle_spin_s)
            duration += repeats * step
            poll_s, sync_s, check_s = (1 + repeats) * poll_s, (1 + repeats) * sync_s, (1 + repeats) * check_s
        self.idle_iterations += 1 + repeats
        self._log_idle(t, duration, schedule_s, poll_s, sync_s, check_s)
        return duration

    def _log_idle(self, t: float, duration: float, schedule_s: float, poll_s: float, sync_s: float,
                  check_s: float) -> None:
        """An idle iteration's row of the step log: all of its time is exposed host work."""
        self.steps.rows.append((t, duration, "idle", 0, 0, 0, 0, 0, 0, schedule_s, poll_s, sync_s, check_s,
                                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, duration, 0.0, 0.0, 0.0, 0, 0, self._stretch,
                                *kv_step_columns(self.kv)))

    def _idle_repeats(self, t_next: float, poll_s: float, check_s: float) -> int:
        """How many identical idle iterations follow one that ends at ``t_next`` (0 when unsure)."""
        return idle_repeats(self.cfg, t_next, poll_s, check_s, self.grammar_queue, self.waiting,
                            self.rec.grammar_ready_s, self.done_at, self.wait_ct, self.queue.peek_time(),
                            self._stretch, self._stretch_until, self._ranks is not None)


_CHUNK = 1 << 16  # requests a table's rows are entered at a time


def _entering(requests: Iterable[Request], rec: RequestTable) -> Iterator[Request]:
    """``requests`` (in scheduler order), each chunk's rows entered into ``rec`` before its requests are
    yielded; a request's arrival earlier than the one before it is refused."""
    chunk: list[Request] = []
    start, last = 0, -math.inf
    for r in requests:
        chunk.append(r)
        if len(chunk) == _CHUNK:
            last = _enter(rec, slice(start, start + len(chunk)), chunk, last)
            yield from chunk
            start += len(chunk)
            chunk = []
    if chunk:
        _enter(rec, slice(start, start + len(chunk)), chunk, last)
        yield from chunk
        start += len(chunk)
    if start != rec.n:
        raise ValueError(f"the workload gave {start} requests, not the {rec.n} it said it holds")


def _enter(rec: RequestTable, at: slice | np.ndarray, chunk: list[Request], last: float) -> float:
    """Enter ``chunk`` into rows ``at`` of ``rec``; a request arriving before the one before it (``last``: the
    arrival before the chunk's) is refused; returns the chunk's last arrival."""
    rec.enter(at, chunk)
    arrivals = rec.arrival_s[at]
    earlier = np.flatnonzero(np.diff(arrivals, prepend=last) < 0)
    if len(earlier):
        i = int(earlier[0])
        before = float(arrivals[i - 1]) if i else last
        raise ValueError(f"request {chunk[i].request_id} arrives at {chunk[i].arrival_s} s, before the request "
                         f"issued before it ({before} s): a workload not held must give its requests by arrival "
                         "time")
    return float(arrivals[-1])


class _Segments(NamedTuple):
    """A decode run's ``steps`` steps as segments (``starts[i]`` to ``stops[i]``), rows leaving between them
    (:meth:`Scheduler._decode_run`): per step its rows, grammar rows, the grammar rows still in it (as the
    run's columns: ``g_alive[j]``), the rows' context and the KV cache's tokens in use (``None``: no cache)."""

    steps: int
    starts: list[int]
    stops: list[int]
    n_step: np.ndarray
    g_step: np.ndarray
    g_alive: np.ndarray
    context: np.ndarray
    used: np.ndarray | None


def _steps(value, k: int):
    """A step log column of a decode run's first ``k`` steps: one value a step, or one for every step."""
    return value[:k] if isinstance(value, np.ndarray) else value


_FEW_QUEUED = 8  # a one-rank poll of at most this many queued requests runs in Python scalars (_poll_few)
_MIN_RUN = 1  # identical decode steps worth taking at once (_decode_run)
_RUN = 64  # the most taken at once (more are the next run's): steps priced past the next event are priced in vain
# numpy sums fewer values than this left to right, as Python adds them (more: pairwise, in 8 running sums;
# tests/harness/test_streamed_requests.py pins both): a sum of so few values is the same with zeros among them
_SUMMED_IN_TURN = 8

_SLOTS = 1 << 12  # request slots a scheduler reusing them starts with
_AHEAD = 1 << 8  # requests entered into their slots at a time, ahead of their issue


def _grown(array: np.ndarray, length: int, fill) -> np.ndarray:
    """``array`` with room for ``length`` entries along its first axis, the new ones ``fill``."""
    out = np.full((length, *array.shape[1:]), fill, array.dtype)
    out[:len(array)] = array
    return out
