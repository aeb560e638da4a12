"""What a run records: one row per request and one row per scheduler iteration.

Records are columnar (numpy arrays filled in place while the loop runs) and
become pandas DataFrames at the end; :class:`RequestRecord` and
:class:`StepRecord` document the columns and give typed access to one row.
:meth:`RequestTable.clear` makes rows free for the next requests, so a scheduler can keep
its requests in slots reused as they end (``harness/scheduler.py`` hands their rows out first).
Times are seconds of virtual time; ``NaN`` means "did not happen".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from cdbench.workloads.request import Request

ABORT_REASONS = ("", "compile_error", "grammar_timeout", "cached_invalid", "grammar_rejected", "kv_capacity")
CACHE_RESULTS = ("", "miss", "hit", "inflight")  # "" for an unconstrained request
STEP_KINDS = ("idle", "decode", "prefill", "mixed")
_KIND_CODES = {kind: code for code, kind in enumerate(STEP_KINDS)}  # (a step log's categorical kinds)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's outcome (a row of ``requests.parquet``).

    Attributes
    ----------
    request_id : the workload's id.
    arrival_s : when the workload meant it to arrive.
    issued_s : when it reached the engine (later than ``arrival_s`` only
        under a closed loop's concurrency limit); latencies count from here.
    prompt_len, output_len : prompt tokens; answer tokens (EOS included).
    think_tokens : tokens of the thinking phase, think-end included (0: none).
    structured : carries a constraint.
    spec_key : index of its distinct spec (-1 unconstrained).
    cache : ``miss``, ``hit`` or ``inflight`` (shared a running compile); ``""`` unconstrained.
    compile_start_s, compile_end_s : its compile (earliest start, latest end
        over ranks; for ``inflight`` the shared compile's end).
    grammar_ready_s : when the scheduler released it as ready to run.
    rank_skew_s : latest minus earliest rank compile end.
    admitted_s, first_token_s, finish_s : entered the batch; first output token; done or aborted.
    output_tokens : tokens emitted (thinking included).
    drafted, accepted, rolled_back : draft tokens proposed, accepted by the
        target, and rolled back in the grammar (rejected drafts of grammar rows).
    jump_forward_tokens : tokens emitted by jump-forward without a forward step.
    forced_think_end : the thinking budget cut thinking short.
    abort_reason : ``""`` or one of :data:`ABORT_REASONS` (``kv_capacity``: its context can never fit
        the KV cache).
    valid : output checked against its spec (hybrid); ``None`` when not checked.
    preemptions : times the KV cache ran out under it: preempted (vLLM) or retracted (SGLang)
        (:mod:`cdbench.harness.kv_cache`).
    recomputed_tokens : cached tokens it lost to those and computed again.
    kv_wait_s : time it waited for free KV blocks (at the head of admission, or after a preemption).
    """

    request_id: int
    arrival_s: float
    issued_s: float
    prompt_len: int
    output_len: int
    think_tokens: int
    structured: bool
    spec_key: int
    cache: str
    compile_start_s: float
    compile_end_s: float
    grammar_ready_s: float
    rank_skew_s: float
    admitted_s: float
    first_token_s: float
    finish_s: float
    output_tokens: int
    drafted: int
    accepted: int
    rolled_back: int
    jump_forward_tokens: int
    forced_think_end: bool
    abort_reason: str
    valid: bool | None
    preemptions: int = 0
    recomputed_tokens: int = 0
    kv_wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One scheduler iteration (a row of ``steps.parquet``).

    Attributes
    ----------
    start_s, duration_s : the iteration's span.
    kind : ``decode``, ``prefill``, ``mixed`` or ``idle`` (nothing ran; the loop spun).
    rows : rows that sampled; decode_rows : of them, decoding;
    prefill_tokens : prompt tokens run; grammar_rows : sampling rows whose grammar was active;
    mask_rows : bitmask rows built (1 + drafts per grammar row, plus token-filter rows).
    tokens : tokens emitted.
    schedule_s, poll_s, sync_s, check_s : scheduler CPU (batch forming,
        SGLang's blocking poll, the rank all_gather, vLLM's readiness checks).
    forward_s, fill_s, copy_s, apply_s, sample_s, process_s : the parts.
    exposed_cpu_s, hidden_cpu_s : CPU time on the critical path / overlapped with the GPU.
    transfer_s : serializing the bitmask to the sampling worker's process (``mask_transfer="ipc"``).
    launch_s : the host's staging and launch of the forward and its wake-up on the tokens (the
        policy's ``launch_s``; in ``live`` mode the step's measured wall time beyond its timed parts).
    decode_tokens : query tokens of the decode rows (1 + drafts each), before graph padding;
    context_tokens : cached tokens those rows attend to, summed (with ``prefill_tokens``, the step's
        shape as the forward cost model takes it).
    contention : how much longer the step's host CPU work took because compiles and the scheduler loop
        outnumbered the host's cores (:mod:`cdbench.harness.contention`; 1: they did not, or not charged).
    kv_tokens : KV-cache token slots in use during the step (whole blocks; 0 when the cache is not modelled).
    preempted : requests preempted or retracted to make room for the step.
    """

    start_s: float
    duration_s: float
    kind: str
    rows: int
    decode_rows: int
    prefill_tokens: int
    grammar_rows: int
    mask_rows: int
    tokens: int
    schedule_s: float
    poll_s: float
    sync_s: float
    check_s: float
    forward_s: float
    fill_s: float
    copy_s: float
    apply_s: float
    sample_s: float
    process_s: float
    exposed_cpu_s: float
    hidden_cpu_s: float
    transfer_s: float
    launch_s: float
    decode_tokens: int
    context_tokens: int
    contention: float
    kv_tokens: int = 0
    preempted: int = 0


STEP_COLUMNS = tuple(f.name for f in fields(StepRecord))
REQUEST_COLUMNS = tuple(f.name for f in fields(RequestRecord))


class RequestTable:
    """Per-request columns as numpy arrays, written in place by the scheduler."""

    _FLOAT = ("arrival_s", "issued_s", "compile_start_s", "compile_end_s", "grammar_ready_s", "rank_skew_s",
              "admitted_s", "first_token_s", "finish_s")
    _INT = ("request_id", "prompt_len", "output_len", "think_tokens", "spec_key")
    #: the counters a request accumulates while it runs, rows of :attr:`counts` (summed from the steps in bulk)
    COUNTS = ("output_tokens", "drafted", "accepted", "rolled_back", "jump_forward_tokens")
    _KV = ("preemptions", "recomputed_tokens")  # KV-cache counters, kept by cdbench.harness.kv_cache

    def __init__(self, n: int) -> None:
        self.n = n
        for name in self._FLOAT:
            setattr(self, name, np.full(n, np.nan))
        for name in self._INT:
            setattr(self, name, np.zeros(n, np.int64))
        self.counts = np.zeros((len(self.COUNTS), n), np.int64)
        for name, column in zip(self.COUNTS, self.counts):
            setattr(self, name, column)
        self.structured = np.zeros(n, bool)
        self.forced_think_end = np.zeros(n, bool)
        self.cache = np.zeros(n, np.int8)  # index into CACHE_RESULTS
        self.abort = np.zeros(n, np.int8)  # index into ABORT_REASONS
        self.valid = np.full(n, -1, np.int8)  # -1 unchecked, 0 invalid, 1 valid
        for name in self._KV:
            setattr(self, name, np.zeros(n, np.int64))
        self.kv_wait_s = np.zeros(n)

    @classmethod
    def of(cls, requests: Sequence[Request]) -> RequestTable:
        """The table of ``requests`` (in their order) as they enter."""
        table = cls(len(requests))
        table.enter(slice(0, len(requests)), requests)
        return table

    def clear(self, rows: np.ndarray) -> None:
        """Rows ``rows`` as a new table has them (free for other requests)."""
        for name in self._FLOAT:
            getattr(self, name)[rows] = np.nan
        for name in (*self._INT, *self._KV):
            getattr(self, name)[rows] = 0
        self.counts[:, rows] = 0
        self.structured[rows] = False
        self.forced_think_end[rows] = False
        self.cache[rows] = 0
        self.abort[rows] = 0
        self.valid[rows] = -1
        self.kv_wait_s[rows] = 0.0

    def grow(self, n: int) -> None:
        """Room for ``n`` rows (the new ones as a new table has them)."""
        more = RequestTable(n - self.n)
        names = (*self._FLOAT, *self._INT, *self._KV, "structured", "forced_think_end", "cache", "abort", "valid",
                 "kv_wait_s")
        for name in names:
            setattr(self, name, np.concatenate((getattr(self, name), getattr(more, name))))
        self.counts = np.concatenate((self.counts, more.counts), axis=1)
        for name, column in zip(self.COUNTS, self.counts):
            setattr(self, name, column)
        self.n = n

    def enter(self, at: slice | np.ndarray, requests: Sequence[Request]) -> None:
        """Rows ``at`` (a slice or row numbers): ``requests`` as they enter (thinking capped by its budget, + its
        end token)."""
        self.request_id[at] = [r.request_id for r in requests]
        self.arrival_s[at] = [r.arrival_s for r in requests]
        self.prompt_len[at] = [max(1, r.prompt_len) for r in requests]
        self.output_len[at] = [max(1, r.output_len) for r in requests]
        self.structured[at] = [r.structured for r in requests]
        think_len = np.array([r.think_len for r in requests], np.int64)
        budget = np.array([r.thinking_budget if r.thinking_budget is not None else -1 for r in requests], np.int64)
        capped = np.where((budget >= 0) & (think_len > budget), budget, think_len)
        self.think_tokens[at] = np.where(think_len > 0, capped + 1, 0)  # +1: the think-end token
        self.forced_think_end[at] = (think_len > 0) & (budget >= 0) & (think_len > budget)

    def to_frame(self, rows: np.ndarray | None = None) -> pd.DataFrame:
        """The table (or its ``rows``, positions in request order) as a DataFrame."""
        pick = (lambda column: column) if rows is None else (lambda column: column[rows])
        data = {name: pick(getattr(self, name)) for name in REQUEST_COLUMNS
                if name not in ("cache", "abort_reason", "valid")}
        data["cache"] = pd.Categorical.from_codes(pick(self.cache), CACHE_RESULTS)
        data["abort_reason"] = pd.Categorical.from_codes(pick(self.abort), ABORT_REASONS)
        valid = pick(self.valid)
        data["valid"] = pd.array(np.where(valid < 0, None, valid == 1), dtype="boolean")
        return pd.DataFrame(data, columns=list(REQUEST_COLUMNS))

    def finished(self) -> np.ndarray:
        """Positions of the requests that have ended (finished or aborted)."""
        return np.flatnonzero(~np.isnan(self.finish_s))

    def record(self, i: int) -> RequestRecord:
        """Row ``i`` as a typed record."""
        row = self.to_frame().iloc[i].to_dict()
        row["valid"] = None if pd.isna(row["valid"]) else bool(row["valid"])
        return RequestRecord(**row)


class StepLog:
    """Per-iteration rows, appended as tuples in :data:`STEP_COLUMNS` order, and blocks of consecutive rows
    as columns (:meth:`add_block`: a run of steps taken at once); :meth:`take` hands out and drops those
    appended since it was last called (a run streaming its steps to disk)."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self._blocks: list[tuple[int, int, tuple]] = []  # (rows appended before it, its rows, its columns)
        self.taken = 0  # rows handed out by take()

    def add_block(self, k: int, columns: tuple) -> None:
        """``k`` rows after those appended so far, as :data:`STEP_COLUMNS` in order: each an array of ``k``
        values or one value for every row (the arrays must not change until they are taken)."""
        self._blocks.append((len(self.rows), k, columns))

    def __len__(self) -> int:
        return len(self.rows) + sum(k for _, k, _ in self._blocks)

    def to_frame(self) -> pd.DataFrame:
        if self._blocks:
            return self._with_blocks()
        frame = pd.DataFrame.from_records(self.rows, columns=list(STEP_COLUMNS))
        frame["kind"] = pd.Categorical(frame["kind"], categories=list(STEP_KINDS))
        return frame

    def _with_blocks(self) -> pd.DataFrame:
        """The frame of the rows and the blocks in the order they were appended, each column of the type the
        rows as tuples would give it (integers, or floats where any value is one): the rows' columns converted
        as numpy converts a sequence of Python numbers (as pandas' records do), ``kind`` made from its codes."""
        rows, blocks = self.rows, self._blocks
        n_blocks = len(blocks)
        at = np.fromiter((before for before, _, _ in blocks), np.int64, n_blocks)
        lengths = np.fromiter((k for _, k, _ in blocks), np.int64, n_blocks)
        ends = np.cumsum(lengths)
        total = len(rows) + int(ends[-1])
        # row i follows the blocks appended before it (those with at <= i) and the rows before it
        row_at = np.arange(len(rows))
        row_at += np.concatenate(([0], ends))[at.searchsorted(row_at, "right")]
        in_block = np.ones(total, bool)
        in_block[row_at] = False
        block_at = in_block.nonzero()[0]
        by_row = list(zip(*rows)) if rows else None
        columns = {}
        for i, (name, values) in enumerate(zip(STEP_COLUMNS, zip(*(columns_of for _, _, columns_of in blocks)))):
            if name == "kind":  # (as the rows' kinds made categorical: a kind not among them is missing)
                codes = np.repeat(np.array([_KIND_CODES.get(v, -1) for v in values], np.int8), lengths)
                if by_row is not None:
                    out = np.empty(total, np.int8)
                    out[row_at] = [_KIND_CODES.get(v, -1) for v in by_row[i]]
                    out[block_at] = codes
                    codes = out
                columns[name] = pd.Categorical.from_codes(codes, categories=list(STEP_KINDS))
                continue
            block = _block_column(values, lengths)
            if by_row is None:
                columns[name] = block
                continue
            of_rows = np.array(by_row[i])
            out = np.empty(total, np.result_type(of_rows.dtype, block.dtype))
            out[row_at] = of_rows
            out[block_at] = block
            columns[name] = out
        return pd.DataFrame(columns)

    def take(self) -> pd.DataFrame:
        """The rows appended since the last call, no longer kept here."""
        frame = self.to_frame()
        self.taken += len(frame)
        self.rows = []
        self._blocks = []
        return frame


def _block_column(values: Sequence, lengths: np.ndarray) -> np.ndarray:
    """One numeric column of blocks of ``lengths`` rows, each block's ``values`` an array or one value for all its
    rows."""
    arrays = [type(v) is np.ndarray for v in values]
    if all(arrays):
        return np.concatenate(values)
    one = np.array([0 if is_array else v for v, is_array in zip(values, arrays)])
    if not any(arrays):
        return np.repeat(one, lengths)
    given = [v for v, is_array in zip(values, arrays) if is_array]
    dtype = np.result_type(one.dtype, *{v.dtype for v in given})
    out = np.repeat(one.astype(dtype), lengths)
    out[np.repeat(np.array(arrays), lengths)] = np.concatenate(given)  # (one write, not one a block)
    return out


class DraftPositionCounts:
    """Speculative-decoding outcomes by draft position (position 1 is the first draft after the sampled token).

    Each step adds, per sampling row, its verified drafts ``d``, drafts the
    target accepted ``a`` (positions ``1..a``) and drafts rolled back in the
    grammar ``r`` (positions ``a+1..a+r``). Counting ``d``, ``a`` and ``a + r``
    per step (three bincounts) is enough to recover the per-position totals.

    >>> counts = DraftPositionCounts(3)
    >>> counts.add(np.array([3, 3, 0]), np.array([1, 3, 0]), np.array([2, 0, 0]))
    >>> counts.drafted().tolist(), counts.accepted().tolist(), counts.rolled_back().tolist()
    ([2, 2, 2], [2, 1, 1], [0, 1, 1])
    """

    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self.rows = 0
        self._drafted = np.zeros(max_drafts + 1, np.int64)  # rows by verified drafts
        self._accepted = np.zeros(max_drafts + 1, np.int64)  # rows by accepted drafts
        self._rolled_end = np.zeros(max_drafts + 1, np.int64)  # rows by last rolled-back position

    def merge(self, other: DraftPositionCounts) -> None:
        """Count ``other``'s rows too (the records of several ranks)."""
        if other.max_drafts != self.max_drafts:
            raise ValueError(f"draft counts of {other.max_drafts} positions cannot join {self.max_drafts}")
        self.rows += other.rows
        self._drafted += other._drafted
        self._accepted += other._accepted
        self._rolled_end += other._rolled_end

    def add(self, drafted: np.ndarray, accepted: np.ndarray, rolled_back: np.ndarray) -> None:
        """Count one step's rows (parallel arrays of per-row counts)."""
        size = self.max_drafts + 1
        self.rows += len(drafted)
        self._drafted += np.bincount(drafted, minlength=size)
        self._accepted += np.bincount(accepted, minlength=size)
        self._rolled_end += np.bincount(accepted + rolled_back, minlength=size)

    def _at_least(self, by_count: np.ndarray) -> np.ndarray:
        """Rows whose count reaches each position 1..max_drafts."""
        return self.rows - np.cumsum(by_count)[:-1]

    def drafted(self) -> np.ndarray:
        """Drafts verified at each position."""
        return self._at_least(self._drafted)

    def accepted(self) -> np.ndarray:
        """Drafts the target accepted at each position."""
        return self._at_least(self._accepted)

    def rolled_back(self) -> np.ndarray:
        """Drafts rolled back in the grammar at each position."""
        return self._at_least(self._rolled_end) - self.accepted()
