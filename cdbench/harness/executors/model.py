"""``model`` mode: grammar costs drawn from a cost source instead of a real backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cdbench.harness.costs.grammar_profile import KIND_CODES, GrammarProfile
from cdbench.harness.executors.base import (
    NO_FILL,
    CompileOutcome,
    GrammarExecutor,
    SpecKeys,
    StepRows,
    StepWork,
    accepted_drafts,
    constant_ints,
)
from cdbench.workloads.request import Request

# Per-step calls on small arrays cost mostly call overhead: count_nonzero is the cheapest
# "any" (several times cheaper than a ufunc reduction), and the direct ufunc reduction the
# cheapest sum (ndarray.sum adds a Python-level wrapper).
_any = np.count_nonzero
_sum = np.add.reduce



class GrammarCosts(Protocol):
    """Grammar costs the model executor draws: ``n`` draws of constraint kind ``kinds`` — one kind
    code for all draws, or an array of codes, one per draw
    (:data:`~cdbench.harness.costs.grammar_profile.KIND_CODES`; -1 pools all kinds)."""

    def compile(self, spec_id: str | None, key_text: str, kind: str) -> CompileOutcome: ...

    def fill_s(self, n: int, kinds: int | np.ndarray) -> np.ndarray: ...

    def accept_s(self, n: int, kinds: int | np.ndarray) -> np.ndarray: ...

    def rollback_s(self, n: int, kinds: int | np.ndarray) -> np.ndarray: ...

    def jump_forward(self, n: int, kinds: int | np.ndarray) -> np.ndarray:
        """Tokens the grammar forces at this point (0: none), one per draw."""


class FixedGrammarCosts(BaseModel):
    """Constant grammar costs: hand-computable, for tests and what-ifs.

    ``compile_by_key`` overrides ``compile_time_s`` per spec (by spec id, or
    ``kind:spec_id``); specs in ``failing_keys`` fail to compile after their
    compile time. ``forced_tokens`` is how many tokens the grammar forces after
    every token (used by the jump-forward what-if).
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

    def compile(self, spec_id: str | None, key_text: str, kind: str) -> CompileOutcome:
        names = {key_text} | ({spec_id} if spec_id is not None else set())
        seconds = next((self.compile_by_key[n] for n in names if n in self.compile_by_key), self.compile_time_s)
        failed = any(n in self.failing_keys for n in names)
        return CompileOutcome(seconds, "invalid: listed in failing_keys" if failed else None)

    def fill_s(self, n: int, kinds: int | np.ndarray) -> np.ndarray:
        return np.full(n, self.fill_time_s)

    def accept_s(self, n: int, kinds: int | np.ndarray) -> np.ndarray:
        return np.full(n, self.accept_time_s)

    def rollback_s(self, n: int, kinds: int | np.ndarray) -> np.ndarray:
        return np.full(n, self.rollback_time_s)

    def jump_forward(self, n: int, kinds: int | np.ndarray) -> np.ndarray:
        return np.full(n, self.forced_tokens, np.int64)


class ProfileGrammarCosts:
    """Grammar costs drawn from a backend's measured :class:`GrammarProfile` (seeded).

    Draws of one kind are taken from blocks of ``block`` draws made ahead of
    time: the same independent draws as one call per step, at a fraction of the
    per-call cost (the loop asks for a few hundred draws per step).
    """

    _NAMES = {code: kind for kind, code in KIND_CODES.items()}

    def __init__(self, profile: GrammarProfile, seed: int, block: int = 1 << 16) -> None:
        self.profile = profile
        self.sampler = profile.sampler(seed)
        self.block = block
        self._pools: dict[tuple[str, int], list] = {}  # (metric, kind code) -> [draws, next unused, count]

    def _draw(self, metric: str, n: int, kinds: int | np.ndarray) -> np.ndarray:
        if isinstance(kinds, np.ndarray):
            return getattr(self.sampler, metric)(kinds)
        state = self._pools.get((metric, kinds))
        if state is None:
            state = self._pools[(metric, kinds)] = [np.zeros(0), 0, 0]
        pool, at, size = state
        end = at + n
        if end > size:
            pool = np.concatenate((pool[at:], getattr(self.sampler, metric)(max(self.block, n), self._NAMES.get(kinds))))
            state[0], state[2] = pool, len(pool)
            at, end = 0, n
        state[1] = end
        return pool[at:end]

    def compile(self, spec_id: str | None, key_text: str, kind: str) -> CompileOutcome:
        ids = [spec_id if spec_id is not None else key_text]
        seconds = float(self.sampler.compile_s(ids, [kind])[0])
        status = str(self.sampler.compile_status(ids, [kind])[0])
        return CompileOutcome(seconds, None if status == "ok" else status)

    def fill_s(self, n: int, kinds: int | np.ndarray) -> np.ndarray:
        return self._draw("fill_s", n, kinds)

    def accept_s(self, n: int, kinds: int | np.ndarray) -> np.ndarray:
        return self._draw("accept_s", n, kinds)

    def rollback_s(self, n: int, kinds: int | np.ndarray) -> np.ndarray:
        return self._draw("rollback_s", n, kinds)

    def jump_forward(self, n: int, kinds: int | np.ndarray) -> np.ndarray:
        return self._draw("jump_forward", n, kinds)


class ModelExecutor(GrammarExecutor):
    """``model`` mode: grammar costs drawn from ``costs``, vectorized over a step's rows.

    Parameters
    ----------
    costs : the cost source (a backend profile, or fixed numbers).
    alpha : per-draft acceptance probability of the target model.

    Per grammar row and step: ``1 + k`` fills and ``k`` draft accepts build the
    mask; after verification one rollback call undoes the rejected drafts and
    one accept takes the sampled token; jump-forward accepts the forced tokens.
    """

    def __init__(self, costs: GrammarCosts, alpha: float = 0.0) -> None:
        self.costs, self.alpha = costs, alpha
        self.kind_code = np.zeros(0, np.int64)
        self._runs = np.zeros(0, np.int64)  # pooled draws of accepted-draft run lengths
        self._runs_at = 0

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

    def prepare(self, requests: Sequence[Request], keys: SpecKeys, jump_forward: bool = False) -> None:
        super().prepare(requests, keys, jump_forward)
        codes = np.array([KIND_CODES[k] for k in keys.kinds] + [-1], np.int64)
        self.kind_code = codes[keys.request_key]  # key -1 picks the trailing "pooled" code
        # one kind for the whole run: draw with a single code (the sampler's cheaper path)
        self.single_kind = int(codes[0]) if len(set(keys.kinds)) == 1 else None

    def compile(self, key: int) -> CompileOutcome:
        k = self.keys
        return self.costs.compile(k.spec_ids[key], k.texts[key], k.kinds[key])

    def step(self, rows: StepRows, rng: np.random.Generator) -> StepWork:
        n = len(rows.rid)
        grammar, drafts, gen_left = rows.grammar, rows.drafts, rows.gen_left
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
        g = grammar.nonzero()[0]
        ng = len(g)
        if ng:
            costs = self.costs
            single = self.single_kind
            codes = self.kind_code[rows.rid[g]] if single is None else single
            g_drafts = drafts[g]
            total = ng + int(_sum(g_drafts))
            accept_one = None
            if total == ng:
                row_fill = costs.fill_s(ng, codes)
                per_row = constant_ints(1, ng)
            else:
                per_row = g_drafts + 1
                draws = costs.fill_s(total, codes if single is not None else np.repeat(codes, per_row))
                row_fill = np.add.reduceat(draws, np.add.accumulate(per_row) - per_row)  # per-row sums
                accept_one = costs.accept_s(ng, codes)
                row_fill = row_fill + accept_one * g_drafts  # drafts enter the grammar to fill their rows
                rolled = g_drafts - accepted[g]
                rolled_back = np.zeros(n, np.int64)
                rolled_back[g] = rolled
                undo = rolled.nonzero()[0]
                if len(undo):
                    process_s += float(_sum(costs.rollback_s(len(undo), codes if single is not None
                                                             else codes[undo])))
            if accept_one is None:
                accept_one = costs.accept_s(ng, codes)
            process_s += float(_sum(accept_one))  # the sampled (bonus / correction) token
            if self.jump_forward:
                forced = np.minimum(costs.jump_forward(ng, codes), gen_left[g] - produced[g])
                jumped = np.zeros(n, np.int64)
                jumped[g] = forced
                process_s += float(accept_one @ forced)
                produced = produced + jumped
            return StepWork(row_fill, per_row, produced, accepted, rolled_back, jumped, None, process_s)
        return StepWork(NO_FILL, constant_ints(0, 0), produced, accepted, rolled_back, jumped, None, process_s)
