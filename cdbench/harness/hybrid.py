"""``hybrid`` mode: the real grammar backend does every compile, fill, accept and rollback.

Each backend call is timed with ``time.perf_counter_ns`` and its measured
time is what the virtual clock advances by (the GPU side still comes from the
cost model). Structured requests carry their answer tokens (``Request.output_tokens``, EOS
last, e.g. a tokenized valid instance): they are the oracle the simulated
model "samples". A structured request without them is a random walk: the
token at each position is drawn from the mask row the backend just filled
(:class:`~cdbench.workloads.token_sources.RandomWalk`), and the request ends
when its grammar terminates (or at ``output_len``). Drafts for speculative decoding
come from a :class:`DraftSource`; by default :class:`OracleDrafts` proposes the
oracle's next tokens, each right with probability ``alpha``.

Thinking: with the ``reasoner`` backend, a thinking request's matcher starts in
its thinking phase (with the request's budget) and is fed seeded random
ordinary tokens, then the think-end token; with any other backend the grammar
does not advance while the model reasons (vLLM's behaviour), so thinking tokens
are counted but never materialised.
Unconstrained rows need no backend; their drafts are accepted with
probability ``alpha`` as in ``model`` mode.

Every finished structured output is decoded and checked against its spec
(:func:`cdbench.workloads.validate.check_instance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter_ns
from typing import Protocol

import numpy as np

from cdbench.backends.base import CompiledGrammar, CompileError, GrammarBackend, Matcher
from cdbench.backends.reasoner import ReasonerBackend
from cdbench.harness.executors import CompileOutcome, GrammarExecutor, StepRows, StepWork, accepted_drafts
from cdbench.workloads.request import Request
from cdbench.workloads.token_sources import RandomWalk
from cdbench.workloads.validate import InvalidInstance, check_instance

_NS = 1e-9
_UNSEEN = object()  # a request the lean path has not looked at yet


class DraftSource(Protocol):
    """Proposes ``k`` draft tokens for ``request`` after ``position`` answer tokens."""

    def propose(self, request: Request, position: int, k: int) -> Sequence[int]: ...


class OracleDrafts:
    """Drafts that match the oracle's next tokens, each with probability ``alpha`` until the first miss
    (a simple stand-in for the workload's draft source).

    A missed draft and those after it are random ordinary tokens (seeded; never
    special tokens, which a draft model does not propose inside an answer).

    >>> drafts = OracleDrafts(1.0, token_ids=np.arange(100), seed=0)
    >>> list(drafts.propose(Request(0, 0.0, 1, 3, output_tokens=(5, 6, 7)), 0, 2))
    [5, 6]
    """

    def __init__(self, alpha: float, token_ids: np.ndarray, seed: int = 0) -> None:
        self.alpha, self.token_ids = alpha, token_ids
        self.rng = np.random.default_rng(seed)
        self._uniform: list[float] = []
        self._random: list[int] = []

    def _refill(self) -> None:
        # draws in blocks: one generator call per 4096 draws rather than one per draft
        self._uniform = self.rng.random(4096).tolist()
        self._random = self.token_ids[self.rng.integers(0, len(self.token_ids), 4096)].tolist()

    def propose(self, request: Request, position: int, k: int) -> list[int]:
        """``k`` drafts after ``position`` answer tokens (none for a request without oracle tokens)."""
        oracle = request.output_tokens
        if not oracle:
            return []
        out: list[int] = []
        for j in range(k):
            if len(self._uniform) < 1 or len(self._random) < k:
                self._refill()
            if position + j < len(oracle) and self._uniform.pop() < self.alpha:
                out.append(oracle[position + j])
            else:
                out.extend(self._random.pop() for _ in range(k - j))
                break
        return out


class HybridExecutor(GrammarExecutor):
    """Grammar work by a real backend, timed call by call.

    Parameters
    ----------
    backend : the grammar engine (bound to the run's vocabulary).
    alpha : draft acceptance for unconstrained rows (and of the default draft source).
    drafts : where drafts come from (default :class:`OracleDrafts`).
    seed : seeds the default draft source (and the default random walk).
    walk : draws tokens for structured requests without oracle tokens
        (default: a :class:`RandomWalk` over the backend's vocabulary).
    """

    def __init__(self, backend: GrammarBackend, alpha: float = 0.0, drafts: DraftSource | None = None,
                 seed: int = 0, walk: RandomWalk | None = None) -> None:
        self.backend, self.alpha = backend, alpha
        self.walk = walk or RandomWalk(backend.vocab.eos_token_ids, backend.vocab.size, seed)
        self._emitted: dict[int, list[int]] = {}  # random-walk requests: the tokens they emitted
        vocab = backend.vocab
        self._ordinary = np.setdiff1d(np.arange(vocab.size), np.fromiter(vocab.forbidden_token_ids, np.int64))
        self._think_rng = np.random.default_rng([seed, 1])
        end = getattr(backend, "think_end_id", -1)
        self._think_tokens = self._ordinary[self._ordinary != end]
        self.drafts = drafts if drafts is not None else OracleDrafts(alpha, self._ordinary, seed)
        self.backend_call_s = 0.0
        self.validation_s = 0.0
        self._compiled: dict[int, CompiledGrammar] = {}
        self._matchers: dict[int, Matcher] = {}
        self._position: dict[int, int] = {}
        self._rejected: set[int] = set()
        self._eos = frozenset(backend.vocab.eos_token_ids)
        self._mask = backend.allocate_mask(1)
        # oracle requests' bound (fill_mask, accept) and tokens, for the one-fill-one-accept step
        self._lean: dict[int, tuple | None] = {}

    def _timed(self, fn, *args):
        start = perf_counter_ns()
        value = fn(*args)
        elapsed = (perf_counter_ns() - start) * _NS
        self.backend_call_s += elapsed
        return value, elapsed

    def compile(self, key: int) -> CompileOutcome:
        start = perf_counter_ns()
        try:
            self._compiled[key] = self.backend.compile(self.keys.specs[key])
            error = None
        except CompileError as exc:
            error = f"{exc.reason}: {exc.message}" if exc.message else exc.reason
        elapsed = (perf_counter_ns() - start) * _NS
        self.backend_call_s += elapsed
        return CompileOutcome(elapsed, error)

    def _matcher(self, rid: int) -> Matcher:
        matcher = self._matchers.get(rid)
        if matcher is None:
            key = int(self.keys.request_key[rid])
            request = self.requests[rid]
            if isinstance(self.backend, ReasonerBackend):
                matcher, _ = self._timed(lambda g: self.backend.matcher(
                    g, thinking=request.think_len > 0, thinking_budget=request.thinking_budget), self._compiled[key])
            else:
                matcher, _ = self._timed(self.backend.matcher, self._compiled[key])
            self._matchers[rid] = matcher
            self._position[rid] = 0
        return matcher

    def _lean_entry(self, rid: int) -> tuple | None:
        """``(fill_mask, accept, oracle tokens)`` of request ``rid``, or ``None`` without oracle tokens."""
        oracle = self.requests[rid].output_tokens
        matcher = self._matchers.get(rid) or self._matcher(rid)
        entry = self._lean[rid] = (matcher.fill_mask, matcher.accept, oracle) if oracle is not None else None
        return entry

    def step(self, rows: StepRows, rng: np.random.Generator) -> StepWork:
        n = len(rows.rid)
        drafts = rows.drafts
        # unconstrained and thinking rows: no backend, drafts accepted with probability alpha
        accepted = accepted_drafts(rng, drafts, self.alpha) if drafts.any() else np.zeros(n, np.int64)
        produced = np.minimum(accepted + 1, rows.gen_left)
        thinking = rows.think_left > 0
        produced = np.where(thinking, np.minimum(produced, rows.think_left), produced)
        accepted = np.minimum(accepted, produced - 1)
        fill_s = np.zeros(n)
        mask_rows = np.zeros(n, np.int64)
        rolled_back = np.zeros(n, np.int64)
        jumped = np.zeros(n, np.int64)
        rejected = np.zeros(n, bool)
        ended = None
        verified = drafts.copy() if drafts.any() else None
        # Per-row Python is the overhead hybrid mode pays on top of the backend: keep it to
        # local lookups and one clock read around each backend call.
        clock = perf_counter_ns
        backend_ns = 0
        process_ns = 0
        mask = self._mask
        requests, positions, propose = self.requests, self._position, self.drafts.propose
        rids, lefts, ks = rows.rid.tolist(), rows.gen_left.tolist(), drafts.tolist()
        k_max = max(ks, default=0)
        matchers = self._matchers
        grammar_rows = np.flatnonzero(rows.grammar).tolist()
        plain_rows: list[int] = []
        plain: list[tuple] = []
        if not self.jump_forward:
            # the common step, one fill and one accept of an oracle token: batched below
            lean = self._lean
            candidates = grammar_rows if k_max == 0 else [i for i in grammar_rows if not ks[i]]
            entries = [lean.get(rids[i], _UNSEEN) for i in candidates]
            if _UNSEEN in entries:
                entries = [self._lean_entry(rids[i]) if e is _UNSEEN else e for i, e in zip(candidates, entries)]
            if None in entries:  # requests without oracle tokens take the general path
                plain_rows = [i for i, e in zip(candidates, entries) if e is not None]
                plain = [e for e in entries if e is not None]
            else:
                plain_rows, plain = candidates, entries
            if len(plain_rows) < len(grammar_rows):
                lean_rows = set(plain_rows)
                grammar_rows = [i for i in grammar_rows if i not in lean_rows]
            else:
                grammar_rows = []
        for i in grammar_rows:
            rid, k = rids[i], ks[i]
            left = lefts[i]
            request = requests[rid]
            oracle = request.output_tokens
            matcher = matchers.get(rid) or self._matcher(rid)
            pos = positions[rid]
            if mask.shape[0] < k + 1:
                mask = self._mask = self.backend.allocate_mask(k + 1)
            # mask building: fill, then accept each draft and fill its row (the grammar-valid prefix)
            proposed = list(propose(request, pos, k)) if k else ()
            if verified is not None:
                verified[i] = len(proposed)
            t0 = clock()
            matcher.fill_mask(mask, 0)
            valid = 0
            for token in proposed:
                if not matcher.accept(int(token)):
                    break
                valid += 1
                matcher.fill_mask(mask, valid)
            t1 = clock()
            fill_s[i] = (t1 - t0) * _NS
            backend_ns += t1 - t0
            mask_rows[i] = 1 + valid
            # verification against what the target samples: keep the matching prefix, roll back the rest
            if oracle is None:  # random walk: the target samples from each filled row
                sampled = [self.walk.next_token(mask[j], request_id=request.request_id, position=pos + j)
                           for j in range(valid + 1)]
            else:
                sampled = oracle[pos:pos + valid + 1]
            match = 0
            while match < valid and proposed[match] == sampled[match]:
                match += 1
            match = min(match, left - 1)
            t0 = clock()
            if valid - match:
                matcher.rollback(valid - match)
            ok = matcher.accept(sampled[match])
            t1 = clock()
            process_ns += t1 - t0
            if not ok:
                rejected[i] = True
                self._rejected.add(rid)
            accepted[i], rolled_back[i] = match, valid - match
            pos += match + 1
            emitted = match + 1
            if oracle is None:
                self._emitted.setdefault(rid, []).extend(sampled[:match + 1])
            more = pos < len(oracle) if oracle is not None else not matcher.is_terminated()
            if self.jump_forward and more and emitted < left and not matcher.is_terminated():
                t0 = clock()
                forced = matcher.jump_forward()
                forced_ok = 0
                for token in forced[: left - emitted]:
                    if oracle is not None and token != oracle[pos + forced_ok] or not matcher.accept(token):
                        break
                    forced_ok += 1
                t1 = clock()
                process_ns += t1 - t0
                if oracle is None:
                    self._emitted[rid].extend(forced[:forced_ok])
                jumped[i] = forced_ok
                pos += forced_ok
                emitted += forced_ok
            if oracle is None and emitted < left and matcher.is_terminated():
                if ended is None:
                    ended = np.zeros(n, bool)
                ended[i] = True
            produced[i] = emitted
            positions[rid] = pos
        if plain_rows:
            # Rows are independent matchers, so all fills run first (each timed: the parallel-fill
            # model needs per-row times; one clock read between consecutive fills), then all
            # accepts under one clock pair.
            stamps = [clock()]
            stamp = stamps.append
            for fill, _, _ in plain:
                fill(mask, 0)
                stamp(clock())
            plain_ns = np.diff(stamps)
            backend_ns += stamps[-1] - stamps[0]
            plain_rids = [rids[i] for i in plain_rows]
            tokens = [oracle[positions[rid]] for rid, (_, _, oracle) in zip(plain_rids, plain)]
            t0 = clock()
            oks = [accept(token) for (_, accept, _), token in zip(plain, tokens)]
            process_ns += clock() - t0
            for i, rid, ok in zip(plain_rows, plain_rids, oks):
                positions[rid] += 1
                if not ok:
                    rejected[i] = True
                    self._rejected.add(rid)
            fill_s[plain_rows] = plain_ns * _NS
            mask_rows[plain_rows] = 1
        if isinstance(self.backend, ReasonerBackend) and thinking.any():
            process_ns += self._think(rows, produced)
        process_s = process_ns * _NS
        self.backend_call_s += (backend_ns + process_ns) * _NS
        return StepWork(fill_s, mask_rows, produced, accepted, rolled_back, jumped, rejected, process_s, ended,
                        verified)

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
            spent += perf_counter_ns() - start
        return spent

    def finish(self, rid: int) -> bool | None:
        """Decode the answer and check it against the spec (``None`` for unconstrained requests)."""
        request = self.requests[rid]
        self._matchers.pop(rid, None)
        self._lean.pop(rid, None)
        if request.spec is None:
            return None
        position = self._position.pop(rid, 0)
        if rid in self._rejected:
            return False
        emitted = self._emitted.pop(rid, None)
        source = request.output_tokens[:position] if request.output_tokens is not None else emitted or []
        start = perf_counter_ns()
        tokens = [t for t in source if t not in self._eos]
        try:
            check_instance(request.spec, self.backend.vocab.decode(tokens))
            return True
        except InvalidInstance:
            return False
        finally:
            self.validation_s += (perf_counter_ns() - start) * _NS
