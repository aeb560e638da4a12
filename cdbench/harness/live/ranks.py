"""Runs of several ranks, one process each: tensor parallelism (``tp``) or data parallelism (``dp``).

Every rank is a process of its own (spawned, a fresh interpreter), with its own
device (GPU ``r`` for ``live`` mode on a CUDA host; the CPU in tests), its own
grammar backend, compile pool, grammar queue and scheduler loop, as a
multi-GPU engine runs them:

- ``tp``: every rank runs every request and the same batch; its forward is
  its shard (:class:`~cdbench.harness.live.forward.TensorParallel`: heads and
  MLP divided, an all-reduce after each row-parallel projection, NCCL on GPUs).
  At each poll of the grammar queue the ranks exchange their ready and failed
  sets with a real ``all_gather_object`` over a CPU (gloo) group, as SGLang's
  grammar sync group does (ready = intersection, failed = union), and each
  step's duration and token time are the slowest rank's (the forward's
  collectives make every rank wait for it), exchanged likewise, so the ranks'
  clocks and batches stay the same. The run's records are rank 0's, with each
  request's compile spread over the ranks (``rank_skew_s``).
- ``dp``: the requests are dealt to the ranks round robin in arrival order
  (the engine's DP controller); each rank runs its own requests and batch on
  its own full model, with no agreement (each DP rank's grammar group is its own
  TP group). The run's records are every rank's, merged, with a ``rank`` column.

Each rank's own step records (its own time, its wait for the slowest rank, its
forward, fill and launch: :mod:`.rank_steps`) are kept beside, every rank's
(``rank_steps.parquet``). What the ranks measured (the grammar all_gather's time
per poll, the step agreement's, the spread of the ranks' step durations, fills
and compile times, the forward all-reduce at a few sizes) is :class:`RanksInfo`,
saved in the run's ``live.json``; :func:`model_parameters` turns it into the
model's ``all_gather_s``, ``rank_jitter`` and ``rank_fill_jitter``.

Every iteration the tensor-parallel ranks also check that they hold the same
state (clock, queues): ranks that drifted apart would otherwise wait on each
other's collectives for ever. With ``CDBENCH_RANK_STACKS_S`` set, each rank
prints its threads' stacks every that many seconds (a stuck run's diagnosis).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd

from cdbench.harness.collectives import CollectiveError, PeerAgreement
from cdbench.harness.costs.gpu import GpuCosts
from cdbench.harness.costs.grammar_profile import GrammarProfile
from cdbench.harness.costs.hardware import ModelSpec
from cdbench.harness.executors.base import GrammarExecutor
from cdbench.harness.kv_cache import kv_description
from cdbench.harness.live.forward import TensorParallel
from cdbench.harness.live.rank_info import Parallel, RanksInfo, Spread
from cdbench.harness.live.rank_procs import deliver, run_rank_processes
from cdbench.harness.live.rank_steps import fill_spread, rank_step_frame, step_skew
from cdbench.harness.live.step import GPU_MEMORY_UTILIZATION, MAX_BATCHED_TOKENS, LiveInfo, LiveStep, LiveTimes
from cdbench.harness.metrics import SLO, LogHistogram, Summary, summarize
from cdbench.harness.policies import SchedulerConfig
from cdbench.harness.records import DraftPositionCounts
from cdbench.harness.scheduler import Scheduler
from cdbench.harness.timeline import Timeline
from cdbench.workloads.request import Request

ALL_REDUCE_TOKENS = (1, 16, 128, 1024, 8192)  # rows of hidden-size activations the forward all-reduces


def deal(requests: Sequence[Request], ranks: int) -> list[list[Request]]:
    """The DP controller's round robin: the ``i``-th request to arrive goes to rank ``i mod ranks``.

    >>> [[r.request_id for r in part] for part in deal([Request(i, 0.1 * i, 4, 2) for i in range(5)], 2)]
    [[0, 2, 4], [1, 3]]
    """
    ordered = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
    return [ordered[rank::ranks] for rank in range(ranks)]


@dataclass(frozen=True)
class LiveSpec:
    """How each rank builds its live step: ``model``'s forward (its shard under ``tp``) on GPU ``rank``
    (``device="cuda"``) or on the CPU (tests, a tiny model; ``kv_tokens`` required)."""

    model: ModelSpec
    vocab_size: int
    max_len: int
    device: Literal["cuda", "cpu"] = "cuda"
    kv_tokens: int | None = None
    max_rows: int = 1024
    logits_dtype: str = "bfloat16"
    graph_sizes: tuple[int, ...] = ()
    block_size: int = 16  # the paged KV cache's (the policy's kv_block_size)
    max_requests: int | None = None  # rows of its block table (default max_rows)
    memory_fraction: float = GPU_MEMORY_UTILIZATION  # without kv_tokens: the policy's kv_memory_fraction
    max_tokens: int = MAX_BATCHED_TOKENS  # the policy's max_batched_tokens: the profiled largest step's
    spec_tokens: int = 0  # drafts a decode row verifies: the profiled largest step's


@dataclass(frozen=True)
class RankJob:
    """Everything a rank process builds its run from (pickled to it).

    ``scheduler`` is the whole run's policy (``ranks`` = the processes);
    ``executor`` makes a rank's grammar executor in its process (a picklable
    callable: each rank its own backend); ``gpu`` prices the GPU when
    ``live`` is ``None``.
    """

    parallel: Parallel
    requests: tuple[Request, ...]
    scheduler: SchedulerConfig
    executor: Callable[[], GrammarExecutor]
    gpu: GpuCosts
    live: LiveSpec | None = None
    seed: int = 0
    max_concurrency: int | None = None
    trace_steps: int = 0
    timeout_s: float = 600.0

    @property
    def ranks(self) -> int:
        return self.scheduler.ranks


@dataclass
class _RankOutput:
    """One rank's records and measurements, sent back to the parent."""

    rank: int
    device: str
    requests: pd.DataFrame
    steps: pd.DataFrame
    itl: LogHistogram
    fill_hist: LogHistogram
    idle_iterations: int
    draft_positions: DraftPositionCounts
    compile_errors: Mapping[str, str]
    backend_call_s: float
    validation_s: float
    profile: GrammarProfile | None
    live: LiveInfo | None
    timeline: Timeline | None
    all_gather_s: list[float]
    step_agree_s: list[float]
    step_local_s: list[float]
    all_reduce_s: dict[int, float]
    rank_steps: pd.DataFrame  # its own step records (rank_steps.rank_step_frame)
    kv: tuple[int | None, str] = (None, "unbounded")  # the KV cache's capacity and policy (kv_cache.kv_description)


class RankScheduler(Scheduler):
    """A tensor-parallel rank's scheduler loop: its polls agree with the other ranks' through ``peer``,
    and so do its idle iterations' durations (a busy step's is agreed by its live step)."""

    def __init__(self, *args, peer: PeerAgreement, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peer = peer
        self._ranks = peer  # the poll's all_gather (Scheduler._agree_for_real) goes to the other processes

    def _iterate(self, t: float) -> float | None:
        self.peer.check_same((t, len(self.batch), len(self.waiting), self.grammar_queue, self.ended),
                             "(clock, running, waiting, grammar queue, ended) at an iteration")
        return super()._iterate(t)

    def _idle_iteration(self, t, pre, schedule_s, poll_s, sync_s, check_s) -> float | None:
        rows = len(self.steps.rows)
        duration = super()._idle_iteration(t, pre, schedule_s, poll_s, sync_s, check_s)
        if duration is None:  # the same on every rank: their queues agree
            return None
        agreed, _ = self.peer.agree_step(duration, duration)
        if len(self.steps.rows) > rows:  # its row holds the agreed duration (a step row starts (t, duration, ...))
            row = self.steps.rows[-1]
            self.steps.rows[-1] = (row[0], agreed, *row[2:])
        return agreed


def run_ranks(job: RankJob, progress: Callable[[float], None] | None = None
              ) -> tuple[list[_RankOutput], RanksInfo]:
    """Run ``job`` on ``job.ranks`` processes; every rank's output (rank order) and what they measured.

    A rank that fails ends the others; the error names it. ``progress`` is called with the share of
    ranks done.
    """
    if job.ranks < 2:
        raise ValueError(f"a run of rank processes needs at least 2 ranks, got {job.ranks}")
    if job.parallel == "tp":
        _check_tp(job.scheduler)
    if job.live is not None and job.live.device == "cuda":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < job.ranks:
            raise CollectiveError(f"{job.ranks} {job.parallel.upper()} ranks each need a GPU of their own; "
                                  f"this machine has {gpus}")
    outputs = run_rank_processes(_run_rank, job.ranks, (job,), job.timeout_s, progress)
    return outputs, _info(job, outputs)


def _check_tp(config: SchedulerConfig) -> None:
    if config.readiness != "blocking_poll" or config.grammar_wait != "grammar_queue":
        raise ValueError("tensor-parallel ranks agree at SGLang's poll of its grammar queue (readiness "
                         "blocking_poll, grammar_wait grammar_queue); this policy checks each request instead "
                         "(vLLM: one scheduler drives its TP workers, nothing to agree)")
    if config.cache_write != "harvest":
        raise ValueError("tensor-parallel ranks need cache_write harvest: a grammar enters each rank's cache when "
                         "the ranks agree it is ready, so a later request finds the same on every rank")


def _run_rank(rank: int, folder: Path, job: RankJob) -> None:
    """A rank process's run (:func:`_simulate_rank`); tensor-parallel ranks first join their group (NCCL on
    GPUs, gloo on the CPU). The output is delivered before the rank leaves the group: leaving may wait."""
    import datetime

    import torch
    import torch.distributed as dist

    cuda = job.live is not None and job.live.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    if job.parallel == "dp":  # nothing to share
        deliver(folder, rank, _simulate_rank(rank, job, job.executor(), None, None))
        return
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder / 'store'}", rank=rank,
                            world_size=job.ranks, timeout=datetime.timedelta(seconds=job.timeout_s))
    try:
        # the grammar's agreement travels on a CPU group, as SGLang's grammar sync group does
        cpu_group = dist.new_group(backend="gloo") if cuda else None
        tp = TensorParallel(job.ranks, rank, None)
        deliver(folder, rank, _simulate_rank(rank, job, job.executor(), PeerAgreement(job.ranks, cpu_group), tp))
    finally:
        dist.destroy_process_group()


def _simulate_rank(rank: int, job: RankJob, executor: GrammarExecutor, peer: PeerAgreement | None,
                   tp: TensorParallel | None) -> _RankOutput:
    """Rank ``rank``'s scheduler loop over its requests (all of them under tp, its deal under dp)."""
    import torch

    requests = list(job.requests) if job.parallel == "tp" else deal(job.requests, job.ranks)[rank]
    local = job.scheduler.model_copy(update={"ranks": 1, "collectives": "model", "rank_compile_scale": None})
    live, all_reduce = None, {}
    if job.live is not None:
        spec = job.live
        kwargs = {"peer": peer} if peer is not None else {}
        live = (AgreeingLiveStep if peer is not None else LiveStep)(
            spec.model, spec.vocab_size, spec.max_len, spec.device, spec.kv_tokens, max_rows=spec.max_rows,
            logits_dtype=getattr(torch, spec.logits_dtype), graph_sizes=spec.graph_sizes, tp=tp,
            block_size=spec.block_size, max_requests=spec.max_requests, memory_fraction=spec.memory_fraction,
            max_tokens=spec.max_tokens, spec_tokens=spec.spec_tokens, **kwargs)
        if tp is not None:
            all_reduce = _time_all_reduce(spec.model.hidden_size, live.device, tp)
    timeline = Timeline(max_steps=job.trace_steps) if job.trace_steps and rank == 0 else None
    concurrency = job.max_concurrency
    if concurrency is not None and job.parallel == "dp":
        concurrency = -(-concurrency // job.ranks)  # the client's requests in flight, dealt like the requests
    if peer is not None:
        sched: Scheduler = RankScheduler(local, requests, executor, job.gpu, seed=job.seed,
                                         max_concurrency=concurrency, timeline=timeline, live=live, peer=peer)
    else:
        sched = Scheduler(local, requests, executor, job.gpu, seed=job.seed, max_concurrency=concurrency,
                          timeline=timeline, live=live)
    sched.run()
    cuda = live is not None and live.cuda
    if cuda:
        torch.cuda.synchronize()
    steps = sched.steps.to_frame()
    agreeing = isinstance(live, AgreeingLiveStep)
    own = rank_step_frame(rank, steps, live.local_durations if agreeing else None,
                          live.agree_seconds if agreeing else None)
    return _RankOutput(
        rank, torch.cuda.get_device_name(live.device) if cuda else "cpu", sched.rec.to_frame(),
        steps, sched.itl, sched.fill_hist, sched.idle_iterations, sched.draft_positions,
        sched.compile_errors, executor.backend_call_s, executor.validation_s,
        executor.measured_profile(f"in situ: rank {rank} of a {job.parallel}={job.ranks} run of {len(requests)} "
                                  f"requests, seed {job.seed}"),
        live.info() if live is not None else None, timeline,
        peer.seconds if peer else [], peer.step_seconds if peer else [], getattr(live, "local_durations", []),
        all_reduce, own, kv_description(sched.kv))


def simulate_dp(job: RankJob, executors: Callable[[int], GrammarExecutor]) -> tuple[list[_RankOutput], RanksInfo]:
    """A data-parallel job without processes (its ranks share nothing): each rank's loop in turn, here;
    ``executors`` makes rank ``r``'s grammar executor. For model and hybrid mode, where no rank owns a GPU."""
    if job.parallel != "dp" or job.live is not None:
        raise ValueError("only a data-parallel run without live steps runs its ranks in one process")
    outputs = [_simulate_rank(rank, job, executors(rank), None, None) for rank in range(job.ranks)]
    return outputs, _info(job, outputs)


class AgreeingLiveStep(LiveStep):
    """A tensor-parallel rank's live step: its duration and token time are the slowest rank's."""

    def __init__(self, *args, peer: PeerAgreement, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peer = peer
        self.local_durations: list[float] = []  # before the agreement: the ranks' spread is the skew
        self.agree_seconds: list[float] = []  # each agreement's wall time (the wait for the last rank included)

    def end(self, *args, **kwargs) -> LiveTimes:
        times = super().end(*args, **kwargs)
        self.local_durations.append(times.duration)
        start = time.perf_counter()
        duration, token_at = self.peer.agree_step(times.duration, times.duration - times.after_token_s)
        self.agree_seconds.append(time.perf_counter() - start)
        return dataclasses.replace(times, duration=duration, after_token_s=duration - token_at)


def _time_all_reduce(hidden: int, device, group, repeats: int = 20) -> dict[int, float]:
    """The forward's all-reduce of ``tokens`` rows of the hidden size, timed alone (median of ``repeats``)."""
    import torch

    times: dict[int, float] = {}
    for tokens in ALL_REDUCE_TOKENS:
        x = torch.zeros((tokens, hidden), device=device, dtype=torch.bfloat16 if device.type == "cuda"
                        else torch.float32)
        group.all_reduce(x)  # warm-up: the first call sets the communicator up
        seconds = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            group.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        times[tokens] = float(np.median(seconds))
    return times


# ---- merging ----------------------------------------------------------------------------------------------

def merge_hist(parts: Sequence[LogHistogram]) -> LogHistogram:
    merged = LogHistogram()
    for part in parts:
        merged.merge(part)
    return merged


def merged_records(job: RankJob, outputs: Sequence[_RankOutput]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The run's request and step tables (see the module doc), each with a ``rank`` column."""
    if job.parallel == "tp":
        _check_same_schedule(outputs)
        requests = outputs[0].requests.copy()
        starts = np.stack([o.requests["compile_start_s"].to_numpy() for o in outputs])
        ends = np.stack([o.requests["compile_end_s"].to_numpy() for o in outputs])
        with np.errstate(invalid="ignore"):
            requests["compile_start_s"] = starts.min(axis=0)
            requests["compile_end_s"] = ends.max(axis=0)
            requests["rank_skew_s"] = ends.max(axis=0) - ends.min(axis=0)
        requests["rank"] = 0
        steps = outputs[0].steps.assign(rank=0)
        return requests, steps
    requests = pd.concat([o.requests.assign(rank=o.rank) for o in outputs], ignore_index=True)
    requests = requests.sort_values(["arrival_s", "request_id"], kind="stable", ignore_index=True)
    steps = pd.concat([o.steps.assign(rank=o.rank) for o in outputs], ignore_index=True)
    return requests, steps


def _check_same_schedule(outputs: Sequence[_RankOutput]) -> None:
    """Tensor-parallel ranks run the same batches: every request's first token and output length agree."""
    first = outputs[0].requests
    for other in outputs[1:]:
        for column in ("first_token_s", "output_tokens", "abort_reason"):
            a, b = first[column], other.requests[column]
            same = (a == b) | (a.isna() & b.isna()) if column != "abort_reason" else (a == b)
            if not bool(np.all(same)):
                rid = int(first["request_id"][~np.asarray(same)].iloc[0])
                raise CollectiveError(f"tensor-parallel ranks 0 and {other.rank} diverged: request {rid}'s "
                                      f"{column} differs ({a[~np.asarray(same)].iloc[0]} against "
                                      f"{b[~np.asarray(same)].iloc[0]})")


def summary_of(job: RankJob, outputs: Sequence[_RankOutput], requests: pd.DataFrame, steps: pd.DataFrame,
               slo: SLO | None):
    """The run's summary: rank 0's (tp: every rank ran the same steps) or over every rank's records (dp)."""
    if job.parallel == "tp":
        o = outputs[0]
        return summarize(requests, o.steps, o.itl, o.fill_hist, slo, o.idle_iterations, o.draft_positions, *o.kv)
    drafts = DraftPositionCounts(job.scheduler.spec_tokens)
    for o in outputs:
        drafts.merge(o.draft_positions)
    # (data-parallel ranks: each its own cache; the capacity is one rank's, the steps' slots are summed per rank)
    return summarize(requests, steps, merge_hist([o.itl for o in outputs]), merge_hist([o.fill_hist for o in outputs]),
                     slo, sum(o.idle_iterations for o in outputs), drafts, *outputs[0].kv)


def _info(job: RankJob, outputs: Sequence[_RankOutput]) -> RanksInfo:
    per_rank = dict(requests=[len(o.requests) for o in outputs], steps=[len(o.steps) for o in outputs],
                    busy_s=[float(o.steps.loc[o.steps["kind"] != "idle", "duration_s"].sum()) for o in outputs])
    devices = [o.device for o in outputs]
    if job.parallel == "dp":
        return RanksInfo("dp", job.ranks, devices, **per_rank)
    local = [np.asarray(o.step_local_s) for o in outputs]
    steps = min(len(x) for x in local)
    skew = np.ptp(np.stack([x[:steps] for x in local]), axis=0) if steps else []
    own = pd.concat([o.rank_steps for o in outputs], ignore_index=True)
    ends = np.stack([o.requests["compile_end_s"].to_numpy() for o in outputs])
    starts = np.stack([o.requests["compile_start_s"].to_numpy() for o in outputs])
    missed = np.asarray(outputs[0].requests["cache"] == "miss")
    with np.errstate(invalid="ignore"):
        compile_skew = (ends.max(axis=0) - ends.min(axis=0))[missed]
    fills = fill_spread(own)
    return RanksInfo(
        "tp", job.ranks, devices,
        all_gather_s=Spread.of(np.concatenate([o.all_gather_s for o in outputs])),
        step_agree_s=Spread.of(np.concatenate([o.step_agree_s for o in outputs])),
        step_skew_s=Spread.of(skew), step_lag_s=Spread.of(step_skew(own)["skew_s"]),
        compile_skew_s=Spread.of(compile_skew), compile_sigma=compile_sigma((ends - starts)[:, missed]),
        fill_sigma=fills.sigma if fills else None, fill_offset=fills.offset if fills else None,
        all_reduce_s=outputs[0].all_reduce_s, **per_rank)


def compile_sigma(seconds: np.ndarray) -> float | None:
    """The lognormal sigma of one spec's compile time among ranks, from ``seconds[rank, spec]``: the
    spread of each rank's log time about the spec's mean log time, unbiased for the rank count.

    >>> round(compile_sigma(np.array([[1.0, 2.0], [np.e, 2.0 * np.e]])), 3)
    0.707
    """
    ranks = seconds.shape[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(seconds)
    logs = logs[:, np.isfinite(logs).all(axis=0)]
    if ranks < 2 or logs.shape[1] == 0:
        return None
    deviations = logs - logs.mean(axis=0)
    return float(np.sqrt((deviations ** 2).sum() / (logs.shape[1] * (ranks - 1))))


SIZE_BIN_FACTOR = 4.0
"""Compiles are grouped by size in bins this many times wide (edges at 5 ms times its powers)."""
MIN_SPECS_A_SIZE = 5
"""Fewest compiled specs one size's rank spread is taken from (a bin with fewer joins the next larger)."""


def compile_sigma_by_size(requests: pd.DataFrame, ranks: int) -> tuple[tuple[float, float], ...] | None:
    """The spread of one spec's compile time among ``ranks`` tensor-parallel ranks by the compile's size:
    ``(seconds, sigma)`` points, from a live run's merged requests (each compiled one's earliest rank start,
    latest rank end and spread of the ranks' ends, ``rank_skew_s``), ``None`` where it kept none.

    A multi-threaded compile spreads far more among the ranks than a short one: in two-rank runs on an
    H200 host, specs compiled in under 5 ms spread by a sigma of 0.07-0.11, those above by 0.15-0.24,
    the same requests in every copy (``reports/fidelity/live_vs_model.md``, "Multi-GPU"), so one sigma
    (:func:`compile_sigma`) prices the large compiles' spread at half. A request's slowest rank took its
    end minus its start, its fastest that less the ends' spread; their log ratio is the range of ``ranks``
    lognormal draws, whose mean square is ``sigma**2`` times that of ``ranks`` standard normals
    (:func:`_range_square`). The point of a bin is its compiles' geometric mean size.
    """
    needed = {"cache", "compile_start_s", "compile_end_s", "rank_skew_s"}
    if ranks < 2 or not needed <= set(requests.columns):
        return None
    compiled = requests[requests["cache"] == "miss"]
    slow = (compiled["compile_end_s"] - compiled["compile_start_s"]).to_numpy(np.float64)
    fast = slow - compiled["rank_skew_s"].to_numpy(np.float64)
    keep = np.isfinite(slow) & np.isfinite(fast) & (fast > 0)
    slow, fast = slow[keep], fast[keep]
    if len(slow) < MIN_SPECS_A_SIZE:
        return None
    size, log_range = np.sqrt(slow * fast), np.log(slow / fast)
    order = np.argsort(size)
    size, log_range = size[order], log_range[order]
    bins = np.floor(np.log(size / 5e-3) / np.log(SIZE_BIN_FACTOR)).astype(np.int64)
    groups: list[np.ndarray] = []
    start = 0
    for end in [*(np.flatnonzero(np.diff(bins)) + 1), len(size)]:
        if end - start >= MIN_SPECS_A_SIZE:
            groups.append(np.arange(start, end))
            start = end
    if start < len(size):  # the largest compiles, too few alone: with the bin below
        groups[-1] = np.arange(groups[-1][0], len(size)) if groups else np.arange(len(size))
    scale = _range_square(ranks)
    return tuple((float(f"{np.exp(np.log(size[g]).mean()):.4g}"),
                  float(f"{np.sqrt((log_range[g] ** 2).mean() / scale):.4g}")) for g in groups)


def _range_square(ranks: int) -> float:
    """The mean square of the range of ``ranks`` standard normal draws (2 for two; by simulation, seeded)."""
    if ranks == 2:
        return 2.0
    draws = np.random.default_rng(0).standard_normal((200_000, ranks))
    return float((np.ptp(draws, axis=1) ** 2).mean())


def model_parameters(info: RanksInfo) -> dict[str, float]:
    """The model's prices of a tensor-parallel run's ranks, from what it measured: ``all_gather_s`` (the
    median exchange), ``rank_jitter`` (the compile spread's sigma), ``rank_fill_offset`` and
    ``rank_fill_jitter`` (the other ranks' fill of a step against rank 0's, :func:`~.rank_steps.fill_spread`;
    runs from before the ranks' own records, or before the offset was kept, have none)."""
    if info.parallel != "tp" or info.all_gather_s is None:
        raise ValueError("the ranks' prices come from a tensor-parallel run (it measured the agreement)")
    out = {"ranks": float(info.ranks), "all_gather_s": info.all_gather_s.p50}
    if info.compile_sigma is not None:
        out["rank_jitter"] = info.compile_sigma
    if info.fill_sigma is not None and info.fill_offset is not None:
        out["rank_fill_jitter"], out["rank_fill_offset"] = info.fill_sigma, info.fill_offset
    return out


# ---- a whole run ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HybridExecutors:
    """A rank's grammar executor in live and hybrid mode: its own ``backend`` built in its own process
    (picklable: the rank builds it), drafts at ``alpha`` from ``pools`` as the workload's draft source."""

    backend: str
    options: dict
    vocab: str
    alpha: float
    draft_seed: int
    pools: dict
    seed: int

    def __call__(self) -> GrammarExecutor:
        from cdbench.backends.registry import create_backend
        from cdbench.backends.vocab import load_vocab
        from cdbench.harness.executors.hybrid import HybridExecutor
        from cdbench.workloads.drafts import DraftSource

        vocab = load_vocab(self.vocab)
        backend = create_backend(self.backend, vocab, **self.options)
        return HybridExecutor(backend, self.alpha, DraftSource(self.alpha, vocab, self.draft_seed, self.pools),
                              seed=self.seed)


@dataclass
class RanksRun:
    """A run of several ranks merged into one (the fields of :class:`~cdbench.harness.run.RunResult`)."""

    requests: pd.DataFrame
    steps: pd.DataFrame
    summary: Summary
    timeline: Timeline
    wall_s: float
    backend_call_s: float
    validation_s: float
    compile_errors: Mapping[str, str]
    grammar_profile: GrammarProfile | None
    live: LiveInfo | None
    rank_steps: pd.DataFrame  # every rank's own step records (rank_steps.RANK_STEP_COLUMNS)


def simulate_ranks(job: RankJob, slo: SLO | None = None, progress: Callable[[float], None] | None = None) -> RanksRun:
    """Run ``job`` (rank processes, but a data-parallel job without live steps in this process) and
    merge the ranks into one run (its ``live`` info holds :class:`RanksInfo`)."""
    start = time.perf_counter()
    if job.live is not None or job.parallel == "tp":
        outputs, info = run_ranks(job, progress)
    else:
        outputs, info = simulate_dp(job, lambda rank: job.executor())
    requests, steps = merged_records(job, outputs)
    summary = summary_of(job, outputs, requests, steps, slo)
    live = outputs[0].live
    if live is not None:
        live = dataclasses.replace(live, ranks=info)
    errors: dict[str, str] = {}
    for o in outputs:
        errors.update(o.compile_errors)
    return RanksRun(requests, steps, summary, outputs[0].timeline or Timeline(), time.perf_counter() - start,
                    sum(o.backend_call_s for o in outputs), sum(o.validation_s for o in outputs), errors,
                    merged_profile(job, [o.profile for o in outputs]), live,
                    pd.concat([o.rank_steps for o in outputs], ignore_index=True))


_SPEC_SECTIONS = ("compile_by_spec", "failed_specs", "specs", "instances", "spec_contents")


def merged_profile(job: RankJob, profiles: Sequence[GrammarProfile | None]) -> GrammarProfile | None:
    """The run's in-situ grammar profile: rank 0's under tp (it compiled every spec); under dp each rank
    measured its own requests' specs, so their per-spec sections are joined (the per-kind
    distributions stay rank 0's)."""
    first = profiles[0]
    if first is None or job.parallel == "tp":
        return first
    update = {name: {key: value for p in profiles for key, value in getattr(p, name).items()}
              for name in _SPEC_SECTIONS}
    return first.model_copy(update=update | {"source": f"{first.source}; with the specs of ranks 1-{job.ranks - 1}"})


def load_ranks_info(live_json: Path | str) -> RanksInfo:
    """The :class:`RanksInfo` saved in a run's ``live.json``; ``ValueError`` naming the file if it has none."""
    return ranks_info_of(Path(live_json).read_text(), str(live_json))


def ranks_info_of(live_json: str | bytes, name: str) -> RanksInfo:
    """The :class:`RanksInfo` in the text of a ``live.json`` (``name``: where it came from, for the error)."""
    import json

    data = json.loads(live_json).get("ranks")
    if not data:
        raise ValueError(f"{name}: not a run of several rank processes (no 'ranks' entry)")
    spreads = {name: Spread(**data[name]) if data.get(name) else None
               for name in ("all_gather_s", "step_agree_s", "step_skew_s", "step_lag_s", "compile_skew_s")}
    rest = {k: v for k, v in data.items() if k not in spreads}
    rest["all_reduce_s"] = {int(k): v for k, v in (rest.get("all_reduce_s") or {}).items()}
    return RanksInfo(**rest, **spreads)
