"""The grammar costs a ``hybrid`` run measured, kept as a :class:`GrammarProfile`.

The hybrid executor already times every compile and every row's fills; the
:class:`InSituRecorder` keeps references to those per-step arrays (no work per
token) and, after the run, regroups them into one walk per request and one
compile per spec, so that :meth:`GrammarProfile.from_measurements` builds the
per-kind pools and the per-spec sections (compile, fill scale, position curve,
accept, rollback) of the run. ``model`` mode given that file replays the run's
cost structure.

What hybrid times, and so what the profile holds: a row's fill seconds cover
its mask rows (the first fill, plus each grammar-valid draft's accept and fill).
The profile's fill is one fill alone, as ``model`` mode charges it (it adds
each draft's accept itself), so a row's sample is its seconds less one
accept (the run's mean) per draft row, over its mask rows. Accepts are timed per step
for all rows together, so each row's accept sample is its step's accept time
over the step's accept calls (the sampled token plus jump-forward tokens), from
steps without rollbacks; a step with rollbacks gives one rollback sample per
rollback call: what the step's processing took beyond those accepts (at the
run's mean accept), over its rollback calls. A request whose sampled token the
grammar refused (it aborts) records the position, so ``model`` mode aborts
its replay there too.

Beyond costs, what shapes the work: per drafted row, how many drafts were
proposed past those the target accepted and how many of them the grammar took
(it builds rows for its valid prefix only); per random walk (no oracle
tokens), the answer length at which its grammar terminated it; per thinking
request of the ``reasoner`` backend, the thinking tokens its matcher accepted
and their seconds; for the steps whose fills ran on the engine's parallel fill
pool, the pool's wall time against the makespan of the rows' own fill times
(:class:`~cdbench.harness.costs.grammar_profile.ParallelFillProfile`).
"""

from __future__ import annotations

import numpy as np

from cdbench.harness.costs.grammar_profile import (
    CompileMeasurement,
    GrammarProfile,
    ParallelFillProfile,
    WalkMeasurement,
)
from cdbench.harness.costs.spec_profile import spec_key_hash
from cdbench.harness.costs.spec_store import backend_version
from cdbench.harness.executors.base import ParallelFill, SpecKeys
from cdbench.harness.step_time import parallel_makespan
from cdbench.workloads.generator import original_of_copy
from cdbench.workloads.instances import spec_hash

_STATUS = {"unsupported": "unsupported", "timeout": "timeout"}  # any other CompileError reason is an error


def compile_status(reason: str | None) -> str:
    """The profile's compile status for a :class:`~cdbench.backends.base.CompileError` reason (``None``: ok)."""
    return "ok" if reason is None else _STATUS.get(reason, "error")


class InSituRecorder:
    """Keeps what a hybrid run measured, step by step, for :meth:`profile`."""

    def __init__(self) -> None:
        self._compiles: dict[int, tuple[float, str]] = {}
        # per step with grammar rows: (request ids, oracle cursor before the step, fill s, mask rows,
        # processing ns, rollback calls per row or None, forced tokens per row or None)
        self._steps: list[tuple] = []
        self._rejected: dict[int, int] = {}  # request -> oracle cursor at the step its token was refused
        self._drafts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (request ids, past accepted, valid)
        self._walk_ends: dict[int, int] = {}  # random-walk request -> answer length its grammar ended it at
        self._thought: dict[int, list[int]] = {}  # request -> [thinking tokens accepted, their nanoseconds]
        self._parallel: list[tuple[float, np.ndarray]] = []  # per pooled step: (wall s, the rows' fill s)
        self._pool: ParallelFill | None = None

    def compiled(self, key: int, seconds: float, reason: str | None) -> None:
        self._compiles[key] = (seconds, compile_status(reason))

    def step(self, rids: np.ndarray, cursor: np.ndarray, fill_s: np.ndarray, mask_rows: np.ndarray,
             process_ns: int, rolled: np.ndarray | None, jumped: np.ndarray | None) -> None:
        self._steps.append((rids, cursor, fill_s, mask_rows, process_ns, rolled, jumped))

    def parallel(self, pool: ParallelFill, wall_s: float, fill_s: np.ndarray) -> None:
        """A step's fills ran on ``pool``, taking ``wall_s`` in all; ``fill_s``: each row's own fill."""
        self._pool = pool
        self._parallel.append((wall_s, fill_s))

    def rejected(self, rids: np.ndarray, cursor: np.ndarray) -> None:
        """Requests ``rids`` whose sampled token the grammar refused, at oracle index ``cursor``."""
        for r, c in zip(rids.tolist(), cursor.tolist()):
            self._rejected.setdefault(r, c)

    def drafts(self, rids: np.ndarray, proposed: np.ndarray, accepted: np.ndarray, valid: np.ndarray) -> None:
        """Drafted rows of requests ``rids``: drafts proposed, accepted by the target, and taken by the grammar."""
        self._drafts.append((np.asarray(rids), np.asarray(proposed) - accepted, np.asarray(valid) - accepted))

    def walk_ended(self, rid: int, length: int) -> None:
        """Random walk ``rid``'s grammar terminated it after ``length`` answer tokens."""
        self._walk_ends[rid] = length

    def thought(self, rid: int, tokens: int, ns: int) -> None:
        """Request ``rid``'s matcher accepted ``tokens`` thinking tokens in ``ns`` nanoseconds."""
        spent = self._thought.setdefault(rid, [0, 0])
        spent[0] += tokens
        spent[1] += ns

    def profile(self, backend: str, vocab: str, keys: SpecKeys, start: np.ndarray, source: str,
                random_walk: np.ndarray | None = None) -> GrammarProfile:
        """The run's measured costs; ``start[r]``: request ``r``'s oracle cursor at answer position 0;
        ``random_walk[r]``: request ``r`` walked without oracle tokens (default: none did)."""
        def spec_id(k: int) -> str:  # a spec without a corpus id is named by its key's hash
            return keys.spec_ids[k] or spec_key_hash(keys.texts[k])

        compiles = [CompileMeasurement(spec_id(k), keys.kinds[k], status, seconds, key=keys.texts[k])  # type: ignore[arg-type]
                    for k, (seconds, status) in sorted(self._compiles.items())]
        parallel = None
        pool = self._pool
        if pool is not None:
            wall = sum(wall for wall, _ in self._parallel)
            makespan = sum(parallel_makespan(fills, pool.chunk, pool.threads) for _, fills in self._parallel)
            if wall > 0 and makespan > 0:
                parallel = ParallelFillProfile(steps=len(self._parallel), threads=pool.threads, chunk=pool.chunk,
                                               wall_s=wall, makespan_s=makespan)
        found = {"engine_version": backend_version(backend),
                 "spec_contents": {spec_key_hash(keys.texts[k]): spec_hash(original_of_copy(keys.specs[k]))
                                   for k in self._compiles}}
        if not self._steps:
            return GrammarProfile.from_measurements(backend, vocab, compiles, [], source=source,
                                                    parallel_fill=parallel).model_copy(update=found)
        rids = np.concatenate([s[0] for s in self._steps])
        positions = np.concatenate([s[1] for s in self._steps]) - start[rids]
        fill_s = np.concatenate([s[2] for s in self._steps])
        mask_rows = np.concatenate([s[3] for s in self._steps])
        zeros = [np.zeros(len(s[0]), np.int64) for s in self._steps]
        rolled = np.concatenate([z if s[5] is None else s[5] for s, z in zip(self._steps, zeros)])
        jumped = np.concatenate([z if s[6] is None else s[6] for s, z in zip(self._steps, zeros)])
        step_of = np.repeat(np.arange(len(self._steps)), [len(s[0]) for s in self._steps])
        process_ns = np.array([s[4] for s in self._steps], np.float64)
        calls = np.bincount(step_of, weights=1 + jumped, minlength=len(self._steps))
        rollbacks = np.bincount(step_of, weights=rolled > 0, minlength=len(self._steps))
        clean = rollbacks == 0
        per_accept = np.where(clean, process_ns / calls, np.nan) * 1e-9
        accept_mean = float(np.nanmean(per_accept)) if clean.any() else 0.0
        with np.errstate(divide="ignore", invalid="ignore"):
            per_rollback = np.maximum(process_ns * 1e-9 - accept_mean * calls, 0.0) / rollbacks
        row_accept = per_accept[step_of]
        # each draft row's accept leaves the fill (model mode charges it apart); a draft that ends the
        # answer is accepted without a row of its own, so at most one accept per request stays in
        fills = np.maximum(fill_s - (mask_rows - 1) * accept_mean, 0.0) / mask_rows
        row_rollback = np.where(rolled > 0, per_rollback[step_of], np.nan)

        drafted = {}
        if self._drafts:
            d_rid, d_past, d_valid = (np.concatenate(c) for c in zip(*self._drafts))
            d_order = np.argsort(d_rid, kind="stable")
            d_rid, d_past, d_valid = d_rid[d_order], d_past[d_order], d_valid[d_order]
            d_bounds = np.flatnonzero(np.diff(d_rid)) + 1
            for part in np.split(np.arange(len(d_rid)), d_bounds):
                drafted[int(d_rid[part[0]])] = (d_past[part], d_valid[part])
        no_drafts = (np.zeros(0, np.int64), np.zeros(0, np.int64))

        order = np.lexsort((positions, rids))  # each request's rows in answer order
        rids, positions, fills = rids[order], positions[order], fills[order]
        row_accept, row_rollback, jumped = row_accept[order], row_rollback[order], jumped[order]
        bounds = np.flatnonzero(np.diff(rids)) + 1
        walks = []
        for part in np.split(np.arange(len(rids)), bounds):
            r = int(rids[part[0]])
            k = int(keys.request_key[r])
            accept, rollback = row_accept[part], row_rollback[part]
            refused = self._rejected.get(r)
            past, valid = drafted.get(r, no_drafts)
            tokens, ns = self._thought.get(r, (0, 0))
            walks.append(WalkMeasurement(spec_id(k), keys.kinds[k], fill_s=fills[part],
                                         accept_s=accept[~np.isnan(accept)], rollback_s=rollback[~np.isnan(rollback)],
                                         forced_tokens=jumped[part], positions=positions[part], key=keys.texts[k],
                                         rejected_at=None if refused is None else int(refused - start[r]),
                                         drafts_past=past, valid_past=valid,
                                         random_walk=bool(random_walk is not None and random_walk[r]),
                                         ended_at=self._walk_ends.get(r), think_tokens=tokens, think_s=ns * 1e-9,
                                         instance=keys.request_instance[r] if keys.request_instance else None))
        return GrammarProfile.from_measurements(backend, vocab, compiles, walks, source=source,
                                                parallel_fill=parallel).model_copy(update=found)

