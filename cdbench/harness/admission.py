"""Admission and batch forming: which rows one step runs, and which of them sample.

The second phase of the scheduler's iteration (:mod:`cdbench.harness.scheduler`). Decode rows run
first (with speculative decoding, ``k`` draft tokens each while their output lasts), then continuing
prefill chunks, first come first served, then new requests in waiting-queue order while rows and
the token budget last: a prompt over the budget runs a chunk of it (chunked prefill), or waits, or
runs alone in an empty batch. A request whose grammar is not known to be ready is checked on the
way (vLLM) and, not ready yet, keeps its place while later ones pass it. With
``mixed_batches=False`` a step with prefill runs no decode rows. The rows that sample are the decode
rows and the prefill rows whose prompt completes now.

The common steps (all rows decode; or every new prompt fits whole) select their rows as slices of
the running batch (views) instead of index arrays (gathers).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from cdbench.harness.batch import RunningBatch
from cdbench.harness.executors.base import constant_ints
from cdbench.harness.kv_cache import KVCache
from cdbench.harness.policies import SchedulerConfig
from cdbench.harness.records import RequestTable

_any = np.count_nonzero  # (the cheapest "any" and sum on small arrays: see scheduler.py)
_sum = np.add.reduce
_NO_ROWS = np.zeros(0, np.int64)

Rows = slice | np.ndarray  # running-batch rows: an index array, or a slice where they are contiguous


class StepPlan(NamedTuple):
    """One iteration's formed batch, and the loop's time before it runs (a tuple, cheap to build
    once a step).

    ``schedule_s``/``poll_s``/``sync_s``/``check_s``: the loop's batch forming (stretched by
    contention), grammar-queue poll, ranks' agreement and readiness checks; ``pre``: their sum.
    Without rows to run (``runs`` false) the other fields are empty. ``dec_rows``: decode rows;
    ``drafts``: their draft tokens (``None`` without speculative decoding), ``n_drafts`` in all;
    ``pf_rows``/``pf_chunks``: prefill rows and the chunk each runs, ``pf_tokens`` in all;
    ``first_rows``: prefill rows whose prompt completes; ``s_rows``: the rows that sample (decode,
    then first rows), ``s_rid``/``s_drafts`` their requests and drafts; ``dec_sel``/``pf_sel``
    index the decode and prefill rows' columns; ``everyone``: every row of the batch decodes.
    """

    schedule_s: float
    poll_s: float
    sync_s: float
    check_s: float
    pre: float
    runs: bool
    dec_rows: np.ndarray
    dec_sel: Rows
    drafts: np.ndarray | None
    n_drafts: int
    pf_rows: np.ndarray
    pf_chunks: np.ndarray
    pf_sel: Rows
    pf_tokens: int
    first_rows: np.ndarray
    s_rows: Rows
    s_rid: np.ndarray
    s_drafts: np.ndarray
    everyone: bool

    @classmethod
    def idle(cls, schedule_s: float, poll_s: float, sync_s: float, check_s: float, pre: float) -> StepPlan:
        """An iteration without rows to run."""
        none = _NO_ROWS
        return cls(schedule_s, poll_s, sync_s, check_s, pre, False, none, none, None, 0, none, none, none, 0, none,
                   none, none, none, False)


class BatchFormer:
    """Forms each iteration's batch from the running batch and the waiting queue.

    Parameters
    ----------
    cfg : the policy (token budget, row limit, chunked prefill, mixed batches, drafts, row costs).
    rec : the request table (prompt lengths, grammars; admission times are written here).
    batch : the running batch, which admitted requests join.
    waiting : the waiting queue, in admission order.
    check : vLLM's readiness check of one request at a time: (ready, seconds it cost).
    release : takes a request's ready grammar; ``False`` when it failed (the request aborted).
    kv : the KV cache that bounds the batch (``None``: unbounded).
    """

    def __init__(self, cfg: SchedulerConfig, rec: RequestTable, batch: RunningBatch, waiting: deque[int],
                 check: Callable[[int, float], tuple[bool, float]], release: Callable[[int, float], bool],
                 kv: KVCache | None = None) -> None:
        self.cfg, self.rec, self.batch, self.waiting, self.kv = cfg, rec, batch, waiting, kv
        self._check, self._release = check, release
        self._prefill = batch.entry_prefill  # tokens each request prefills when admitted
        # 0..n-1 for the decode rows of an all-decode batch (sliced, not rebuilt, each step)
        self._rows = np.arange(cfg.max_running_requests if cfg.max_running_requests < 1 << 16 else 0)

    def entered(self) -> None:
        """The batch's entries were made anew (more request slots)."""
        self._prefill = self.batch.entry_prefill

    def form(self, t: float, stretch: float, schedule_s: float, poll_s: float, sync_s: float,
             check_s: float, admit: bool = True) -> StepPlan:
        """The batch of the iteration at ``t`` after its poll and checks: decode rows, prefill chunks
        and admitted requests (which join the running batch); ``stretch``: the loop's CPU stretch;
        ``admit``: waiting requests may join (not after a preemption)."""
        cfg, batch, kv = self.cfg, self.batch, self.kv
        pre = schedule_s + poll_s + sync_s + check_s
        k = cfg.spec_tokens
        n_rows = len(batch)
        room = cfg.max_running_requests - n_rows
        if kv is not None:
            kv.settled = False  # (its free blocks are counted again this pass)
            if admit:
                kv.evicted = 0
            if kv.max_seqs is not None:
                room = min(room, kv.max_seqs - n_rows)
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
        drafts = None
        if cfg.mixed_batches:
            if k:
                drafts = np.minimum(k, (batch.gen_left if all_decode else batch.gen_left[dec_rows]) - 1)
                n_drafts = int(_sum(drafts))
            else:
                n_drafts = 0
            budget = cfg.max_batched_tokens - len(dec_rows) - n_drafts
            if len(pf_rows):
                pf_chunks = self._allocate(pf_rows, budget)
            else:
                pf_chunks = _NO_ROWS
            if kv is not None:
                pf_chunks = self._make_room(t + pre, dec_rows, all_decode, drafts, pf_rows, pf_chunks, admit)
                if pf_chunks is None:  # requests were preempted: the batch is formed again without them
                    return self.form(t, stretch, schedule_s, poll_s, sync_s, check_s, admit=False)
            if len(pf_rows):
                budget -= int(_sum(pf_chunks))
            if admit and self.waiting and room > 0 and budget > 0:
                new_ids, new_chunks, c, new_whole = self._admit(t + pre, budget, room)
                check_s += c
        else:
            pf_chunks = self._allocate(pf_rows, cfg.max_batched_tokens)
            if kv is not None and len(pf_rows):
                pf_chunks = self._make_room(t + pre, _NO_ROWS, False, None, pf_rows, pf_chunks, admit)
                if pf_chunks is None:
                    return self.form(t, stretch, schedule_s, poll_s, sync_s, check_s, admit=False)
            if len(pf_rows) or (self.waiting and room > 0):
                budget = cfg.max_batched_tokens - int(_sum(pf_chunks))
                if admit and self.waiting and room > 0 and budget > 0:
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
            if kv is not None and len(dec_rows):  # a decode step
                if self._make_room(t + pre, dec_rows, all_decode, drafts, _NO_ROWS, _NO_ROWS, admit,
                                   len(dec_rows) + n_drafts) is None:
                    return self.form(t, stretch, schedule_s, poll_s, sync_s, check_s, admit=False)
        if kv is not None and kv.max_seqs is not None and self.waiting and n_rows + len(new_ids) >= kv.max_seqs:
            kv.wait(self.waiting[0], t + pre)  # the slots are all taken: the next in line waits for one
        if cfg.schedule_row_s:
            schedule_s += cfg.schedule_row_s * (n_rows + len(new_ids)) * stretch
        timing = (schedule_s, poll_s, sync_s, check_s, schedule_s + poll_s + sync_s + check_s)
        return self._place(t, timing, dec_rows, all_decode, drafts, n_drafts, pf_rows, pf_chunks, new_ids,
                           new_chunks, new_whole)

    def form_lone(self, t: float, stretch: float, schedule_s: float, poll_s: float, sync_s: float,
                  check_s: float) -> StepPlan | None:
        """:meth:`form` where it forms a batch of the one waiting request's whole prompt alone (batches not
        mixed, no prefill in flight: the decode rows wait), in fewer calls: the same plan, admission and KV
        blocks. ``None`` where it would form another (then :meth:`form` forms it; a refused admission, asked
        again there, is refused the same)."""
        cfg, batch, kv, waiting = self.cfg, self.batch, self.kv, self.waiting
        n_rows = len(batch)
        if (len(waiting) != 1 or cfg.mixed_batches or cfg.spec_tokens or n_rows >= cfg.max_running_requests
                or (kv is not None and kv.max_seqs is not None) or _any(batch.prefill_left)):
            return None
        rid = waiting[0]
        rec = self.rec
        if rec.structured[rid] and math.isnan(rec.grammar_ready_s[rid]):  # (checked first: vLLM)
            return None
        prompt = int(self._prefill[rid])
        if prompt > cfg.max_batched_tokens:
            return None
        if kv is not None:
            kv.settled = False  # (as form's admission: its free blocks counted again, SGLang's estimate)
            kv.evicted = 0
            kv.start_admission()
            if not kv.admit(rid, prompt, True, t + schedule_s + poll_s + sync_s + check_s):
                return None
        waiting.popleft()
        if cfg.schedule_row_s:
            schedule_s += cfg.schedule_row_s * (n_rows + 1) * stretch
        pre = schedule_s + poll_s + sync_s + check_s
        at = t + pre
        if kv is not None and kv.recomputing:  # a preempted request keeps its first admission time (np.fmin's)
            first = float(rec.admitted_s[rid])
            at = first if first <= at else at
        rec.admitted_s[rid] = at
        ids = np.array((rid,), np.int64)
        batch.append(ids)
        rows = np.arange(n_rows, n_rows + 1)
        return StepPlan(schedule_s, poll_s, sync_s, check_s, pre, True, _NO_ROWS, _NO_ROWS, None, 0, rows,
                        np.array((prompt,), np.int64), slice(n_rows, None), prompt, rows, rows, ids,
                        constant_ints(0, 1), False)

    def _make_room(self, t: float, dec_rows: np.ndarray, all_decode: bool, drafts: np.ndarray | None,
                   pf_rows: np.ndarray, pf_chunks: np.ndarray, admit: bool,
                   dec_tokens: int | None = None) -> np.ndarray | None:
        """Allocate the KV blocks of the step's running rows (decode rows: 1 + drafts tokens; prefill rows:
        their chunk; ``dec_tokens``: the decode rows' tokens, when known): the prefill chunks that fit
        (SGLang caps them to the free blocks), or ``None`` when requests were preempted (vLLM) or
        retracted (SGLang) and the batch must be formed again."""
        kv, batch = self.kv, self.batch
        n_dec = len(dec_rows)
        if dec_tokens is not None and kv.policy == "sglang" and kv.block == 1:  # the common decode step
            victims = kv.sglang_victims(None, dec_rows, decay=admit, need=dec_tokens)
            if len(victims):
                self.waiting.extend(kv.evict(victims, t).tolist())  # at the tail, in retraction order
                return None
            return pf_chunks
        if all_decode:  # (no prefill in flight: every row decodes)
            dec_new = 1 if drafts is None else 1 + drafts
        else:
            dec_new = np.zeros(len(batch), np.int64)
            if n_dec:
                dec_new[dec_rows] = 1 if drafts is None else 1 + drafts
        if kv.policy == "vllm":
            new = dec_new
            if len(pf_rows):
                new = dec_new.copy()
                new[pf_rows] = pf_chunks + (pf_chunks == batch.prefill_left[pf_rows])  # (+ a completing one's token)
            kept = kv.vllm_keep(new)
            if kept == len(batch):
                return pf_chunks
            rids = kv.evict(np.arange(kept, len(batch)), t)
            self.waiting.extendleft(rids[::-1].tolist())  # at the front, in their running order
            return None
        if kv.policy == "sglang" and n_dec:
            victims = kv.sglang_victims(dec_new, dec_rows, decay=admit, need=dec_tokens)
            if len(victims):
                self.waiting.extend(kv.evict(victims, t).tolist())  # at the tail, in retraction order
                return None
        if len(pf_rows):
            return kv.fit_chunks(pf_rows, pf_chunks, dec_new)
        if kv.policy != "sglang" or not n_dec:
            kv.reserve(dec_new)
        return pf_chunks

    def _place(self, t: float, timing: tuple[float, float, float, float, float], dec_rows: np.ndarray,
               all_decode: bool, drafts: np.ndarray | None, n_drafts: int, pf_rows: np.ndarray,
               pf_chunks: np.ndarray, new_ids: list[int], new_chunks: list[int], new_whole: bool) -> StepPlan:
        """The plan of the formed batch (``timing``: the plan's first fields): the admitted requests join
        the running batch at ``t`` + the loop's time before the step, and the rows that run and sample."""
        batch = self.batch
        if len(pf_rows):  # continuing prompts: those the budget reached run a chunk
            reached = pf_chunks > 0
            pf_rows, pf_chunks = pf_rows[reached], pf_chunks[reached]
        continuing = len(pf_rows) > 0
        if new_ids:
            ids = np.array(new_ids, np.int64)
            if self.kv is not None and self.kv.recomputing:  # a preempted request keeps its first admission time
                self.rec.admitted_s[ids] = np.fmin(self.rec.admitted_s[ids], t + timing[4])
            else:
                self.rec.admitted_s[ids] = t + timing[4]
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
        if len(dec_rows) == 0 and len(pf_rows) == 0:
            return StepPlan.idle(*timing)
        # indexes the prefill rows' columns: a slice (views, not gathers) when they are the new rows alone
        pf_sel = slice(first_new, None) if new_ids and not continuing else pf_rows
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
        if everyone or (all_decode and n_dec + n_first == len(batch)):
            # the common steps (all decode; or every new prompt fits now): the sampling rows are the
            # whole batch, in order, so slices (views) instead of gathers
            s_rows = slice(None)
        elif n_first:
            s_rows = np.concatenate((dec_rows, first_rows)) if n_dec else first_rows
        else:
            s_rows = dec_rows
        if drafts is None:
            s_drafts = constant_ints(0, n_dec + n_first)
        elif n_first:
            s_drafts = np.concatenate((drafts, constant_ints(0, n_first)))
        else:
            s_drafts = drafts
        # decode rows are the batch's first n_dec rows when no prefill was in flight before this step
        dec_sel = slice(0, n_dec) if all_decode else dec_rows
        pf_tokens = int(_sum(pf_chunks)) if len(pf_rows) else 0
        return StepPlan(*timing, True, dec_rows, dec_sel, drafts, n_drafts, pf_rows, pf_chunks, pf_sel, pf_tokens,
                        first_rows, s_rows, batch.rid[s_rows], s_drafts, everyone)

    def _admit(self, t: float, budget: int, room: int) -> tuple[list[int], list[int], float, bool]:
        """New requests from the waiting queue: (ids, prefill chunks, readiness-check seconds, whether
        every admitted prompt runs whole in this step)."""
        cfg, rec, kv = self.cfg, self.rec, self.kv
        waiting = self.waiting
        admitted: list[int] = []
        chunks: list[int] = []
        skipped: list[int] = []
        check_s = 0.0
        whole = True
        if kv is not None:
            kv.start_admission()
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
            prompt = int(self._prefill[rid])
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
            if kv is not None and not kv.admit(rid, chunk, chunk == prompt, t + check_s):
                waiting.appendleft(rid)  # waits for memory; admission stops
                break
            admitted.append(rid)
            chunks.append(chunk)
            budget -= chunk
            room -= 1
        if skipped:
            waiting.extendleft(reversed(skipped))
        return admitted, chunks, check_s, whole

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
