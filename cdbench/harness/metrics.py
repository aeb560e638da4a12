"""The run summary: vLLM's serving-benchmark metrics plus constrained-decoding ones.

Definitions follow vLLM's ``benchmark_serving``: TTFT = first token − issue,
TPOT = (E2E − TTFT) / (output tokens − 1), ITL = gaps between successive
outputs of a request (a speculative step's tokens arrive together), E2EL =
finish − issue; throughputs divide by the span from the first issue to the
last finish. Field names match its JSON output where one exists.

Per-token quantities (ITL, per-row mask time) are kept in a
:class:`LogHistogram` instead of per-token records; its quantiles are exact to
the bin width (about 1.2 %).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from cdbench.harness.costs.forward_speed import ForwardSpeed
from cdbench.harness.costs.spec_costs import SpecCoverage
from cdbench.harness.records import DraftPositionCounts
from cdbench.harness.windows import TimeWindows, latencies

_sum = np.add.reduce


class LogHistogram:
    """A fixed log-spaced histogram of positive seconds (100 ns to 10⁴ s, 200 bins a decade).

    >>> h = LogHistogram()
    >>> h.add(np.array([0.001, 0.002, 0.003]))
    >>> round(h.quantile(0.5) * 1e3, 1), h.mean()
    (2.0, 0.002)
    """

    LOW, DECADES, PER_DECADE = -7, 11, 200

    BUFFER = 1 << 16  # values buffered before they are binned (binning in bulk is cheaper)

    def __init__(self) -> None:
        self.counts = np.zeros(self.DECADES * self.PER_DECADE + 1)
        self.total = 0.0
        self.weight = 0.0
        self.sq_total = 0.0
        self._plain: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self._weights: list[np.ndarray] = []
        self._buffered = 0
        self._scratch = np.empty((3, 0))  # the buffered values, then temporaries, written in place when binned
        self._bin_scratch = np.empty(0, np.int64)  # and their bins

    def _scratch_rows(self, n: int) -> np.ndarray:
        """Three rows of ``n`` values to bin in, kept between flushes: arrays made anew each flush would be
        given back to the system and faulted in again where nothing else holds the heap (a run of bounded
        memory), which costs more than the binning."""
        if self._scratch.shape[1] < n:
            self._scratch = np.empty((3, max(n, 2 * self._scratch.shape[1])))
            self._bin_scratch = np.empty(self._scratch.shape[1], np.int64)
        return self._scratch[:, :n]

    def add(self, values: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Count ``values`` (seconds), each ``weights`` times (default once)."""
        if weights is None:
            self._plain.append(values)
        else:
            self._values.append(values)
            self._weights.append(weights)
        self._buffered += len(values)
        if self._buffered >= self.BUFFER:
            self._flush()

    def add_steps(self, values: np.ndarray, per_step: int | np.ndarray, weights: np.ndarray | None = None) -> None:
        """:meth:`add` of consecutive steps' values at once, ``per_step`` a step (or each step's count) in step
        order: binned where the steps added one by one are (what is binned together is summed together, so
        the sums do not change)."""
        at = 0
        ends = None  # (each step's end, where a step fills the buffer)
        while per_step is not None and len(values) - at + self._buffered >= self.BUFFER:
            need = at + self.BUFFER - self._buffered  # the step that fills the buffer ends at or past it
            if isinstance(per_step, int):
                if not per_step:
                    break
                end = at + -(-(need - at) // per_step) * per_step
            else:
                if ends is None:
                    ends = np.add.accumulate(per_step)
                end = int(ends[ends.searchsorted(need)])
            self.add(values[at:end], None if weights is None else weights[at:end])
            at = end
        if at < len(values):
            self.add(values[at:], None if weights is None else weights[at:])

    def _bins(self, values: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Each value's bin, computed in ``out`` (a float row as long as ``values``)."""
        v = np.maximum(values, 10.0**self.LOW, out=out)
        np.log10(v, out=v)
        v -= self.LOW
        v *= self.PER_DECADE
        bins = self._bin_scratch[:len(v)]
        np.copyto(bins, v, casting="unsafe")  # (truncated, as astype)
        return np.minimum(bins, len(self.counts) - 1, out=bins)

    def _flush(self) -> None:
        if self._plain:
            values, work, _ = self._scratch_rows(sum(len(v) for v in self._plain))
            np.concatenate(self._plain, out=values)
            self.counts += np.bincount(self._bins(values, work), minlength=len(self.counts))
            self.total += float(values.sum())
            # products summed by numpy, not BLAS: a multithreaded BLAS dot is slow on a busy machine
            # and its rounding depends on the thread count (results must not depend on the host)
            self.sq_total += float(_sum(np.multiply(values, values, out=work)))
            self.weight += len(values)
        if self._values:
            values, weights, work = self._scratch_rows(sum(len(v) for v in self._values))
            np.concatenate(self._values, out=values)
            np.concatenate(self._weights, out=weights, casting="unsafe")
            self.counts += np.bincount(self._bins(values, work), weights, minlength=len(self.counts))
            self.total += float(_sum(np.multiply(values, weights, out=work)))
            np.multiply(values, values, out=work)
            work *= weights
            self.sq_total += float(_sum(work))
            self.weight += float(weights.sum())
        self._plain, self._values, self._weights, self._buffered = [], [], [], 0

    def merge(self, other: LogHistogram) -> None:
        """Count everything ``other`` counted (the records of several ranks in one histogram)."""
        other._flush()
        self._flush()
        self.counts += other.counts
        self.total += other.total
        self.weight += other.weight
        self.sq_total += other.sq_total

    def mean(self) -> float:
        self._flush()
        return self.total / self.weight if self.weight else math.nan

    def std(self) -> float:
        self._flush()
        if not self.weight:
            return math.nan
        return math.sqrt(max(self.sq_total / self.weight - self.mean() ** 2, 0.0))

    def quantile(self, q: float) -> float:
        """The ``q``-quantile (geometric centre of its bin)."""
        self._flush()
        if not self.weight:
            return math.nan
        cum = np.cumsum(self.counts)
        i = int(np.searchsorted(cum, q * self.weight, side="left"))
        return 10.0 ** (self.LOW + (i + 0.5) / self.PER_DECADE)


class SLO(BaseModel):
    """Service-level objectives for goodput (vLLM's ``--goodput``); ``None`` means no limit."""

    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)
    e2el_ms: float | None = Field(None, gt=0)


class Summary(BaseModel):
    """One run's metrics; serializes to ``summary.json``. Latencies in ms, throughputs per second."""

    model_config = ConfigDict(extra="forbid")

    # --- vLLM serving-benchmark fields
    duration: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p90_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p90_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p90_itl_ms: float
    p99_itl_ms: float
    mean_e2el_ms: float
    median_e2el_ms: float
    std_e2el_ms: float
    p90_e2el_ms: float
    p99_e2el_ms: float

    # --- constrained decoding
    structured_requests: int
    aborts_by_reason: dict[str, int]
    mean_grammar_wait_ms: float
    median_grammar_wait_ms: float
    p99_grammar_wait_ms: float
    compiles: int
    mean_compile_ms: float
    p99_compile_ms: float
    cache_hit_rate: float
    inflight_shared: int
    drafted_tokens: int
    accepted_tokens: int
    rolled_back_tokens: int
    rollback_rate: float
    drafted_by_position: list[int] = Field(default_factory=list)
    accepted_by_position: list[int] = Field(default_factory=list)
    rolled_back_by_position: list[int] = Field(default_factory=list)
    jump_forward_tokens: int
    forced_think_ends: int
    validity_rate: float | None
    validated: int
    mean_rank_skew_ms: float
    max_rank_skew_ms: float
    mask_share: float
    mask_row_p50_us: float
    mask_row_p99_us: float
    mask_row_p999_us: float
    cpu_exposed_s: float
    cpu_hidden_by_overlap_s: float
    # shares of the summed step time: host CPU parts beside the GPU's (CPU parts may overlap the GPU,
    # so the shares need not add up to 1)
    host_schedule_share: float = 0.0
    host_grammar_share: float = 0.0
    host_transfer_share: float = 0.0
    host_process_share: float = 0.0
    gpu_share: float = 0.0
    # host CPU contention (harness/contention.py): the mean stretch of a step's host work, and the share of
    # steps it stretched at all
    mean_contention: float = 1.0
    contended_step_share: float = 0.0
    steps: int
    idle_iterations: int
    # the KV cache (harness/kv_cache.py): its token slots (None: not modelled, unbounded), requests preempted
    # (vLLM: recomputed) or retracted (SGLang), the tokens they recomputed, the slots in use (time-weighted mean
    # and peak over the steps, as shares of the capacity) and each request's wait for free blocks
    kv_capacity_tokens: int | None = None
    kv_preemptions: int = 0
    kv_retractions: int = 0
    kv_preempted_requests: int = 0
    kv_recomputed_tokens: int = 0
    kv_mean_utilization: float = 0.0
    kv_peak_utilization: float = 0.0
    mean_kv_wait_ms: float = 0.0
    p99_kv_wait_ms: float = 0.0
    # what priced the forward: the calibration's name (a shipped file or a path), "none" for the uncalibrated
    # roofline; None where the model did not price it (fixed costs, the GPU timed in hybrid, live mode)
    forward_calibration: str | None = None
    # the host's forward speed that multiplied those prices, and where it came from (given, or fitted from a
    # live run's steps or a probe); None where the model did not price the forward
    forward_speed: ForwardSpeed | None = None
    # model mode: where each spec's grammar costs came from (measured here or elsewhere, predicted, guessed)
    spec_costs: SpecCoverage | None = None
    # figures per minute (per hour for runs longer than 6 h) by issue time (harness/windows.py)
    time_windows: TimeWindows | None = None


Stats = tuple[float, float, float, float, float]
"""A latency's mean, median, standard deviation, p90 and p99, in ms."""


def latency_fields(ttft: Stats, tpot: Stats, e2el: Stats, itl: LogHistogram, wait: Stats,
                   compile_ms: Stats) -> dict[str, float]:
    """The :class:`Summary`'s latency figures, from each latency's :data:`Stats` and the ITL histogram (whole
    records and streamed ones fill them alike)."""
    t, p, e, w, c = ttft, tpot, e2el, wait, compile_ms
    ms = 1e3
    return dict(
        mean_ttft_ms=t[0], median_ttft_ms=t[1], std_ttft_ms=t[2], p90_ttft_ms=t[3], p99_ttft_ms=t[4],
        mean_tpot_ms=p[0], median_tpot_ms=p[1], std_tpot_ms=p[2], p90_tpot_ms=p[3], p99_tpot_ms=p[4],
        mean_itl_ms=itl.mean() * ms, median_itl_ms=itl.quantile(0.5) * ms, std_itl_ms=itl.std() * ms,
        p90_itl_ms=itl.quantile(0.9) * ms, p99_itl_ms=itl.quantile(0.99) * ms,
        mean_e2el_ms=e[0], median_e2el_ms=e[1], std_e2el_ms=e[2], p90_e2el_ms=e[3], p99_e2el_ms=e[4],
        mean_grammar_wait_ms=w[0], median_grammar_wait_ms=w[1], p99_grammar_wait_ms=w[4],
        mean_compile_ms=c[0], p99_compile_ms=c[4])


def draft_position_fields(draft_positions: DraftPositionCounts | None) -> dict[str, list[int]]:
    """The :class:`Summary`'s ``*_by_position`` lists (empty without drafts)."""
    if draft_positions is None or not draft_positions.max_drafts:
        return {"drafted_by_position": [], "accepted_by_position": [], "rolled_back_by_position": []}
    return {"drafted_by_position": [int(v) for v in draft_positions.drafted()],
            "accepted_by_position": [int(v) for v in draft_positions.accepted()],
            "rolled_back_by_position": [int(v) for v in draft_positions.rolled_back()]}


def _stats_ms(values: np.ndarray) -> Stats:
    v = values[~np.isnan(values)] * 1e3
    if len(v) == 0:
        return (math.nan,) * 5
    p90, p99 = np.percentile(v, [90, 99])
    return float(v.mean()), float(np.median(v)), float(v.std()), float(p90), float(p99)


def summarize(requests: pd.DataFrame, steps: pd.DataFrame, itl: LogHistogram, mask_rows: LogHistogram,
              slo: SLO | None = None, idle_iterations: int | None = None,
              draft_positions: DraftPositionCounts | None = None, kv_capacity: int | None = None,
              kv_policy: str = "unbounded") -> Summary:
    """Compute the :class:`Summary` of a run from its records.

    ``idle_iterations`` overrides the count of idle rows in ``steps`` (one row
    may stand for a stride of identical idle iterations); ``draft_positions``
    fills the ``*_by_position`` lists (index 0 is the first draft position);
    ``kv_capacity`` (token slots) and ``kv_policy`` describe the run's KV cache
    (``None``: not modelled).
    """
    ok = requests["abort_reason"] == ""
    done = requests[ok]
    issued = requests["issued_s"].to_numpy()
    finish = requests["finish_s"].to_numpy()
    duration = float(np.nanmax(finish) - np.nanmin(issued)) if len(requests) and ok.any() else 0.0
    ttft, e2el, tpot = latencies(done)
    out = done["output_tokens"].to_numpy()
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    goodput = None
    if slo is not None:
        good = np.ones(len(done), bool)
        if slo.ttft_ms is not None:
            good &= ttft * 1e3 <= slo.ttft_ms
        if slo.tpot_ms is not None:
            good &= np.nan_to_num(tpot, nan=0.0) * 1e3 <= slo.tpot_ms
        if slo.e2el_ms is not None:
            good &= e2el * 1e3 <= slo.e2el_ms
        goodput = per_s(float(good.sum()))

    structured = requests[requests["structured"]]
    wait = (structured["grammar_ready_s"] - structured["issued_s"]).to_numpy()
    misses = structured[structured["cache"] == "miss"]
    compile_ms = (misses["compile_end_s"] - misses["compile_start_s"]).to_numpy()
    hits = int((structured["cache"] == "hit").sum())
    drafted = int(requests["drafted"].sum())
    rolled = int(requests["rolled_back"].sum())
    valid = requests["valid"].dropna()
    skew = structured["rank_skew_s"].to_numpy()
    skew = skew[~np.isnan(skew)]
    total_step = float(steps["duration_s"].sum()) if len(steps) else 0.0
    mask_time = float((steps["fill_s"] + steps["copy_s"] + steps["apply_s"]).sum()) if len(steps) else 0.0

    def share(*columns: str) -> float:
        return float(sum(steps[c].sum() for c in columns if c in steps)) / total_step if total_step else 0.0
    reasons = requests.loc[~ok, "abort_reason"].astype(str).value_counts()

    busy = steps[steps["kind"] != "idle"] if len(steps) else steps
    kv = _kv_fields(requests, steps, total_step, kv_capacity, kv_policy)
    ms = 1e3
    return Summary(
        duration=duration,
        completed=int(ok.sum()),
        failed=int((~ok).sum()),
        total_input_tokens=int(done["prompt_len"].sum()),
        total_output_tokens=int(out.sum()),
        request_throughput=per_s(float(len(done))),
        request_goodput=goodput,
        output_throughput=per_s(float(out.sum())),
        total_token_throughput=per_s(float(out.sum() + done["prompt_len"].sum())),
        **latency_fields(_stats_ms(ttft), _stats_ms(tpot), _stats_ms(e2el), itl, _stats_ms(wait),
                         _stats_ms(compile_ms)),
        structured_requests=len(structured),
        aborts_by_reason={str(k): int(v) for k, v in reasons.items() if v},
        compiles=len(misses),
        cache_hit_rate=hits / len(structured) if len(structured) else math.nan,
        inflight_shared=int((structured["cache"] == "inflight").sum()),
        drafted_tokens=drafted,
        accepted_tokens=int(requests["accepted"].sum()),
        rolled_back_tokens=rolled,
        rollback_rate=rolled / drafted if drafted else 0.0,
        **draft_position_fields(draft_positions),
        jump_forward_tokens=int(requests["jump_forward_tokens"].sum()),
        forced_think_ends=int(requests["forced_think_end"].sum()),
        validity_rate=float(valid.mean()) if len(valid) else None,
        validated=len(valid),
        mean_rank_skew_ms=float(skew.mean() * ms) if len(skew) else 0.0,
        max_rank_skew_ms=float(skew.max() * ms) if len(skew) else 0.0,
        mask_share=mask_time / total_step if total_step else 0.0,
        mask_row_p50_us=mask_rows.quantile(0.5) * 1e6,
        mask_row_p99_us=mask_rows.quantile(0.99) * 1e6,
        mask_row_p999_us=mask_rows.quantile(0.999) * 1e6,
        cpu_exposed_s=float(steps["exposed_cpu_s"].sum()) if len(steps) else 0.0,
        cpu_hidden_by_overlap_s=float(steps["hidden_cpu_s"].sum()) if len(steps) else 0.0,
        host_schedule_share=share("schedule_s", "poll_s", "sync_s", "check_s"),
        host_grammar_share=share("fill_s"),
        host_transfer_share=share("transfer_s"),
        host_process_share=share("process_s"),
        gpu_share=share("forward_s", "apply_s", "sample_s"),  # (the mask copy sits on the host's chain: mask_share)
        mean_contention=float(busy["contention"].mean()) if len(busy) and "contention" in busy else 1.0,
        contended_step_share=float((busy["contention"] > 1.0).mean()) if len(busy) and "contention" in busy else 0.0,
        steps=int((steps["kind"] != "idle").sum()) if len(steps) else 0,
        idle_iterations=idle_iterations if idle_iterations is not None else
        int((steps["kind"] == "idle").sum()) if len(steps) else 0,
        **kv,
    )


def _kv_fields(requests: pd.DataFrame, steps: pd.DataFrame, total_step: float, capacity: int | None,
               policy: str) -> dict[str, object]:
    """The summary's KV-cache fields (its defaults when the cache is not modelled)."""
    if capacity is None or "preemptions" not in requests:
        return {}
    evicted = int(requests["preemptions"].sum())
    used = steps["kv_tokens"].to_numpy() / capacity if len(steps) else np.zeros(0)
    wait = requests["kv_wait_s"].to_numpy() * 1e3
    return dict(
        kv_capacity_tokens=capacity,
        kv_preemptions=evicted if policy != "sglang" else 0,
        kv_retractions=evicted if policy == "sglang" else 0,
        kv_preempted_requests=int((requests["preemptions"] > 0).sum()),
        kv_recomputed_tokens=int(requests["recomputed_tokens"].sum()),
        kv_mean_utilization=float(_sum(used * steps["duration_s"].to_numpy()) / total_step) if total_step else 0.0,
        kv_peak_utilization=float(used.max()) if len(used) else 0.0,
        mean_kv_wait_ms=float(wait.mean()) if len(wait) else 0.0,
        p99_kv_wait_ms=float(np.percentile(wait, 99)) if len(wait) else 0.0,
    )
