"""Where the scheduler's costs come from.

GPU work (forward, bitmask copy, apply kernel, sampling) always comes from a
:class:`GpuCosts`. Grammar work comes from a :class:`GrammarExecutor`:

* :class:`ModelExecutor` (``model`` mode) draws compile, fill, accept and
  rollback times from a cost source (a backend profile, or :class:`FixedGrammarCosts`),
  vectorized over the rows of a step;
* :class:`~cdbench.harness.hybrid.HybridExecutor` (``hybrid`` mode) calls a real
  backend for every token and times each call.

Both answer one question per step, :meth:`GrammarExecutor.step`: given the rows
that sample now, what did mask building cost, how many tokens does each row
emit, and what did processing the results cost? The answer is a
:class:`StepWork` of numpy arrays, so the scheduler never loops over rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cdbench.backends.base import ConstraintSpec
from cdbench.harness.costs.forward import ForwardCostModel, attention_pairs
from cdbench.harness.costs.grammar_profile import KIND_CODES, GrammarProfile
from cdbench.harness.costs.mask import MaskCost
from cdbench.workloads.request import Request


# Per-step calls on small arrays cost mostly call overhead: count_nonzero is the cheapest
# "any" (several times cheaper than a ufunc reduction), and the direct ufunc reduction the
# cheapest sum (ndarray.sum adds a Python-level wrapper).
_any = np.count_nonzero
_sum = np.add.reduce


def constant_ints(value: int, n: int) -> np.ndarray:
    """A read-only int64 vector of ``n`` copies of ``value`` (shared: callers only read it).

    >>> constant_ints(1, 3).tolist(), constant_ints(1, 3) is constant_ints(1, 3)
    ([1, 1, 1], True)
    """
    key = (value, n)
    v = _CONSTANTS.get(key)
    if v is None:
        v = _CONSTANTS[key] = np.full(n, value, np.int64)
        v.flags.writeable = False
    return v


_CONSTANTS: dict[tuple[int, int], np.ndarray] = {}
NO_FILL = np.zeros(0)  # fill_s of a step without grammar rows
NO_FILL.flags.writeable = False

# ----------------------------------------------------------------------------- GPU costs


class GpuCosts(Protocol):
    """GPU-side time of one step, in seconds."""

    def forward_s(self, prefill_chunks: np.ndarray, prefill_cached: np.ndarray, decode_rows: int, decode_kv_tokens: int) -> float:
        """Forward of prefill chunks (new tokens, tokens already cached) and ``decode_rows`` decoding rows."""

    def copy_s(self, mask_rows: int, pinned: bool) -> float:
        """Host-to-device copy of a ``mask_rows``-row bitmask."""

    def apply_s(self, mask_rows: int) -> float:
        """The apply kernel over ``mask_rows`` rows."""

    def sample_s(self, rows: int) -> float:
        """Sampling ``rows`` logits rows."""


class FixedGpuCosts(BaseModel):
    """Linear GPU costs with explicit coefficients: hand-computable, for tests and what-ifs.

    A step's forward is ``forward_s + prefill_token_s·prefill tokens +
    decode_row_s·decode rows + kv_token_s·KV tokens read`` (0 when empty);
    copy, apply and sample are ``base + per_row·rows`` (0 for no rows).

    >>> FixedGpuCosts(forward_base_s=0.01, decode_row_s=1e-4).forward_s(np.zeros(0), np.zeros(0), 10, 0)
    0.011
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["fixed"] = "fixed"
    forward_base_s: float = Field(0.01, ge=0)
    prefill_token_s: float = Field(0.0, ge=0)
    decode_row_s: float = Field(0.0, ge=0)
    kv_token_s: float = Field(0.0, ge=0)
    copy_base_s: float = Field(0.0, ge=0)
    copy_row_s: float = Field(0.0, ge=0)
    apply_base_s: float = Field(0.0, ge=0)
    apply_row_s: float = Field(0.0, ge=0)
    sample_base_s: float = Field(0.0, ge=0)
    sample_row_s: float = Field(0.0, ge=0)

    def forward_s(self, prefill_chunks, prefill_cached, decode_rows, decode_kv_tokens) -> float:
        tokens = float(_sum(prefill_chunks))
        if tokens + decode_rows <= 0:
            return 0.0
        return (self.forward_base_s + self.prefill_token_s * tokens + self.decode_row_s * decode_rows
                + self.kv_token_s * decode_kv_tokens)

    def copy_s(self, mask_rows: int, pinned: bool) -> float:
        return self.copy_base_s + self.copy_row_s * mask_rows if mask_rows else 0.0

    def apply_s(self, mask_rows: int) -> float:
        return self.apply_base_s + self.apply_row_s * mask_rows if mask_rows else 0.0

    def sample_s(self, rows: int) -> float:
        return self.sample_base_s + self.sample_row_s * rows if rows else 0.0


class RooflineGpuCosts:
    """GPU costs from the roofline forward model and the measured mask-cost tables.

    Mask and sampling times depend only on a row count; they are memoized per
    count, since the loop asks for the same few counts again and again.
    """

    def __init__(self, forward: ForwardCostModel, mask: MaskCost) -> None:
        self.forward, self.mask = forward, mask
        self._copy: dict[tuple[int, bool], float] = {}
        self._apply: dict[int, float] = {}
        self._sample: dict[int, float] = {}

    def forward_s(self, prefill_chunks, prefill_cached, decode_rows, decode_kv_tokens) -> float:
        if len(prefill_chunks):
            tokens = float(_sum(prefill_chunks))
            pairs = float(attention_pairs(prefill_chunks, prefill_cached).sum())
        else:
            tokens = pairs = 0.0
        return self.forward.step_s(tokens, pairs, decode_rows, decode_kv_tokens)

    def copy_s(self, mask_rows: int, pinned: bool) -> float:
        key = (mask_rows, pinned)
        value = self._copy.get(key)
        if value is None:
            value = self._copy[key] = self.mask.copy_s(mask_rows, pinned) if mask_rows else 0.0
        return value

    def apply_s(self, mask_rows: int) -> float:
        value = self._apply.get(mask_rows)
        if value is None:
            value = self._apply[mask_rows] = self.mask.apply_s(mask_rows) if mask_rows else 0.0
        return value

    def sample_s(self, rows: int) -> float:
        value = self._sample.get(rows)
        if value is None:
            value = self._sample[rows] = self.mask.sample_s(rows) if rows else 0.0
        return value


# ----------------------------------------------------------------------------- grammar work


@dataclass(slots=True)
class CompileOutcome:
    """One spec compiled once: how long it took and whether it failed (``error`` names why)."""

    seconds: float
    error: str | None = None


@dataclass(slots=True)
class StepRows:
    """The rows that sample in one step (parallel arrays, one entry a request).

    ``grammar``: the row's grammar is active (structured and past thinking);
    ``drafts``: draft tokens to verify (0 on a prefill row); ``gen_left``:
    tokens the request still has to emit; ``think_left``: thinking tokens left
    (a thinking row emits at most that many this step).
    """

    rid: np.ndarray
    grammar: np.ndarray
    drafts: np.ndarray
    gen_left: np.ndarray
    think_left: np.ndarray


@dataclass(slots=True)
class StepWork:
    """What the grammar side did in one step.

    ``fill_s`` and ``mask_rows`` cover the rows that built masks (the grammar
    rows), in row order: CPU seconds building each one's mask rows (fills,
    plus the temporary accepts of drafts) and how many it built (1 + its
    grammar-valid drafts). The other arrays are parallel to :class:`StepRows`:
    ``produced``: tokens emitted (accepted drafts + 1, plus forced tokens);
    ``accepted``/``rolled_back``: drafts verified / rejected drafts rolled
    back in the grammar; ``jumped``: tokens emitted by jump-forward;
    ``rejected``: the grammar refused a sampled token (``None``: no row did);
    ``ended``: rows whose output ended before its planned length (the grammar
    terminated; ``None``: none); ``drafted``: drafts actually verified per row
    (``None``: as scheduled). ``process_s``: CPU seconds to advance the
    grammars after sampling (accept, rollback, jump-forward), all rows together.
    Executors may return shared read-only arrays; the scheduler only reads them,
    and keeps the counters until it sums them in bulk, so an executor must not
    change an array it has returned.
    """

    fill_s: np.ndarray
    mask_rows: np.ndarray
    produced: np.ndarray
    accepted: np.ndarray
    rolled_back: np.ndarray
    jumped: np.ndarray
    rejected: np.ndarray | None
    process_s: float
    ended: np.ndarray | None = None
    drafted: np.ndarray | None = None


def accepted_drafts(rng: np.random.Generator, drafts: np.ndarray, alpha: float) -> np.ndarray:
    """Leading drafts the target accepts when each is accepted with probability ``alpha``.

    >>> accepted_drafts(np.random.default_rng(0), np.array([0, 3]), 1.0).tolist()
    [0, 3]
    """
    if alpha >= 1.0:
        return drafts.copy()
    if alpha <= 0.0:
        return np.zeros_like(drafts)
    return np.minimum(rng.geometric(1.0 - alpha, size=len(drafts)) - 1, drafts)


@dataclass(frozen=True)
class SpecKeys:
    """The run's distinct specs (index = compile-cache key) and each request's key (-1: none)."""

    texts: list[str]
    kinds: list[str]
    specs: list[ConstraintSpec]
    spec_ids: list[str | None]
    request_key: np.ndarray

    @classmethod
    def of(cls, requests: Sequence[Request]) -> SpecKeys:
        """Number the distinct specs of ``requests`` (by spec id, else by canonical text) in order of first use."""
        index: dict[str, int] = {}
        texts: list[str] = []
        kinds: list[str] = []
        specs: list[ConstraintSpec] = []
        spec_ids: list[str | None] = []
        request_key = np.full(len(requests), -1, np.int64)
        for i, r in enumerate(requests):
            if r.spec is None:
                continue
            text = f"{r.spec.kind}:{r.spec_id}" if r.spec_id is not None else r.spec.canonical()
            key = index.get(text)
            if key is None:
                key = index[text] = len(texts)
                texts.append(text)
                kinds.append(r.spec.kind)
                specs.append(r.spec)
                spec_ids.append(r.spec_id)
            request_key[i] = key
        return cls(texts, kinds, specs, spec_ids, request_key)


class GrammarExecutor(ABC):
    """The grammar side of the loop: compile once per spec, then work per step."""

    #: seconds spent inside backend calls (hybrid); 0 in model mode
    backend_call_s: float = 0.0
    #: seconds spent checking finished outputs against their specs (hybrid)
    validation_s: float = 0.0

    def prepare(self, requests: Sequence[Request], keys: SpecKeys, jump_forward: bool = False) -> None:
        """Called once with the run's requests (in scheduler order), their spec keys, and whether
        forced tokens are emitted without a forward step (the jump-forward what-if)."""
        self.requests, self.keys, self.jump_forward = requests, keys, jump_forward

    @abstractmethod
    def compile(self, key: int) -> CompileOutcome:
        """Compile spec ``key`` once (its time is reused for every simulated compile of it)."""

    def finish(self, rid: int) -> None:
        """Request ``rid`` ended: whatever the executor keeps for it can go."""

    def validity(self) -> Iterator[tuple[int, bool]]:
        """``(request id, whether its output satisfies its spec)`` for the ended requests whose
        output is checked; called once, after the run (none by default)."""
        return iter(())

    @abstractmethod
    def step(self, rows: StepRows, rng: np.random.Generator) -> StepWork:
        """Build masks, verify drafts, emit tokens and advance grammars for one step."""


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
