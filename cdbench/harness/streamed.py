"""The summary of a run whose records went to disk as it ran, computed from their columns chunk by chunk.

:func:`summarize_streamed` gives the same :class:`~cdbench.harness.metrics.Summary`, value for value, as
:func:`~cdbench.harness.metrics.summarize` of the whole tables held in memory, while holding only a
chunk of them (and the candidates of a quantile, :data:`SELECT_LIMIT` at most) at a time:

* sums and means follow numpy's pairwise summation exactly: its split points depend only on the count,
  so the chunks are regrouped into the same leaves (:func:`pairwise_sum`), each summed by numpy itself;
* quantiles are exact order statistics, found by radix selection over the values' bit patterns
  (:func:`order_statistics`: a pass a 16 bits of the key until a value's candidates fit in memory), then
  interpolated as ``numpy.percentile`` and ``numpy.median`` do (:func:`percentiles`, :func:`median`);
* counts, minima and maxima are exact in any order.

Each statistic reads its columns afresh (a pass over the table), so a summary costs a few dozen passes
over a few columns: seconds for ten million requests.

>>> values = np.random.default_rng(0).lognormal(size=100_003)
>>> column = Column(_Chunks(values, 7_919), "t", ("v",), lambda chunk: chunk["v"].to_numpy())
>>> n = count(column)
>>> bool(pairwise_sum(column, n) == values.sum()), percentiles(column, n, (90, 99)) == list(np.percentile(values, [90, 99]))
(True, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pandas as pd

from cdbench.harness.metrics import (
    SLO,
    LogHistogram,
    Summary,
    draft_position_fields,
    latency_fields,
)
from cdbench.harness.records import DraftPositionCounts
from cdbench.harness.windows import COLUMNS as WINDOW_COLUMNS
from cdbench.harness.windows import (
    WindowTally,
    latencies,
    slo_limits,
    window_length,
    within,
)

LEAF = 1 << 16
"""Values summed by one numpy call: a node of numpy's pairwise tree of at most this many values."""

SELECT_LIMIT = 1 << 22
"""Candidates of an order statistic held at once (32 MiB of float64); more are narrowed by another pass."""


class TableSource(Protocol):
    """Where a run's records were streamed (:class:`cdbench.results.stopped_run.RecordSpill`)."""

    def chunks(self, table: str, columns: Sequence[str]) -> Iterator[pd.DataFrame]:
        """``columns`` of ``table`` (``requests`` or ``steps``) in row order, a chunk at a time."""


@dataclass(frozen=True)
class Column:
    """A derived column of a streamed table: ``derive`` turns a chunk of ``columns`` into its values
    (rows it filters out dropped); each iteration reads the table again."""

    source: TableSource
    table: str
    columns: tuple[str, ...]
    derive: Callable[[pd.DataFrame], np.ndarray]

    def __iter__(self) -> Iterator[np.ndarray]:
        for chunk in self.source.chunks(self.table, self.columns):
            yield np.asarray(self.derive(chunk))


class _Chunks:
    """An in-memory array as a table of chunks (the docstring's example and the tests)."""

    def __init__(self, values: np.ndarray, size: int) -> None:
        self.values, self.size = values, size

    def chunks(self, table: str, columns: Sequence[str]) -> Iterator[pd.DataFrame]:
        for start in range(0, len(self.values), self.size):
            yield pd.DataFrame({columns[0]: self.values[start:start + self.size]})


def count(column: Column) -> int:
    return sum(len(values) for values in column)


class _Reader:
    """The concatenated values of a column, taken in consecutive runs of a given length."""

    def __init__(self, chunks: Iterator[np.ndarray]) -> None:
        self._chunks, self._head = chunks, np.zeros(0)

    def take(self, n: int) -> np.ndarray:
        parts, have = [], 0
        while have < n:
            if not len(self._head):
                self._head = next(self._chunks)
                continue
            part, self._head = self._head[:n - have], self._head[n - have:]
            parts.append(part)
            have += len(part)
        return np.concatenate(parts) if len(parts) != 1 else parts[0].copy()


def _leaves(n: int, out: list[int]) -> list[int]:
    """The leaf sizes of numpy's pairwise summation of ``n`` values, cut at :data:`LEAF`, left to right."""
    if n <= LEAF:
        out.append(n)
    else:
        half = n // 2
        half -= half % 8  # numpy's split (``pairwise_sum`` in its loops): a multiple of 8
        _leaves(half, out)
        _leaves(n - half, out)
    return out


def _join(n: int, sums: Iterator[np.float64]) -> np.float64:
    if n <= LEAF:
        return next(sums)
    half = n // 2
    half -= half % 8
    return _join(half, sums) + _join(n - half, sums)


def pairwise_sum(column: Column, n: int, transform: Callable[[np.ndarray], np.ndarray] | None = None) -> np.float64:
    """``numpy.add.reduce`` of the column's ``n`` float64 values (each ``transform``-ed first), bit for bit."""
    reader = _Reader(iter(column))
    sums = []
    for size in _leaves(n, []):
        part = reader.take(size).astype(np.float64, copy=False)
        sums.append(np.add.reduce(transform(part) if transform is not None else part))
    return _join(n, iter(sums))


def _keys(values: np.ndarray) -> np.ndarray:
    """Unsigned keys that sort as the float64 ``values`` do (NaN excluded)."""
    bits = np.ascontiguousarray(values, np.float64).view(np.uint64)
    return np.where(bits >> np.uint64(63), ~bits, bits | np.uint64(1 << 63))


def _value(key: int) -> float:
    bits = key & ~(1 << 63) if key >> 63 else ~key & ((1 << 64) - 1)
    return float(np.array([bits], np.uint64).view(np.float64)[0])


def order_statistics(column: Column, n: int, ranks: Sequence[int]) -> dict[int, float]:
    """The values of 0-based ``ranks`` in the sorted column of ``n`` values (no NaN), exactly.

    Radix selection: each pass narrows every pending rank to the values whose key starts as its
    order statistic's does (16 more bits a pass), until those candidates number at most
    :data:`SELECT_LIMIT`; they are then collected and partitioned.
    """
    found: dict[int, float] = {}
    # rank -> (bits of the key known, that prefix, rank among the values with that prefix, how many have it)
    pending = {r: (0, 0, r, n) for r in sorted(set(ranks))}
    while pending:
        groups: dict[tuple[int, int], list[int]] = {}
        for r, (depth, prefix, _, _) in pending.items():
            groups.setdefault((depth, prefix), []).append(r)
        collect = {g for g in groups if pending[groups[g][0]][3] <= SELECT_LIMIT or g[0] == 64}
        hists = {g: np.zeros(1 << 16, np.int64) for g in groups if g not in collect}
        kept: dict[tuple[int, int], list[np.ndarray]] = {g: [] for g in collect}
        for values in column:
            keys = _keys(values)
            for depth, prefix in groups:
                mine = keys if depth == 0 else keys[(keys >> np.uint64(64 - depth)) == np.uint64(prefix)]
                if (depth, prefix) in collect:
                    kept[(depth, prefix)].append(mine)
                else:
                    digit = (mine >> np.uint64(48 - depth)) & np.uint64(0xFFFF)
                    hists[(depth, prefix)] += np.bincount(digit.astype(np.int64), minlength=1 << 16)
        for g, rs in groups.items():
            depth, prefix = g
            if g in collect:
                keys = np.concatenate(kept[g]) if kept[g] else np.zeros(0, np.uint64)
                inner = sorted({pending[r][2] for r in rs})
                keys.partition(inner)
                for r in rs:
                    found[r] = _value(int(keys[pending[r][2]]))
                    del pending[r]
                continue
            cum = np.cumsum(hists[g])
            for r in rs:
                within = pending[r][2]
                digit = int(np.searchsorted(cum, within, side="right"))
                before = int(cum[digit - 1]) if digit else 0
                pending[r] = (depth + 16, (prefix << 16) | digit, within - before, int(hists[g][digit]))
    return found


def percentiles(column: Column, n: int, qs: Sequence[float]) -> list[float]:
    """``numpy.percentile(values, qs)`` (linear interpolation) of the column's ``n`` values, bit for bit."""
    virtual = (n - 1) * np.true_divide(np.asanyarray(qs), 100)
    below = np.floor(virtual)
    top = virtual >= n - 1
    prev = np.where(top, n - 1, below).astype(np.intp)
    nxt = np.where(top, n - 1, below + 1).astype(np.intp)
    stats = order_statistics(column, n, [*prev.tolist(), *nxt.tolist()])
    out = []
    for i, t in enumerate((virtual - np.where(top, -1, below)).tolist()):
        a, b = np.float64(stats[int(prev[i])]), np.float64(stats[int(nxt[i])])
        diff = b - a
        t = np.float64(t)
        out.append(float(b - diff * (1 - t) if t >= 0.5 else a + diff * t))  # numpy's _lerp
    return out


def median(column: Column, n: int) -> float:
    """``numpy.median`` of the column's ``n`` values (no NaN), bit for bit."""
    half = n // 2
    if n % 2:
        return order_statistics(column, n, [half])[half]
    stats = order_statistics(column, n, [half - 1, half])
    return float(np.mean(np.array([stats[half - 1], stats[half]])))


def _stats_ms(column: Column) -> tuple[float, float, float, float, float]:
    """:func:`cdbench.harness.metrics._stats_ms` of a streamed column: mean, median, std, p90, p99 in ms."""
    ms = Column(column.source, column.table, column.columns,
                lambda chunk: (lambda v: v[~np.isnan(v)] * 1e3)(np.asarray(column.derive(chunk), np.float64)))
    n = count(ms)
    if n == 0:
        return (math.nan,) * 5
    mean = pairwise_sum(ms, n) / n
    # numpy's var: the deviations from the mean, squared, summed pairwise
    std = np.sqrt(pairwise_sum(ms, n, lambda v: (lambda x: np.multiply(x, x, out=x))(v - mean)) / n)
    p90, p99 = percentiles(ms, n, (90, 99))
    return float(mean), median(ms, n), float(std), p90, p99


def _frame_sum(column: Column) -> float:
    """A pandas ``Series.sum`` of a float column (NaN skipped as pandas does, by counting it as 0)."""
    zeroed = Column(column.source, column.table, column.columns,
                    lambda chunk: np.nan_to_num(np.asarray(column.derive(chunk), np.float64), nan=0.0))
    return float(pairwise_sum(zeroed, count(zeroed)))


def summarize_streamed(source: TableSource, itl: LogHistogram, mask_rows: LogHistogram, slo: SLO | None = None,
                       idle_iterations: int | None = None,
                       draft_positions: DraftPositionCounts | None = None, kv_capacity: int | None = None,
                       kv_policy: str = "unbounded") -> Summary:
    """:func:`~cdbench.harness.metrics.summarize` of the tables in ``source``, reading them in chunks."""

    def col(table: str, columns: tuple[str, ...], derive: Callable[[pd.DataFrame], np.ndarray]) -> Column:
        return Column(source, table, columns, derive)

    def ok_of(chunk: pd.DataFrame) -> np.ndarray:
        return (chunk["abort_reason"] == "").to_numpy()

    def done(chunk: pd.DataFrame) -> pd.DataFrame:
        return chunk[ok_of(chunk)]

    def tally(table: str, columns: tuple[str, ...], fold: Callable[[pd.DataFrame], list[int]], size: int) -> list[int]:
        """Exact integer tallies over the table: the sum of ``fold`` (``size`` counts) over its chunks."""
        total = np.zeros(size, np.int64)
        for chunk in source.chunks(table, columns):
            total += np.asarray(fold(chunk), np.int64)
        return [int(x) for x in total]

    # requests: counts and integer sums, exact in any order
    reasons: dict[str, int] = {}
    for chunk in source.chunks("requests", ("abort_reason",)):
        for reason, n in chunk.loc[~ok_of(chunk), "abort_reason"].astype(str).value_counts(sort=False).items():
            reasons[reason] = reasons.get(reason, 0) + int(n)
    goodput_limits, has_slo = slo_limits(slo)
    (rows, completed, prompt_tokens, output_tokens, structured_n, hits, inflight, misses, drafted, accepted, rolled,
     jumped, forced, validated, valid_true, good) = tally(
        "requests", ("abort_reason", "prompt_len", "output_tokens", "structured", "cache", "drafted", "accepted",
                     "rolled_back", "jump_forward_tokens", "forced_think_end", "valid", "issued_s", "first_token_s",
                     "finish_s"),
        lambda c: _request_tallies(c, ok_of(c), goodput_limits, has_slo), 16)
    if rows == 0:
        issued_min = finish_max = math.nan
    else:
        finish_max = max(float(np.nanmax(v)) if len(v) and not np.isnan(v).all() else -math.inf
                         for v in col("requests", ("finish_s",), lambda c: c["finish_s"].to_numpy()))
        issued_min = min(float(np.nanmin(v)) if len(v) and not np.isnan(v).all() else math.inf
                         for v in col("requests", ("issued_s",), lambda c: c["issued_s"].to_numpy()))
    duration = float(finish_max - issued_min) if rows and completed else 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)

    ttft = col("requests", ("abort_reason", "first_token_s", "issued_s"),
               lambda c: (lambda d: (d["first_token_s"] - d["issued_s"]).to_numpy())(done(c)))
    e2el = col("requests", ("abort_reason", "finish_s", "issued_s"),
               lambda c: (lambda d: (d["finish_s"] - d["issued_s"]).to_numpy())(done(c)))
    tpot = col("requests", ("abort_reason", "finish_s", "issued_s", "first_token_s", "output_tokens"),
               lambda c: latencies(done(c))[2])
    wait = col("requests", ("structured", "grammar_ready_s", "issued_s"),
               lambda c: (lambda s: (s["grammar_ready_s"] - s["issued_s"]).to_numpy())(c[c["structured"].to_numpy()]))
    compile_s = col("requests", ("structured", "cache", "compile_end_s", "compile_start_s"),
                    lambda c: (lambda m: (m["compile_end_s"] - m["compile_start_s"]).to_numpy())(
                        c[c["structured"].to_numpy() & (c["cache"] == "miss").to_numpy()]))
    skew = col("requests", ("structured", "rank_skew_s"),
               lambda c: (lambda v: v[~np.isnan(v)])(c.loc[c["structured"].to_numpy(), "rank_skew_s"].to_numpy()))
    n_skew = count(skew)
    skew_mean = float(pairwise_sum(skew, n_skew) / n_skew * 1e3) if n_skew else 0.0
    skew_max = max((float(v.max()) for v in skew if len(v)), default=0.0) * 1e3 if n_skew else 0.0

    # steps
    n_steps, n_busy, contended, idle_rows = tally(
        "steps", ("kind", "contention"),
        lambda c: (lambda busy: [len(c), busy.sum(), (c["contention"].to_numpy()[busy] > 1.0).sum(), (~busy).sum()])(
            (c["kind"] != "idle").to_numpy()), 4)

    def step_sum(*names: str) -> float:
        return _frame_sum(col("steps", names, lambda c: c[names[0]].to_numpy())) if n_steps else 0.0
    total_step = step_sum("duration_s")
    mask_time = _frame_sum(col("steps", ("fill_s", "copy_s", "apply_s"),
                               lambda c: (c["fill_s"] + c["copy_s"] + c["apply_s"]).to_numpy())) if n_steps else 0.0

    def share(*names: str) -> float:
        return float(sum(step_sum(name) for name in names)) / total_step if total_step else 0.0

    if n_busy:  # pandas' mean: NaN counted as 0 in the sum and left out of the count
        contention = col("steps", ("kind", "contention"),
                         lambda c: c.loc[(c["kind"] != "idle").to_numpy(), "contention"].to_numpy())
        counted = count(Column(source, "steps", contention.columns,
                               lambda c: (lambda v: v[~np.isnan(v)])(contention.derive(c))))
        mean_contention = float(_frame_sum(contention) / counted)
    else:
        mean_contention = 1.0

    windows = None
    if rows and not math.isnan(issued_min):
        last_issue = max(float(np.nanmax(v)) for v in col("requests", ("issued_s",), lambda c: c["issued_s"].to_numpy())
                         if len(v) and not np.isnan(v).all())
        tally_w = WindowTally(window_length(last_issue), goodput_limits, has_slo)
        for chunk in source.chunks("requests", WINDOW_COLUMNS):
            tally_w.add(chunk)
        windows = tally_w.result()
    return Summary(
        duration=duration,
        completed=int(completed),
        failed=int(rows - completed),
        total_input_tokens=int(prompt_tokens),
        total_output_tokens=int(output_tokens),
        request_throughput=per_s(float(completed)),
        request_goodput=per_s(float(good)) if slo is not None else None,
        output_throughput=per_s(float(output_tokens)),
        total_token_throughput=per_s(float(output_tokens + prompt_tokens)),
        **latency_fields(*(_stats_ms(x) for x in (ttft, tpot, e2el)), itl, _stats_ms(wait), _stats_ms(compile_s)),
        structured_requests=int(structured_n),
        aborts_by_reason={k: v for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]) if v},
        compiles=int(misses),
        cache_hit_rate=int(hits) / int(structured_n) if structured_n else math.nan,
        inflight_shared=int(inflight),
        drafted_tokens=int(drafted),
        accepted_tokens=int(accepted),
        rolled_back_tokens=int(rolled),
        rollback_rate=int(rolled) / int(drafted) if drafted else 0.0,
        **draft_position_fields(draft_positions),
        jump_forward_tokens=int(jumped),
        forced_think_ends=int(forced),
        validity_rate=int(valid_true) / int(validated) if validated else None,
        validated=int(validated),
        mean_rank_skew_ms=skew_mean,
        max_rank_skew_ms=skew_max,
        mask_share=mask_time / total_step if total_step else 0.0,
        mask_row_p50_us=mask_rows.quantile(0.5) * 1e6,
        mask_row_p99_us=mask_rows.quantile(0.99) * 1e6,
        mask_row_p999_us=mask_rows.quantile(0.999) * 1e6,
        cpu_exposed_s=step_sum("exposed_cpu_s"),
        cpu_hidden_by_overlap_s=step_sum("hidden_cpu_s"),
        host_schedule_share=share("schedule_s", "poll_s", "sync_s", "check_s"),
        host_grammar_share=share("fill_s"),
        host_transfer_share=share("transfer_s"),
        host_process_share=share("process_s"),
        gpu_share=share("forward_s", "apply_s", "sample_s"),
        mean_contention=mean_contention,
        contended_step_share=contended / n_busy if n_busy else 0.0,
        steps=n_busy,
        idle_iterations=idle_iterations if idle_iterations is not None else idle_rows,
        time_windows=windows,
        **_kv_fields(source, total_step, kv_capacity, kv_policy),
    )


def _kv_fields(source: TableSource, total_step: float, capacity: int | None, policy: str) -> dict[str, object]:
    """:func:`cdbench.harness.metrics._kv_fields` of streamed tables (its defaults when the cache is not modelled)."""
    if capacity is None:
        return {}
    evicted, preempted, recomputed = (0, 0, 0)
    for chunk in source.chunks("requests", ("preemptions", "recomputed_tokens")):
        evicted += int(chunk["preemptions"].sum())
        preempted += int((chunk["preemptions"] > 0).sum())
        recomputed += int(chunk["recomputed_tokens"].sum())
    used = Column(source, "steps", ("kv_tokens",), lambda c: c["kv_tokens"].to_numpy() / capacity)
    busy = Column(source, "steps", ("kv_tokens", "duration_s"),
                  lambda c: c["kv_tokens"].to_numpy() / capacity * c["duration_s"].to_numpy())
    wait = Column(source, "requests", ("kv_wait_s",), lambda c: c["kv_wait_s"].to_numpy() * 1e3)
    n_steps, n_wait = count(used), count(wait)
    return dict(
        kv_capacity_tokens=capacity,
        kv_preemptions=evicted if policy != "sglang" else 0,
        kv_retractions=evicted if policy == "sglang" else 0,
        kv_preempted_requests=preempted,
        kv_recomputed_tokens=recomputed,
        kv_mean_utilization=float(pairwise_sum(busy, n_steps) / total_step) if total_step else 0.0,
        kv_peak_utilization=max((float(v.max()) for v in used if len(v)), default=0.0),
        mean_kv_wait_ms=float(pairwise_sum(wait, n_wait) / n_wait) if n_wait else 0.0,
        p99_kv_wait_ms=percentiles(wait, n_wait, (99,))[0] if n_wait else 0.0,
    )


def _request_tallies(c: pd.DataFrame, ok: np.ndarray, limits: tuple[float | None, float | None, float | None],
                     has_slo: bool) -> list[int]:
    """One chunk's exact counts and integer sums for :func:`summarize_streamed` (in its unpacking order)."""
    structured = c["structured"].to_numpy(bool)
    cache = c["cache"].astype(str).to_numpy()
    valid = c["valid"]
    good = 0
    if has_slo:
        ttft, e2el, tpot = latencies(c[ok])
        good = int(within(ttft, tpot, e2el, limits).sum())
    return [len(c), int(ok.sum()), int(c.loc[ok, "prompt_len"].sum()), int(c.loc[ok, "output_tokens"].sum()),
            int(structured.sum()), int((structured & (cache == "hit")).sum()),
            int((structured & (cache == "inflight")).sum()), int((structured & (cache == "miss")).sum()),
            int(c["drafted"].sum()), int(c["accepted"].sum()), int(c["rolled_back"].sum()),
            int(c["jump_forward_tokens"].sum()), int(c["forced_think_end"].sum()), int(valid.notna().sum()),
            int(valid.fillna(False).astype(bool).sum()), good]
