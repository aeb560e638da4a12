"""What the scheduler asks of its grammar side, and the values that cross between them.

A :class:`GrammarExecutor` answers one question per step,
:meth:`GrammarExecutor.step`: given the rows that sample now (:class:`StepRows`),
what did mask building cost, how many tokens does each row emit, and what did
processing the results cost? The answer is a :class:`StepWork` of numpy arrays,
so the scheduler never loops over rows. The executors:

* :class:`~cdbench.harness.executors.model.ModelExecutor` (``model`` mode) draws
  compile, fill, accept and rollback times from a cost source (a backend
  profile, or fixed numbers), vectorized over the rows of a step;
* :class:`~cdbench.harness.executors.hybrid.HybridExecutor` (``hybrid`` mode)
  calls a real backend for every token and times each call.

GPU work comes from :class:`~cdbench.harness.costs.gpu.GpuCosts`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from cdbench.backends.base import ConstraintSpec
from cdbench.harness.costs.grammar_profile import GrammarProfile
from cdbench.harness.costs.spec_profile import COPY_MARK, base_key_text, instance_key
from cdbench.workloads.request import Request


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


@dataclass(slots=True)
class CompileOutcome:
    """One spec compiled once: how long it took and whether it failed (``error`` names why)."""

    seconds: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ParallelFill:
    """vLLM's parallel mask fill: a step with more than ``threshold`` grammar rows (and no drafts)
    fills them in tasks of ``chunk`` rows on a pool of ``threads`` threads, and waits for all.
    ``accepts``: the same step's accepts of the sampled tokens are spread over the pool too
    (llguidance's ``LLExecutor.consume_token_par``; ``scheduler.accept_parallel``)."""

    threshold: int
    chunk: int
    threads: int
    accepts: bool = False


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
    ``fill_wall_s``: the step's fills spread over the parallel fill pool
    (:class:`ParallelFill`): their wall time, start to the last task's end
    (``None``: the fills ran one after another, and took ``fill_s``'s sum).
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
    fill_wall_s: float | None = None


@dataclass(slots=True)
class DecodeRun:
    """The grammar side of ``steps`` identical decode steps taken at once (:meth:`GrammarExecutor.decode_run`):
    each step's fill seconds and accept seconds per grammar row (``fill_s[j]``, one mask row each; ``accept_s[j]``,
    summed over the step's rows its ``process_s``), as the steps one by one give them. ``steps`` may be fewer
    than asked: a row's grammar ends or refuses its token at the next one."""

    steps: int
    fill_s: np.ndarray
    accept_s: np.ndarray


@dataclass(slots=True)
class Settlement:
    """Grammar work of a step done after its sampling (:meth:`GrammarExecutor.settle`): the CPU
    seconds it took, and the step's rows whose token the grammar refused there (``None``: none)."""

    process_s: float
    rejected: np.ndarray | None


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


class SpecKeys:
    """The run's distinct specs, numbered in order of first use (index = compile-cache key), by spec id, else
    by canonical text: ``texts``, ``kinds``, ``specs`` and ``spec_ids`` by key.

    :meth:`enter` numbers one request's spec as it enters the scheduler. With ``fresh_copies`` (a workload
    not held, as the generator builds it: each unique copy ``id#copyN`` once), a copy's key is new without
    looking it up and :meth:`forget` lets its entries go once its request has taken them, so the keys held are
    those of the corpus items and the requests entered but not arrived. :meth:`of` numbers held requests up
    front, also per request (``request_key``, -1: none; ``request_instance``: the
    :func:`~cdbench.harness.costs.spec_profile.instance_key` of the text it walks, ``None``: no oracle tokens).
    """

    def __init__(self, fresh_copies: bool = False) -> None:
        self.fresh_copies = fresh_copies
        self.texts: dict[int, str] = {}
        self.kinds: dict[int, str] = {}
        self.specs: dict[int, ConstraintSpec] = {}
        self.spec_ids: dict[int, str | None] = {}
        self.bases: dict[int, str] = {}  # the key text its instances are known under
        self.count = 0  # keys numbered so far
        self._index: dict[str, int] = {}
        self._shared: dict[str, str] = {}  # one base text for all copies of an item, not one a copy
        self._hashed: dict[tuple[str, tuple[int, ...]], str] = {}  # (base text, tokens) -> instance key
        self._fresh: set[int] = set()  # copies' keys not forgotten yet
        self.request_key: np.ndarray | None = None
        self.request_instance: list[str | None] | None = None

    def enter(self, r: Request) -> tuple[int, str | None]:
        """``r``'s key (-1: unconstrained; a new spec gets the next) and its text's instance key."""
        if r.spec is None:
            return -1, None
        text = f"{r.spec.kind}:{r.spec_id}" if r.spec_id is not None else r.spec.canonical()
        fresh = self.fresh_copies and r.spec_id is not None and COPY_MARK in r.spec_id
        key = None if fresh else self._index.get(text)
        if key is None:
            key, self.count = self.count, self.count + 1
            if fresh:
                self._fresh.add(key)
            else:
                self._index[text] = key
            self.texts[key], self.kinds[key], self.specs[key], self.spec_ids[key] = text, r.spec.kind, r.spec, r.spec_id
            base = base_key_text(text, r.spec.kind, r.spec_id)
            self.bases[key] = self._shared.setdefault(base, base)
        if r.output_tokens is None:
            return key, None
        text_of = (self.bases[key], r.output_tokens)
        found = self._hashed.get(text_of)
        if found is None:
            found = self._hashed[text_of] = instance_key(text_of[0], r.output_tokens)
        return key, found

    def fresh(self, key: int) -> bool:
        """``key`` is a copy's (``fresh_copies``) not forgotten yet: no other request has it."""
        return key in self._fresh

    def forget(self, key: int) -> None:
        """A copy's key was taken by its request (``fresh_copies``): no other request has it, its entries go."""
        if key in self._fresh:
            self._fresh.discard(key)
            del self.texts[key], self.kinds[key], self.specs[key], self.spec_ids[key], self.bases[key]

    @classmethod
    def of(cls, requests: Iterable[Request], n: int | None = None) -> SpecKeys:
        """Number the distinct specs of held ``requests`` (``n`` of them; read once, in order), keeping each
        request's key and instance key."""
        if n is None:
            n = len(requests)  # type: ignore[arg-type]
        keys = cls()
        keys.request_key = np.full(n, -1, np.int64)
        keys.request_instance = [None] * n
        for i, r in enumerate(requests):
            keys.request_key[i], keys.request_instance[i] = keys.enter(r)
        return keys


class GrammarExecutor(ABC):
    """The grammar side of the loop: compile once per spec, then work per step."""

    #: seconds spent inside backend calls (hybrid); 0 in model mode
    backend_call_s: float = 0.0
    #: seconds spent checking finished outputs against their specs (hybrid)
    validation_s: float = 0.0
    #: set by the ``live`` loop per step: defer the accepts of sampled tokens to :meth:`settle`
    defer_accepts: bool = False
    #: the engine's parallel fill, from :meth:`prepare` (``None``: serial fills)
    parallel_fill: ParallelFill | None = None

    def prepare(self, requests: Sequence[Request], keys: SpecKeys, capacity: int | None = None,
                jump_forward: bool = False, parallel_fill: ParallelFill | None = None, drafts: bool = True) -> None:
        """Called once with the run's requests (in scheduler order; empty when the run does not hold them),
        their spec keys, the request slots the scheduler starts with (``None``: one a request; see
        :attr:`reads_requests`), whether forced tokens are emitted without a forward step (the jump-forward
        what-if), the engine's parallel fill (``None``: fills always run one after another), and whether any
        step may carry drafts (``False``: what only drafts need is not built)."""
        self.requests, self.keys, self.jump_forward = requests, keys, jump_forward
        self.parallel_fill = parallel_fill

    #: the executor reads the run's requests by their position (``rid``), so the scheduler holds them all, numbers
    #: them up front and never reuses a request's slot; otherwise a request takes a slot before it is issued
    #: (:meth:`enter`, a chunk of requests at a time) and its slot is reused once it ended
    reads_requests: bool = False

    def enter(self, rids: np.ndarray, requests: Sequence[Request], keys: np.ndarray,
              instances: Sequence[str | None]) -> None:
        """``requests`` entered the scheduler in slots ``rids`` (their spec ``keys``, -1: none, and the instance
        keys of the texts they walk, ``None``: none), in scheduler order, a chunk at a time."""

    def grow(self, capacity: int) -> None:
        """The scheduler has ``capacity`` request slots from now on."""

    @abstractmethod
    def compile(self, key: int) -> CompileOutcome:
        """Compile spec ``key`` once (its time is reused for every simulated compile of it)."""

    def arrive(self, rid: int) -> None:
        """Structured request ``rid`` reached the engine: what the executor needs for it is built from now on
        (``model`` mode: its cost pools; the executor then holds those of the requests in flight)."""

    def finish(self, rid: int) -> None:
        """Request ``rid`` ended: whatever the executor keeps for it can go."""

    def abort(self, rid: int) -> None:
        """Request ``rid`` aborted (before or during its grammar steps): whatever the executor keeps
        for it can go, and its output is not checked."""

    def measured_profile(self, source: str) -> GrammarProfile | None:
        """The grammar costs the run measured, after it (``None``: nothing measured, as in model mode)."""
        return None

    def validity(self) -> Iterator[tuple[int, bool]]:
        """``(request id, whether its output satisfies its spec)`` for the ended requests whose
        output is checked; called once, after the run (none by default)."""
        return iter(())

    @abstractmethod
    def step(self, rows: StepRows, rng: np.random.Generator) -> StepWork:
        """Build masks, verify drafts, emit tokens and advance grammars for one step."""

    def step_one(self, rid: int, gen_left: int, grammar: bool, rng: np.random.Generator) -> StepWork:
        """:meth:`step` of one row (request ``rid``, ``gen_left`` tokens left, ``grammar``: its grammar active)
        without drafts or thinking: a prompt's first token, run alone."""
        return self.step(StepRows(np.array((rid,), np.int64), np.array((grammar,)), constant_ints(0, 1),
                                  np.array((gen_left,), np.int64), constant_ints(0, 1)), rng)

    def decode_run(self, rid: np.ndarray, grammar: np.ndarray, gen_left: np.ndarray, steps: int) -> DecodeRun | None:
        """Up to ``steps`` decode steps of rows ``rid`` (``grammar``: their grammar is active; ``gen_left``: their
        tokens left; past a row's last token, what is given for it is a placeholder) without drafts, thinking or forced tokens, taken at once: what
        :meth:`step` gives for each, or ``None`` where the executor cannot take them at once (then it is
        asked step by step). A run stops before a step where a row's grammar ends or refuses its token."""
        return None

    def settle(self) -> Settlement | None:
        """Finish the last step's grammar work that waits for sampling (``None``: nothing waits).

        The ``live`` loop calls it after the step's sampling when the executor defers accepts.
        """
        return None


