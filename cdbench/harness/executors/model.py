"""``model`` mode: grammar costs drawn from a cost source instead of a real backend."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cdbench.harness.costs.cost_tables import (
    DRAFT_WINDOW,
    SPAN,
    ConstantTables,
    CostTables,
    SpecIndex,
    has_draft_chains,
    profile_tables,
)
from cdbench.harness.costs.grammar_profile import GrammarProfile, ProfileError
from cdbench.harness.costs.spec_costs import SpecCoverage
from cdbench.harness.executors.base import (
    NO_FILL,
    CompileOutcome,
    DecodeRun,
    GrammarExecutor,
    ParallelFill,
    SpecKeys,
    StepRows,
    StepWork,
    accepted_drafts,
    constant_ints,
)
from cdbench.harness.step_time import parallel_makespan
from cdbench.workloads.request import Request

# Per-step calls on small arrays cost mostly call overhead: count_nonzero is the cheapest
# "any" (several times cheaper than a ufunc reduction), and the direct ufunc reduction the
# cheapest sum (ndarray.sum adds a Python-level wrapper).
_any = np.count_nonzero
_sum = np.add.reduce
_min = np.minimum.reduce
_SPAN_MASK = SPAN - 1
_LONE = 1  # a step of this many rows is taken in scalars (_lone_step; 0: none)
_ZERO, _TRUE = np.zeros(1, np.int64), np.ones(1, bool)  # (a lone row's read-only results)
_ZERO.flags.writeable = _TRUE.flags.writeable = False



class GrammarCosts(Protocol):
    """Grammar costs the model executor reads: one compile per spec, per-request cost tables
    (:class:`~cdbench.harness.costs.cost_tables.CostTables`, whose pools a request acquires when it
    arrives and releases when it ends), and how far
    the engine's parallel fill pool falls short of its threads running side by side (a factor on
    the pool's makespan; 1: it does not), and a factor on every fill (``fill_scale``: the grammar
    library release an engine ran against the one the costs were measured with; 1: as measured)."""

    parallel_fill_factor: float
    fill_scale: float

    def compile(self, spec_id: str | None, key_text: str, kind: str) -> CompileOutcome: ...

    def tables(self, keys: SpecKeys, capacity: int, drafts: bool = True, jump_forward: bool = True,
               requests: Iterable[Request] | None = None) -> CostTables:
        """The run's cost tables: ``capacity`` request slots (grown as asked), spec ``keys`` numbered as
        requests enter; ``drafts``/``jump_forward``: whether the run reads the pools only drafts and forced
        tokens need (they may be left out when not); ``requests``: the run's, where held (else the cost
        source reads them anew where it must)."""
        ...


class FixedGrammarCosts(BaseModel):
    """Constant grammar costs: hand-computable, for tests and what-ifs.

    ``compile_by_key`` overrides ``compile_time_s`` per spec (by spec id, or
    ``kind:spec_id``); specs in ``failing_keys`` fail to compile after their
    compile time. ``forced_tokens`` is how many tokens the grammar forces after
    every token (used by the jump-forward what-if). ``parallel_fill_factor``
    scales the parallel fill pool's makespan.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["fixed"] = "fixed"
    compile_time_s: float = Field(0.02, ge=0)
    compile_by_key: dict[str, float] = Field(default_factory=dict)
    failing_keys: list[str] = Field(default_factory=list)
    fill_time_s: float = Field(20e-6, ge=0)
    accept_time_s: float = Field(3e-6, ge=0)
    rollback_time_s: float = Field(5e-6, ge=0)
    forced_tokens: int = Field(0, ge=0)
    parallel_fill_factor: float = Field(1.0, gt=0)

    @property
    def fill_scale(self) -> float:
        """1: constants state their fill as it is."""
        return 1.0

    def compile(self, spec_id: str | None, key_text: str, kind: str) -> CompileOutcome:
        names = {key_text} | ({spec_id} if spec_id is not None else set())
        seconds = next((self.compile_by_key[n] for n in names if n in self.compile_by_key), self.compile_time_s)
        failed = any(n in self.failing_keys for n in names)
        return CompileOutcome(seconds, "invalid: listed in failing_keys" if failed else None)

    def tables(self, keys: SpecKeys, capacity: int, drafts: bool = True, jump_forward: bool = True,
               requests: Iterable[Request] | None = None) -> CostTables:
        return ConstantTables(capacity, self.fill_time_s, self.accept_time_s, self.rollback_time_s,
                              self.forced_tokens)


class ProfileGrammarCosts:
    """Grammar costs from a backend's measured :class:`GrammarProfile` (seeded), spec by spec.

    Each spec of the run takes the costs of one profiled spec
    (:class:`~cdbench.harness.costs.cost_tables.SpecIndex`): its compile time
    and outcome, fill scale and position curve, accept and rollback costs. A
    spec taken from a profile without compile measurements for it gets the
    kind's compile draw (:meth:`ProfileSampler.compile_one`), stable per spec.
    The parallel fill pool's factor is the one its run measured
    (:class:`~cdbench.harness.costs.grammar_profile.ParallelFillProfile`), else 1.
    ``fill_scale``: every fill the profile prices times this (an engine's older release of the backend
    against the profile's; accepts, rollbacks and compiles as measured).
    ``coverage``: where the profile's prices of the run's specs came from
    (:func:`~cdbench.harness.costs.spec_costs.price_specs`; ``None``: not priced spec by spec).
    ``requests``: builds the run's requests anew, for a run that does not hold them (read once more
    where the run has drafts, :func:`~cdbench.harness.costs.cost_tables.has_draft_chains`).
    """

    def __init__(self, profile: GrammarProfile, seed: int, coverage: SpecCoverage | None = None,
                 requests: Callable[[], Iterable[Request]] | None = None, fill_scale: float = 1.0) -> None:
        if not fill_scale > 0:
            raise ValueError(f"fill_scale must be positive, got {fill_scale}")
        self.profile, self.seed, self.coverage, self.requests = profile, seed, coverage, requests
        self.fill_scale = fill_scale
        self.sampler = profile.sampler(seed)
        self.index = SpecIndex(profile, seed)
        self.parallel_fill_factor = profile.parallel_fill.factor if profile.parallel_fill is not None else 1.0

    def compile(self, spec_id: str | None, key_text: str, kind: str) -> CompileOutcome:
        spec = self.index.spec(self.index.names(key_text, spec_id, kind)[1])
        if spec is None or spec.status is None:
            seconds, status = self.sampler.compile_one(spec_id if spec_id is not None else key_text, kind)
        else:
            status = spec.status
            seconds = spec.compile_s if spec.compile_s is not None else self.sampler.compile_one(
                spec_id if spec_id is not None else key_text, kind)[0]
        return CompileOutcome(seconds, None if status == "ok" else status)

    def tables(self, keys: SpecKeys, capacity: int, drafts: bool = True, jump_forward: bool = True,
               requests: Iterable[Request] | None = None) -> CostTables:
        chains = False
        if drafts:
            if requests is None and self.requests is None:
                raise ValueError("a run with drafts reads its requests for their draft chains: none given")
            chains = has_draft_chains(self.profile, self.index, requests if requests is not None else self.requests())
        return profile_tables(self.profile, self.index, self.seed, keys, capacity, drafts, jump_forward, chains)


class ModelExecutor(GrammarExecutor):
    """``model`` mode: grammar costs drawn from ``costs``, vectorized over a step's rows.

    Parameters
    ----------
    costs : the cost source (a backend profile, or fixed numbers).
    alpha : per-draft acceptance probability of the target model.

    Per grammar row and step: the grammar takes the accepted drafts and, of
    the others, a prefix drawn with the profile's measured draft validity
    (all ``k`` where not measured); ``1 + valid`` fills and ``valid`` draft
    accepts build the mask; after verification one rollback call undoes the
    valid drafts the target rejected and one accept takes the sampled token;
    jump-forward accepts the forced tokens. A random walk (a structured
    request without oracle tokens) ends where its spec's measured walks
    ended, as often; a thinking row of a profile that measured thinking
    accepts (the ``reasoner`` backend) pays one per thinking token. A step
    of more grammar rows than the parallel fill's threshold fills in the
    pool's makespan times the cost source's ``parallel_fill_factor``; with
    the pool's ``accepts`` (``scheduler.accept_parallel``) its sampled
    tokens' accepts take the pool's makespan of them too.
    Costs are looked up in the run's per-request tables
    (:mod:`~cdbench.harness.costs.cost_tables`) at each row's answer position.
    """

    def __init__(self, costs: GrammarCosts, alpha: float = 0.0) -> None:
        self.costs, self.alpha = costs, alpha
        self._fill_scale = float(costs.fill_scale)
        self._runs = np.zeros(0, np.int64)  # pooled draws of accepted-draft run lengths
        self._runs_at = 0
        self._step_col = np.arange(64)[:, None]  # a decode run's step numbers, as a column

    def _accepted(self, rng: np.random.Generator, drafts: np.ndarray) -> np.ndarray:
        """:func:`accepted_drafts`, drawn from a block of geometric draws made ahead (cheaper per step)."""
        if not 0.0 < self.alpha < 1.0:
            return accepted_drafts(rng, drafts, self.alpha)
        n = len(drafts)
        if self._runs_at + n > len(self._runs):
            self._runs = rng.geometric(1.0 - self.alpha, size=max(1 << 16, n)) - 1
            self._runs_at = 0
        runs = self._runs[self._runs_at:self._runs_at + n]
        self._runs_at += n
        return np.minimum(runs, drafts)

    def prepare(self, requests: Sequence[Request], keys: SpecKeys, capacity: int | None = None,
                jump_forward: bool = False, parallel_fill: ParallelFill | None = None, drafts: bool = True) -> None:
        """Held ``requests`` numbered by ``keys`` up front (:meth:`SpecKeys.of`) enter the tables here, each
        in the slot of its position; the scheduler enters the others as it issues them (:meth:`enter`)."""
        super().prepare((), keys, capacity, jump_forward, parallel_fill, drafts)  # (the requests are not kept)
        self.tables = self.costs.tables(keys, capacity if capacity is not None else len(requests), drafts,
                                        jump_forward, requests if len(requests) else None)
        if keys.request_key is not None and len(requests):
            self.tables.enter(np.arange(len(requests)), requests, keys.request_key, keys.request_instance)

    def enter(self, rids: np.ndarray, requests: Sequence[Request], keys: np.ndarray,
              instances: Sequence[str | None]) -> None:
        self.tables.enter(rids, requests, keys, instances)

    def grow(self, capacity: int) -> None:
        self.tables.grow(capacity)

    def arrive(self, rid: int) -> None:
        self.tables.acquire(rid)

    def finish(self, rid: int) -> None:
        self.tables.release(rid)

    def abort(self, rid: int) -> None:
        self.tables.release(rid)

    def compile(self, key: int) -> CompileOutcome:
        k = self.keys
        return self.costs.compile(k.spec_ids[key], k.texts[key], k.kinds[key])

    def decode_run(self, rid: np.ndarray, grammar: np.ndarray, gen_left: np.ndarray, steps: int) -> DecodeRun | None:
        """:meth:`step`'s fills and processing for ``steps`` decode steps at once, as (steps, rows) arrays: a
        row's positions advance one a step, so its pool and curve indexes are its first step's less the
        step's number. Not with jump-forward (its forced tokens vary the tokens a step) nor a parallel fill. A
        row whose last token comes before ``steps`` is read at that token's position past it (placeholders,
        for the caller to leave out)."""
        pool = self.parallel_fill
        ng = _any(grammar)
        if self.jump_forward or (pool is not None and ng > pool.threshold):
            return None
        if not ng:
            return DecodeRun(steps, np.zeros((steps, 0)), np.zeros((steps, 0)))
        t = self.tables
        g_rid, g_left = (rid, gen_left) if ng == len(rid) else (rid[grammar], gen_left[grammar])
        # one token a step: a walk ends at step j where gen_left - j - 1 reaches its end length, a token is
        # refused at step j where gen_left - j is its refused position
        if t.end_left is not None:
            end = t.end_left[g_rid]
            ends = end > 0
            if _any(ends):
                steps = min(steps, max(int((g_left[ends] - 1 - end[ends]).min()), 0))
        if t.reject_left is not None:  # (-1: never refused)
            refused_at = t.reject_left[g_rid]
            refusing = refused_at > 0
            if _any(refusing):  # (most rows are never refused)
                at_step = g_left - refused_at
                steps = min(steps, int(_min(np.where((at_step >= 0) & refusing, at_step, steps))))
        if len(self._step_col) < steps:
            self._step_col = np.arange(max(steps, 2 * len(self._step_col)))[:, None]
        left = g_left - self._step_col[:steps]
        np.maximum(left, 1, out=left)  # (past a row's last token: its last position again)
        _, fat, ci, accept_one = self._positions(g_rid, left)
        return DecodeRun(steps, self._fills(fat, ci), accept_one)

    def step_one(self, rid: int, gen_left: int, grammar: bool, rng: np.random.Generator) -> StepWork:
        if _LONE == 1 and not self.jump_forward and (self.parallel_fill is None or self.parallel_fill.threshold >= 1):
            return self._lone_step(rid, gen_left, grammar)  # (as step takes it)
        return super().step_one(rid, gen_left, grammar, rng)

    def _lone_step(self, rid: int, left: int, grammar: bool) -> StepWork:
        """:meth:`step` of one row without drafts or thinking (a prompt's first token), in Python scalars."""
        produced = min(1, left)
        accepted, none = _ZERO, constant_ints(0, 1)
        if not grammar:
            return StepWork(NO_FILL, constant_ints(0, 0), np.array([produced]), accepted, none, none, None, 0.0)
        t = self.tables
        base = int(t.base[rid])
        at = ((int(t.off_end[rid]) - left) & _SPAN_MASK) + base  # (as _positions)
        fat = at if t.fill_base is None else at + (int(t.fill_base[rid]) - base)
        ci = int(t.curve_end[rid]) - left
        accept_one = float(t.accept[at])
        if t.accept_curve is not None:
            timed = float(t.accept_curve[ci])
            if timed == timed:  # (not NaN)
                accept_one = timed
        fill = float(t.fill[fat]) * float(t.curve[ci])  # (as _fills)
        if t.spike is not None:
            fill += float(t.spike[fat])
        if self._fill_scale != 1.0:
            fill *= self._fill_scale
        ended = rejected = None
        if t.end_left is not None:
            end = int(t.end_left[rid])
            if end > 0 and left - produced <= end:
                produced = left - end
                accepted = np.array([min(0, produced - 1)])
                ended = _TRUE
        if t.reject_left is not None:
            refuse = int(t.reject_left[rid])
            if left >= refuse > left - produced:
                rejected = _TRUE
        return StepWork(np.array([fill]), constant_ints(1, 1), np.array([produced]), accepted, none, none, rejected,
                        0.0 + accept_one, ended)

    def _positions(self, g_rid: np.ndarray, left: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Grammar rows ``g_rid`` with ``left`` tokens left (a value a row, or one a step and row): their
        indexes in the accept (and rollback, forced) pools and in the fill pools, on their curves, and the
        accept of one token there."""
        t = self.tables
        base = t.base[g_rid]
        at = ((t.off_end[g_rid] - left) & _SPAN_MASK) + base  # the rows' pool indexes
        fat = at if t.fill_base is None else at + (t.fill_base[g_rid] - base)  # in the fill pools
        ci = t.curve_end[g_rid] - left
        accept_one = t.accept[at]
        if t.accept_curve is not None:  # texts whose accepts were timed as the run walks them: those
            timed = t.accept_curve[ci]
            accept_one = np.where(np.isnan(timed), accept_one, timed)
        return at, fat, ci, accept_one

    def _fills(self, fat: np.ndarray, ci: np.ndarray) -> np.ndarray:
        """One token's fill at fill-pool indexes ``fat`` and curve indexes ``ci``, its outlier added."""
        t = self.tables
        fill = t.fill[fat] * t.curve[ci]
        if t.spike is not None:
            fill += t.spike[fat]
        if self._fill_scale != 1.0:
            fill *= self._fill_scale
        return fill

    def step(self, rows: StepRows, rng: np.random.Generator) -> StepWork:
        n = len(rows.rid)
        grammar, drafts, gen_left = rows.grammar, rows.drafts, rows.gen_left
        if n == _LONE and not drafts[0] and not rows.think_left[0] and not self.jump_forward and (
                self.parallel_fill is None or self.parallel_fill.threshold >= 1):
            return self._lone_step(int(rows.rid[0]), int(gen_left[0]), bool(grammar[0]))
        spec = _any(drafts)
        if spec:
            accepted = self._accepted(rng, drafts)
            produced = np.minimum(accepted + 1, gen_left)
        else:
            accepted = np.zeros(n, np.int64)
            produced = np.minimum(1, gen_left)
        if _any(rows.think_left):  # (never negative)
            produced = np.where(rows.think_left > 0, np.minimum(produced, rows.think_left), produced)
        if spec:
            accepted = np.minimum(accepted, produced - 1)
        rolled_back = jumped = constant_ints(0, n)
        process_s = 0.0
        t = self.tables
        if t.think_accept is not None and _any(rows.think_left):
            process_s += float(t.think_accept[rows.rid] @ np.where(rows.think_left > 0, produced, 0))
        ng = _any(grammar)
        if ng:
            # every row builds a mask (the common step): views instead of gathers, masks index the rows directly
            everyone = ng == n
            g = slice(None) if everyone else grammar.nonzero()[0]
            g_rid = rows.rid[g]
            g_left = gen_left[g]  # a grammar row is past thinking: its answer position is output_len - gen_left
            at, fat, ci, accept_one = self._positions(g_rid, g_left)
            g_drafts = drafts[g]
            n_drafts = int(_sum(g_drafts)) if spec else 0
            if n_drafts >= DRAFT_WINDOW and int(g_drafts.max()) >= DRAFT_WINDOW:
                raise ValueError(f"model mode reads at most {DRAFT_WINDOW - 1} drafts per row")
            if not n_drafts:
                row_fill = self._fills(fat, ci)
                per_row = constant_ints(1, ng)
            else:
                g_accepted = accepted[g]
                valid = g_drafts
                if t.draft_survival is not None:  # the accepted drafts, then the grammar's valid prefix of the rest
                    past = g_drafts - g_accepted
                    widest = int(past.max())
                    if widest:
                        survival = t.draft_survival[:, :widest][t.draft_chain[g_rid]]
                        taken = _sum(rng.random(ng)[:, None] < survival, axis=1)
                        valid = g_accepted + np.minimum(past, taken)
                per_row = valid + 1
                # a row's fills at its next 1 + valid positions, from the pool's prefix sums, all at the row's
                # position on the spec's curve
                csum = t.fill_csum
                row_fill = (csum[fat + per_row] - csum[fat]) * t.curve[ci]
                if t.spike is not None:  # an outlier is one per measured row: a drafted row's is its mean over its rows
                    row_fill += t.spike[fat] * per_row
                if self._fill_scale != 1.0:
                    row_fill *= self._fill_scale
                row_fill = row_fill + accept_one * valid  # valid drafts enter the grammar to fill their rows
                rolled = valid - g_accepted
                rolled_back = np.zeros(n, np.int64)
                rolled_back[g] = rolled
                undo = rolled.nonzero()[0]
                if len(undo):
                    undone = float(_sum(t.rollback[at[undo]])) if t.rollback is not None else math.nan
                    if math.isnan(undone):  # (a kind without rollback measurements prices none)
                        raise ProfileError("the grammar costs have no rollback measurements, and drafts are rejected")
                    process_s += undone
            pool = self.parallel_fill
            pooled = pool is not None and ng > pool.threshold and not n_drafts
            if pooled and pool.accepts:  # the sampled tokens' accepts on the fill pool too (consume_token_par)
                process_s += parallel_makespan(accept_one, pool.chunk, pool.threads)
            else:
                process_s += float(_sum(accept_one))  # the sampled (bonus / correction) token
            if self.jump_forward:
                forced = np.minimum(t.forced[at], g_left - produced[g])
                jumped = np.zeros(n, np.int64)
                jumped[g] = forced
                process_s += float(accept_one @ forced)
                produced = produced + jumped
            ended = None
            if t.end_left is not None:  # random walks whose spec's walks ended early: at a measured end length
                end = t.end_left[g_rid]
                hit = (end > 0) & (g_left - produced[g] <= end)
                if _any(hit):
                    at_hit = hit if everyone else g[hit]
                    produced[at_hit] = g_left[hit] - end[hit]
                    accepted = np.minimum(accepted, produced - 1)
                    ended = np.zeros(n, bool)
                    ended[at_hit] = True
            rejected = None
            if t.reject_left is not None:  # the measured refusals: a row whose tokens cover its refused position
                refuse = t.reject_left[g_rid]
                hit = (refuse <= g_left) & (refuse > g_left - produced[g])
                if _any(hit):
                    rejected = np.zeros(n, bool)
                    rejected[hit if everyone else g[hit]] = True
            fill_wall_s = None
            if pooled:
                fill_wall_s = parallel_makespan(row_fill, pool.chunk, pool.threads) * self.costs.parallel_fill_factor
            return StepWork(row_fill, per_row, produced, accepted, rolled_back, jumped, rejected, process_s, ended,
                            fill_wall_s=fill_wall_s)
        return StepWork(NO_FILL, constant_ints(0, 0), produced, accepted, rolled_back, jumped, None, process_s)
