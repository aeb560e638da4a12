"""``hybrid`` mode: the real grammar backend does every compile, fill, accept and rollback.

Each backend call is timed with ``time.perf_counter_ns`` and its measured
time is what the virtual clock advances by (the GPU side still comes from the
cost model). The times are wall-clock on purpose: an engine's scheduler waits
for the call's wall time, and CPU-time clocks get it wrong both ways —
``thread_time`` misses the work xgrammar's compiler does on its own threads,
``process_time`` counts every thread of the process (and costs several times
more per read). The price is noise: on a busy host a preempted call measures
long (the run's ``mask_row_p99_us`` shows it).

Structured requests carry their answer tokens (``Request.output_tokens``, EOS
last, e.g. a tokenized valid instance): they are the oracle the simulated
model "samples". A structured request without them is a random walk: the
token at each position is drawn from the mask row the backend just filled
(:class:`~cdbench.workloads.token_sources.RandomWalk`), and the request ends
when its grammar terminates (or at ``output_len``). Drafts for speculative
decoding come from the workload's :class:`~cdbench.workloads.drafts.DraftSource`
(a request without oracle tokens proposes none).

Thinking: with the ``reasoner`` backend, a thinking request's matcher starts in
its thinking phase (with the request's budget) and is fed seeded random
ordinary tokens, then the think-end token; with any other backend the grammar
does not advance while the model reasons (vLLM's behaviour), so thinking tokens
are counted but never materialised.
Unconstrained rows need no backend; their drafts are accepted with
probability ``alpha`` as in ``model`` mode.

Every finished structured output is decoded and checked against its spec once
the run is over (:func:`cdbench.workloads.validate.validity_check`: JSON
schemas through a validator compiled once per spec).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import itemgetter
from time import perf_counter_ns, thread_time_ns
from typing import TYPE_CHECKING

import numpy as np

from cdbench.backends.base import (
    CompiledGrammar,
    CompileError,
    GrammarBackend,
    Matcher,
)
from cdbench.backends.reasoner import ReasonerBackend
from cdbench.harness.costs.grammar_profile import GrammarProfile
from cdbench.harness.executors.base import (
    NO_FILL,
    CompileOutcome,
    GrammarExecutor,
    ParallelFill,
    Settlement,
    SpecKeys,
    StepRows,
    StepWork,
    accepted_drafts,
    constant_ints,
)
from cdbench.harness.executors.in_situ import InSituRecorder
from cdbench.workloads.drafts import DraftSource, OracleTokens, draft_lists
from cdbench.workloads.request import Request
from cdbench.workloads.token_sources import RandomWalk
from cdbench.workloads.validate import validity_check

if TYPE_CHECKING:
    import torch

_NS = 1e-9
_any = np.count_nonzero
_NO_ROWS = constant_ints(0, 0)
_VERDICTS_PER_SPEC = 4096  # remembered output verdicts per spec (a bound on memory, not a tuning knob)
_GRAMMARS_KEPT = 16  # compiled grammars kept for requests yet to start (a bound on memory, not a tuning knob)


def _gaps_s(stamps: list[int]) -> np.ndarray:
    """Seconds between consecutive ``perf_counter_ns`` stamps (an explicit dtype converts the list
    about three times faster than ``np.diff`` inferring one)."""
    ns = np.array(stamps, np.int64)
    return (ns[1:] - ns[:-1]) * _NS


def _fill_rows(fills: Sequence[Callable], mask: torch.Tensor, first: int) -> list[int]:
    """One parallel fill task: fill rows ``first``, ``first + 1``, ... of ``mask``; the thread's CPU
    clock around each fill (a row's own work: not the time its thread waited for a core or the GIL,
    which the pool's wall time holds)."""
    clock = thread_time_ns
    stamps = [clock()]
    stamp = stamps.append
    for row, fill in enumerate(fills, first):
        fill(mask, row)
        stamp(clock())
    return stamps


def build_draft_masks(matcher: Matcher, mask: torch.Tensor, drafts: Sequence[int]) -> tuple[int, int]:
    """Fill row 0, then accept each draft and fill its row, up to the first draft the grammar
    refuses; returns (drafts accepted, draft rows filled). A draft that ends the answer gets no
    row of its own (the engines skip it). The caller rolls back the accepted drafts it rejects.
    """
    matcher.fill_mask(mask, 0)
    valid = filled = 0
    for token in drafts:
        if not matcher.accept(token):
            break
        valid += 1
        if matcher.is_terminated():
            break
        filled += 1
        matcher.fill_mask(mask, filled)
    return valid, filled


@dataclass(slots=True)
class _Step:
    """One step's results as the executor's paths fill them (arrays parallel to the step's rows)."""

    produced: np.ndarray
    accepted: np.ndarray
    verified: np.ndarray | None
    fill_s: np.ndarray  # per row (grammar rows written by the paths)
    mask_rows: np.ndarray
    rolled_back: np.ndarray | None = None
    jumped: np.ndarray | None = None
    rejected: list[int] = field(default_factory=list)  # rows whose sampled token the grammar refused
    ended: list[int] = field(default_factory=list)  # random-walk rows whose grammar terminated
    backend_ns: int = 0  # mask building
    process_ns: int = 0  # accepts, rollbacks, jump-forward after sampling
    fill_wall_ns: int | None = None  # the fills ran on the parallel fill pool: its wall time

    def roll_back(self, rows: np.ndarray, counts: Sequence[int]) -> None:
        if self.rolled_back is None:
            self.rolled_back = np.zeros(len(self.produced), np.int64)
        self.rolled_back[rows] = counts


class HybridExecutor(GrammarExecutor):
    """Grammar work by a real backend, timed call by call.

    Parameters
    ----------
    backend : the grammar engine (bound to the run's vocabulary).
    alpha : draft acceptance for unconstrained rows (and of the default draft source).
    drafts : where drafts come from (default: a :class:`DraftSource` with ``alpha``, without instance pools).
    seed : seeds the default draft source, the default random walk and thinking tokens.
    walk : draws tokens for structured requests without oracle tokens
        (default: a :class:`RandomWalk` over the backend's vocabulary).
    kept_grammars : how many compiled grammars are kept for requests whose matcher is not made yet
        (least recently used first out).

    Attribute ``defer_accepts`` (``live`` mode without overlap, where the engine accepts the
    sampled tokens after sampling): the lean rows' accepts wait for :meth:`settle`; rows of
    the other paths accept inside :meth:`step`, since their mask building needs the results.

    A step's grammar rows take one of two paths. The common one — an oracle
    token, no drafts, no jump-forward — is one fill and one accept per row:
    all fills run first (each timed, with one clock read between
    consecutive fills, since the parallel-fill model and the mask-time
    histogram need per-row times), then all accepts under one clock pair (rows
    are independent matchers, so the order does not matter); token lookup and
    position advance are array operations. Every other row (drafts, random
    walk, jump-forward) runs the general per-row path.

    With the engine's parallel fill (:class:`~cdbench.harness.executors.base.ParallelFill`,
    given to :meth:`prepare`), a common step of more rows than its threshold
    fills them on a real thread pool, in tasks of ``chunk`` rows writing their
    own mask rows, and waits for all (as vLLM does): the step's fill is that
    wall time, GIL and shared cores included, and each row's own time is its
    task thread's CPU time (with more threads than free cores, a row's wall
    time would hold its neighbours' work, and a profile replaying it in a
    serial step would charge that too).

    Memory: a request's matcher is dropped when it ends or aborts, and a
    compiled grammar is kept only by the live matchers made from it and, for
    requests still to start, in a bounded least-recently-used set (dropped at
    once when no request left needs it). Compiled grammars of large
    vocabularies are big (outlines-core's index for a 248k-token vocabulary),
    so keeping every spec's made a long run grow without bound. A request
    whose grammar was evicted before its matcher was made recompiles it
    untimed (``recompiles``): the scheduler already charged that spec's one
    compile, so the timed calls are the same whatever the bound.
    """

    def __init__(self, backend: GrammarBackend, alpha: float = 0.0, drafts: DraftSource | None = None,
                 seed: int = 0, walk: RandomWalk | None = None, kept_grammars: int = _GRAMMARS_KEPT) -> None:
        if kept_grammars < 1:
            raise ValueError(f"kept_grammars must be at least 1, got {kept_grammars}")
        self.backend, self.alpha = backend, alpha
        vocab = backend.vocab
        self.walk = walk or RandomWalk(vocab.eos_token_ids, vocab.size, seed)
        self.drafts = drafts if drafts is not None else DraftSource(alpha, vocab, seed)
        ordinary = np.setdiff1d(np.arange(vocab.size), np.fromiter(vocab.forbidden_token_ids, np.int64))
        self._think_tokens = ordinary[ordinary != getattr(backend, "think_end_id", -1)]
        self._think_rng = np.random.default_rng([seed, 1])
        self._reasoner = isinstance(backend, ReasonerBackend)
        self.backend_call_s = 0.0
        self.validation_s = 0.0
        self._compiled: OrderedDict[int, CompiledGrammar] = OrderedDict()  # least recently used first
        self._kept_grammars = kept_grammars
        self.recompiles = 0  # evicted grammars compiled again, untimed, for a later request of their spec
        self._ended: list[tuple[int, int | list[int] | None]] = []  # (request, its output: see finish)
        self._matchers: dict[int, Matcher] = {}
        self._emitted: dict[int, list[int]] = {}  # random-walk requests: the tokens they emitted
        self._rejected: set[int] = set()
        self._eos = frozenset(vocab.eos_token_ids)
        self._mask = backend.allocate_mask(1)
        self.recorder = InSituRecorder()
        self.defer_accepts = False
        self._deferred: tuple | None = None  # the lean rows' accepts, until settle()
        self._deferred_step: tuple | None = None

    reads_requests = True

    def prepare(self, requests: Sequence[Request], keys: SpecKeys, capacity: int | None = None,
                jump_forward: bool = False, parallel_fill: ParallelFill | None = None, drafts: bool = True) -> None:
        super().prepare(requests, keys, capacity, jump_forward, parallel_fill, drafts)
        self._pool = None
        if parallel_fill is not None:
            self._pool = ThreadPoolExecutor(parallel_fill.threads, thread_name_prefix="cdbench-fill")
            weakref.finalize(self, self._pool.shutdown, wait=False)
        n = len(requests)
        short = [r.request_id for r in requests
                 if r.output_tokens is not None and r.spec is not None and len(r.output_tokens) < r.output_len]
        if short:
            raise ValueError(f"requests {short[:10]} have fewer output_tokens than output_len "
                             f"({len(short)} in all): the oracle must cover every answer token")
        oracle = self._oracle = OracleTokens.of(requests)
        self._has_oracle, self._flat, self._offset = oracle.present, oracle.tokens, oracle.start
        # _at - _offset is each request's answer position (so _at indexes _flat at its next oracle token)
        self._at = self._offset.copy()
        self._fills: list[Callable | None] = [None] * n  # bound fill_mask / accept of each live matcher
        self._accepts: list[Callable | None] = [None] * n
        # per spec key: its requests whose matcher is not made yet (a grammar none of them needs can go)
        request_key = keys.request_key
        self._unserved = np.bincount(request_key[request_key >= 0], minlength=len(keys.specs))

    def compile(self, key: int) -> CompileOutcome:
        start = perf_counter_ns()
        try:
            grammar = self.backend.compile(self.keys.specs[key])
            error = None
            reason = None
        except CompileError as exc:
            grammar = None
            error = f"{exc.reason}: {exc.message}" if exc.message else exc.reason
            reason = exc.reason
        elapsed = (perf_counter_ns() - start) * _NS
        self.backend_call_s += elapsed
        self.recorder.compiled(key, elapsed, reason)
        if grammar is not None:
            self._keep(key, grammar)  # after the clock: an evicted grammar's freeing is no part of this compile
        return CompileOutcome(elapsed, error)

    def _keep(self, key: int, grammar: CompiledGrammar) -> None:
        """Keep ``key``'s grammar for its requests to come, evicting the least recently used beyond the bound."""
        compiled = self._compiled
        compiled[key] = grammar
        compiled.move_to_end(key)
        while len(compiled) > self._kept_grammars:
            compiled.popitem(last=False)

    def _grammar(self, key: int) -> CompiledGrammar:
        """``key``'s compiled grammar for a request starting now, recompiled untimed if it was evicted
        (the scheduler timed the spec's compile once; it compiled without error then)."""
        grammar = self._compiled.get(key)
        if grammar is None:
            grammar = self.backend.compile(self.keys.specs[key])
            self.recompiles += 1
        self._unserved[key] -= 1
        if self._unserved[key] > 0:
            self._keep(key, grammar)
        else:  # no request left needs it: only the live matchers made from it keep it
            self._compiled.pop(key, None)
        return grammar

    def _matcher(self, rid: int) -> Matcher:
        matcher = self._matchers.get(rid)
        if matcher is None:
            grammar = self._grammar(int(self.keys.request_key[rid]))
            request = self.requests[rid]
            start = perf_counter_ns()
            if self._reasoner:
                matcher = self.backend.matcher(grammar, thinking=request.think_len > 0,
                                               thinking_budget=request.thinking_budget)
            else:
                matcher = self.backend.matcher(grammar)
            self.backend_call_s += (perf_counter_ns() - start) * _NS
            self._matchers[rid] = matcher
            self._fills[rid], self._accepts[rid] = matcher.fill_mask, matcher.accept
        return matcher

    def step(self, rows: StepRows, rng: np.random.Generator) -> StepWork:
        n = len(rows.rid)
        rid, grammar, drafts, gen_left, think_left = rows.rid, rows.grammar, rows.drafts, rows.gen_left, rows.think_left
        # unconstrained and thinking rows: no backend, drafts accepted with probability alpha
        spec = _any(drafts)
        if spec:
            accepted = accepted_drafts(rng, drafts, self.alpha)
            produced = np.minimum(accepted + 1, gen_left)
        else:
            accepted = np.zeros(n, np.int64)
            produced = np.minimum(1, gen_left)
        thinking = _any(think_left)  # (never negative)
        if thinking:
            produced = np.where(think_left > 0, np.minimum(produced, think_left), produced)
        if spec:
            accepted = np.minimum(accepted, produced - 1)
        out = _Step(produced, accepted, drafts.copy() if spec else None, NO_FILL, _NO_ROWS)
        n_grammar = _any(grammar)
        fill_s, mask_rows = NO_FILL, _NO_ROWS
        if n_grammar:
            g_rid = rid[grammar]
            cursor = self._at[g_rid]  # answer positions (plus each request's offset) before this step
            if self.jump_forward:
                lean = drafted = _NO_ROWS
                general = np.flatnonzero(grammar)
            else:
                oracle = grammar & self._has_oracle[rid]
                if spec:
                    is_drafted = oracle & (drafts > 0)
                    drafted = np.flatnonzero(is_drafted)
                    lean = np.flatnonzero(oracle ^ is_drafted)
                else:
                    lean, drafted = np.flatnonzero(oracle), _NO_ROWS
                general = np.flatnonzero(grammar ^ oracle) if len(lean) + len(drafted) < n_grammar else _NO_ROWS
            if len(lean) == n_grammar:  # the common step: the grammar rows are the lean rows
                pooled = self.parallel_fill is not None and n_grammar > self.parallel_fill.threshold
                fill_s, mask_rows = self._lean(rows, lean, out, pooled), constant_ints(1, n_grammar)
            else:
                out.fill_s, out.mask_rows = np.zeros(n), np.zeros(n, np.int64)
                if len(lean):
                    out.fill_s[lean] = self._lean(rows, lean, out)
                    out.mask_rows[lean] = 1
                if len(drafted):
                    self._drafted(rows, drafted, out)
                if len(general):
                    self._general(rows, general, out)
                built = np.flatnonzero(grammar)
                fill_s, mask_rows = out.fill_s[built], out.mask_rows[built]
            record = (g_rid, cursor, fill_s, mask_rows,
                      None if out.rolled_back is None else out.rolled_back[grammar],
                      None if out.jumped is None else out.jumped[grammar])
            if self._deferred is None:
                self._record(record, out.process_ns)
            else:
                self._deferred_step = (out, rid, record)
        if self._reasoner and thinking:
            out.process_ns += self._think(rows, produced)
        self.backend_call_s += (out.backend_ns + out.process_ns) * _NS
        rejected = self._refused(out, rid)
        ended = None
        if out.ended:
            ended = np.zeros(n, bool)
            ended[out.ended] = True
        zeros = constant_ints(0, n)
        return StepWork(fill_s, mask_rows, out.produced, out.accepted,
                        zeros if out.rolled_back is None else out.rolled_back,
                        zeros if out.jumped is None else out.jumped, rejected, out.process_ns * _NS, ended,
                        out.verified, None if out.fill_wall_ns is None else out.fill_wall_ns * _NS)

    def settle(self) -> Settlement | None:
        """Accept the oracle tokens of the step's lean rows, deferred by :attr:`defer_accepts` (timed)."""
        if self._deferred is None:
            return None
        (row_accepts, tokens, lean, lean_rids), (out, rid, record) = self._deferred, self._deferred_step
        self._deferred = self._deferred_step = None
        before = out.process_ns
        out.rejected.clear()  # the rows refused in step() are already reported
        self._accept_lean(row_accepts, tokens, lean, lean_rids, out)
        spent = out.process_ns - before
        self.backend_call_s += spent * _NS
        self._record(record, out.process_ns)
        return Settlement(spent * _NS, self._refused(out, rid))

    def _record(self, record: tuple, process_ns: int) -> None:
        g_rid, cursor, fill_s, mask_rows, rolled_back, jumped = record
        self.recorder.step(g_rid, cursor, fill_s, mask_rows, process_ns, rolled_back, jumped)

    def _refused(self, out: _Step, rid: np.ndarray) -> np.ndarray | None:
        """The step's rows whose token the grammar refused (``None``: none), noted for the profile."""
        if not out.rejected:
            return None
        rejected = np.zeros(len(rid), bool)
        rejected[out.rejected] = True
        self.recorder.rejected(rid[out.rejected], self._at[rid[out.rejected]] - 1)
        return rejected

    def _row_matchers(self, rids: list[int], fills: Sequence[Callable | None]) -> None:
        """Make the matchers of requests in their first grammar step, those among ``rids`` whose bound
        fill (``fills``, gathered by the caller) is ``None`` (timed, as backend calls)."""
        for r, fill in zip(rids, fills):
            if fill is None:
                self._matcher(r)

    def _lean(self, rows: StepRows, lean: np.ndarray, out: _Step, pooled: bool = False) -> np.ndarray:
        """One fill and one accept of the oracle token per row (the fills on the parallel fill
        pool when ``pooled``); the rows' fill seconds."""
        lean_rids = rows.rid[lean]
        lean_list = lean_rids.tolist()
        # the rows' bound methods, gathered in C (a 1-row getter returns the item itself)
        pick = itemgetter(*lean_list) if len(lean_list) > 1 else lambda seq: (seq[lean_list[0]],)
        row_fills = pick(self._fills)
        if None in row_fills:
            self._row_matchers(lean_list, row_fills)
            row_fills = pick(self._fills)
        row_accepts = pick(self._accepts)
        if pooled:
            fill_s = self._fill_pooled(row_fills, out)
        else:
            mask = self._mask
            clock = perf_counter_ns
            stamps = [clock()]
            stamp = stamps.append
            for fill in row_fills:
                fill(mask, 0)
                stamp(clock())
            out.backend_ns += stamps[-1] - stamps[0]
            fill_s = _gaps_s(stamps)
        at = self._at
        tokens = self._flat[at[lean_rids]].tolist()
        at[lean_rids] += 1
        if self.defer_accepts:
            self._deferred = (row_accepts, tokens, lean, lean_rids)
        else:
            self._accept_lean(row_accepts, tokens, lean, lean_rids, out)
        return fill_s

    def _fill_pooled(self, row_fills: Sequence[Callable], out: _Step) -> np.ndarray:
        """Fill each row into its own mask row on the parallel fill pool, in tasks of ``chunk`` rows,
        and wait for all; the rows' fill seconds (each its task thread's CPU time), the wall time in ``out``."""
        setting = self.parallel_fill
        n, chunk = len(row_fills), setting.chunk
        if self._mask.shape[0] < n:
            self._mask = self.backend.allocate_mask(n)
        mask = self._mask
        start = perf_counter_ns()
        tasks = [self._pool.submit(_fill_rows, row_fills[i:i + chunk], mask, i) for i in range(0, n, chunk)]
        stamps = [task.result() for task in tasks]
        wall = perf_counter_ns() - start
        out.backend_ns += wall
        out.fill_wall_ns = wall
        fill_s = np.concatenate([_gaps_s(s) for s in stamps])
        self.recorder.parallel(setting, wall * _NS, fill_s)
        return fill_s

    def _accept_lean(self, row_accepts: Sequence[Callable], tokens: list[int], lean: np.ndarray,
                     lean_rids: np.ndarray, out: _Step) -> None:
        """Accept each lean row's oracle token (one clock pair for all), noting the rows refused."""
        clock = perf_counter_ns
        t0 = clock()
        oks = [accept(token) for accept, token in zip(row_accepts, tokens)]
        out.process_ns += clock() - t0
        if not all(oks):
            bad = [i for i, ok in zip(lean.tolist(), oks) if not ok]
            out.rejected.extend(bad)
            self._rejected.update(lean_rids[[j for j, ok in enumerate(oks) if not ok]].tolist())

    def _drafted(self, rows: StepRows, drafted: np.ndarray, out: _Step) -> None:
        """Oracle rows with drafts, in phases: propose all, build every row's masks (fill, then accept
        each draft and fill its row: the grammar-valid prefix), verify against the oracle, then roll
        back the rejected drafts and accept the sampled token.

        Phases rather than row by row: the Python between backend calls runs with the caches the
        fills left cold, so interleaving it with them makes it several times slower.
        """
        d_rids = rows.rid[drafted]
        d_list = d_rids.tolist()
        at = self._at
        here = at[d_rids]  # each row's next oracle token in _flat
        block, counts = self.drafts.propose_block(self.requests, self._oracle, d_rids, here - self._offset[d_rids],
                                                  rows.drafts[drafted])
        k = block.shape[1]
        proposals = draft_lists(block, counts)
        # the rows' matchers, gathered in C (a 1-row getter returns the item itself)
        pick = itemgetter(*d_list) if len(d_list) > 1 else lambda seq: (seq[d_list[0]],)
        row_fills = pick(self._fills)
        if None in row_fills:
            self._row_matchers(d_list, row_fills)
        matchers = pick(self._matchers)
        if self._mask.shape[0] < k + 1:
            self._mask = self.backend.allocate_mask(k + 1)
        mask = self._mask
        clock = perf_counter_ns
        valids: list[int] = []
        filled_rows: list[int] = []
        stamps = [clock()]
        for matcher, proposed in zip(matchers, proposals):
            valid, filled = build_draft_masks(matcher, mask, proposed)
            valids.append(valid)
            filled_rows.append(filled)
            stamps.append(clock())
        out.backend_ns += stamps[-1] - stamps[0]
        # verification: the target keeps the grammar-valid drafts that match its own tokens up to the
        # first that does not (never past the output's end), then samples its own next token
        valid = np.array(valids)
        columns = np.arange(k)
        oracle_next = self._flat[np.minimum(here[:, None] + columns, len(self._flat) - 1)]
        kept = (block == oracle_next) & (columns < valid[:, None])
        # the first draft not kept (a column of False appended: k when all are)
        first_miss = np.concatenate((kept, np.zeros((len(kept), 1), bool)), axis=1).argmin(axis=1)
        match = np.minimum(first_miss, rows.gen_left[drafted] - 1)
        sampled = self._flat[here + match].tolist()
        rolled = (valid - match).tolist()
        t0 = clock()
        oks = []
        for matcher, back, token in zip(matchers, rolled, sampled):
            if back:
                matcher.rollback(back)
            oks.append(matcher.accept(token))
        out.process_ns += clock() - t0
        if not all(oks):
            bad = [j for j, ok in enumerate(oks) if not ok]
            out.rejected.extend(drafted[bad].tolist())
            self._rejected.update(d_rids[bad].tolist())
        emitted = match + 1
        at[d_rids] = here + emitted
        out.fill_s[drafted] = _gaps_s(stamps)
        out.mask_rows[drafted] = np.array(filled_rows) + 1
        out.accepted[drafted] = match
        out.produced[drafted] = emitted
        out.verified[drafted] = counts
        out.roll_back(drafted, rolled)
        self.recorder.drafts(d_rids, counts, match, valid)

    def _general(self, rows: StepRows, general: np.ndarray, out: _Step) -> None:
        """Random-walk rows, and every row under jump-forward, one row at a time."""
        g_rids = rows.rid[general]
        at, offset = self._at, self._offset
        starts = (at[g_rids] - offset[g_rids]).tolist()
        g_fill: list[int] = []
        g_masks: list[int] = []
        g_accepted: list[int] = []
        g_rolled: list[int] = []
        g_jumped: list[int] = []
        g_emitted: list[int] = []
        g_verified: list[int] = []
        clock = perf_counter_ns
        requests, propose, walk = self.requests, self.drafts.propose, self.walk
        jump = self.jump_forward
        for j, (rid, k, left, pos) in enumerate(zip(g_rids.tolist(), rows.drafts[general].tolist(),
                                                    rows.gen_left[general].tolist(), starts)):
            request = requests[rid]
            oracle = request.output_tokens
            matcher = self._matchers.get(rid) or self._matcher(rid)
            if self._mask.shape[0] < k + 1:
                self._mask = self.backend.allocate_mask(k + 1)
            mask = self._mask
            # mask building: fill, then accept each draft and fill its row (the grammar-valid prefix)
            proposed = propose(request, pos, k) if k else ()
            g_verified.append(len(proposed))
            t0 = clock()
            valid, filled = build_draft_masks(matcher, mask, proposed)
            g_fill.append(clock() - t0)
            g_masks.append(1 + filled)
            # verification against what the target samples: keep the matching prefix, roll back the rest
            if oracle is None:  # random walk: the target samples from each filled row
                sampled = [walk.next_token(mask[i], request_id=request.request_id, position=pos + i,
                                           params=request.random_walk) for i in range(filled + 1)]
            else:
                sampled = oracle[pos:pos + valid + 1]
            match = 0
            while match < min(valid, len(sampled) - 1) and proposed[match] == sampled[match]:
                match += 1
            match = min(match, left - 1)
            t0 = clock()
            if valid - match:
                matcher.rollback(valid - match)
            ok = matcher.accept(sampled[match])
            out.process_ns += clock() - t0
            if not ok:
                out.rejected.append(int(general[j]))
                self._rejected.add(rid)
            g_accepted.append(match)
            g_rolled.append(valid - match)
            emitted = match + 1
            if oracle is None:
                self._emitted.setdefault(rid, []).extend(sampled[:emitted])
            forced_ok = 0
            more = pos + emitted < len(oracle) if oracle is not None else not matcher.is_terminated()
            if jump and more and emitted < left and not matcher.is_terminated():
                t0 = clock()
                forced = matcher.jump_forward()
                for token in forced[: left - emitted]:
                    if oracle is not None and token != oracle[pos + emitted + forced_ok] or not matcher.accept(token):
                        break
                    forced_ok += 1
                out.process_ns += clock() - t0
                if oracle is None:
                    self._emitted[rid].extend(forced[:forced_ok])
                emitted += forced_ok
            g_jumped.append(forced_ok)
            if oracle is None and emitted < left and matcher.is_terminated():
                out.ended.append(int(general[j]))
                self.recorder.walk_ended(rid, pos + emitted)
            g_emitted.append(emitted)
        out.backend_ns += sum(g_fill)
        out.fill_s[general] = np.array(g_fill) * _NS
        out.mask_rows[general] = g_masks
        out.accepted[general] = g_accepted
        out.produced[general] = g_emitted
        at[g_rids] += g_emitted
        if out.verified is not None:
            out.verified[general] = g_verified
            proposed, accepted = np.array(g_verified), np.array(g_accepted)
            has = proposed > 0
            if has.any():
                self.recorder.drafts(g_rids[has], proposed[has], accepted[has], accepted[has] + np.array(g_rolled)[has])
        out.roll_back(general, g_rolled)
        if jump:
            if out.jumped is None:
                out.jumped = np.zeros(len(rows.rid), np.int64)
            out.jumped[general] = g_jumped

    def _think(self, rows: StepRows, produced: np.ndarray) -> int:
        """Feed thinking rows' tokens to reasoner matchers (the think-end token last); nanoseconds spent."""
        spent = 0
        request_key = self.keys.request_key
        for i in np.flatnonzero(rows.think_left > 0).tolist():
            rid = int(rows.rid[i])
            if request_key[rid] < 0:
                continue
            matcher = self._matchers.get(rid) or self._matcher(rid)
            count = int(produced[i])
            ends = count == int(rows.think_left[i])
            tokens = self._think_rng.choice(self._think_tokens, count - ends).tolist()
            if ends:
                tokens.append(self.backend.think_end_id)
            start = perf_counter_ns()
            for token in tokens:
                matcher.accept(token)
            elapsed = perf_counter_ns() - start
            spent += elapsed
            self.recorder.thought(rid, len(tokens), elapsed)
            if ends:  # the answer phase has its own, faster, bound methods
                self._fills[rid], self._accepts[rid] = matcher.fill_mask, matcher.accept
        return spent

    def measured_profile(self, source: str) -> GrammarProfile | None:
        """The grammar costs this run measured (:mod:`~cdbench.harness.executors.in_situ`)."""
        return self.recorder.profile(self.backend.name, self.backend.vocab.name, self.keys, self._offset, source,
                                     random_walk=~self._has_oracle)

    def finish(self, rid: int) -> None:
        """Free the request's matcher (timed as a backend call) and keep what its output check needs.

        Outputs are checked after the run (:meth:`validity`): one check per
        ended request either way, but back to back, not each between two
        steps' fills, where it would run several times slower.
        """
        request = self.requests[rid]
        start = perf_counter_ns()
        self._matchers.pop(rid, None)  # dropping the last references frees the backend's matcher
        self._fills[rid] = self._accepts[rid] = None
        self.backend_call_s += (perf_counter_ns() - start) * _NS
        emitted = self._emitted.pop(rid, None)
        if request.spec is None:
            return
        if rid in self._rejected:
            self._ended.append((rid, None))
        elif request.output_tokens is not None:
            self._ended.append((rid, int(self._at[rid] - self._offset[rid])))  # the oracle's prefix
        else:
            self._ended.append((rid, emitted or []))

    def abort(self, rid: int) -> None:
        """Free the aborted request's matcher (timed as a backend call, as in :meth:`finish`), or, if it
        never got one, stop keeping its grammar for it; nothing is kept for an output check."""
        if rid in self._matchers:
            start = perf_counter_ns()
            del self._matchers[rid]
            self._fills[rid] = self._accepts[rid] = None
            self.backend_call_s += (perf_counter_ns() - start) * _NS
            self._emitted.pop(rid, None)
            return
        key = int(self.keys.request_key[rid])
        if key >= 0:
            self._unserved[key] -= 1
            if self._unserved[key] == 0:
                self._compiled.pop(key, None)

    def validity(self) -> Iterator[tuple[int, bool]]:
        """Decode each ended structured request's answer and check it against its spec (one
        compiled check per spec, each distinct output text checked once); a request whose
        token the grammar refused is invalid unchecked. Timed as ``validation_s``."""
        start = perf_counter_ns()
        checks: dict[int, Callable[[str], bool]] = {}
        verdicts_of: dict[int, dict[str, bool]] = {}
        decode, eos = self.backend.vocab.decode, self._eos
        results = []
        for rid, output in self._ended:
            if output is None:
                results.append((rid, False))
                continue
            request = self.requests[rid]
            source = request.output_tokens[:output] if isinstance(output, int) else output
            key = int(self.keys.request_key[rid])
            verdicts = verdicts_of.get(key)
            if verdicts is None:
                verdicts = verdicts_of[key] = {}
                checks[key] = validity_check(self.keys.specs[key])
            text = decode([t for t in source if t not in eos])
            valid = verdicts.get(text)
            if valid is None:  # a text seen before (instances repeat in a workload) is not checked again
                if len(verdicts) >= _VERDICTS_PER_SPEC:
                    verdicts.clear()
                valid = verdicts[text] = checks[key](text)
            results.append((rid, valid))
        self._ended.clear()
        self.validation_s += (perf_counter_ns() - start) * _NS
        return iter(results)
