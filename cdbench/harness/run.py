"""Run a simulation: :func:`run` for a whole :class:`~cdbench.harness.config.RunConfig`,
:func:`simulate` for requests and cost sources you built yourself.

``run`` generates the workload, builds the backend (``hybrid``) or the grammar
profile (``model``) and the GPU cost model, and simulates.

>>> from cdbench.harness.costs.gpu import FixedGpuCosts

>>> from cdbench.harness.executors.model import FixedGrammarCosts, ModelExecutor
>>> from cdbench.harness.policies import policy
>>> from cdbench.workloads.request import Request
>>> result = simulate([Request(0, 0.0, 100, 4)], policy("vllm", overlap=False),
...                   ModelExecutor(FixedGrammarCosts()), FixedGpuCosts(forward_base_s=0.01))
>>> result.requests["finish_s"].tolist(), result.summary.completed
([0.04], 1)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pandas as pd

from cdbench.harness.costs.gpu import GpuCosts, RooflineGpuCosts
from cdbench.harness.costs.grammar_profile import GrammarProfile
from cdbench.harness.executors.base import GrammarExecutor
from cdbench.harness.kv_cache import kv_description
from cdbench.harness.metrics import SLO, LogHistogram, Summary, summarize
from cdbench.harness.policies import SchedulerConfig
from cdbench.harness.records import RequestTable, StepLog
from cdbench.harness.scheduler import Scheduler
from cdbench.harness.streamed import TableSource, summarize_streamed
from cdbench.harness.timeline import Timeline
from cdbench.harness.windows import time_windows
from cdbench.workloads.request import Request

if TYPE_CHECKING:
    from cdbench.harness.config import RunConfig
    from cdbench.harness.live.step import LiveInfo, LiveStep
    from cdbench.workloads.workload import Workload

Progress = Callable[[str, float], None]
"""Called with the stage (``generating the workload``, ``simulating``) and the fraction of it done (0..1)."""


@dataclass
class RunResult:
    """A finished run.

    Attributes
    ----------
    requests : one row a request (:class:`~cdbench.harness.records.RequestRecord` columns).
    steps : one row a scheduler iteration (:class:`~cdbench.harness.records.StepRecord` columns).
    summary : the metrics (``summary.json``).
    timeline : spans of the first iterations, for the Chrome trace.
    wall_s : wall-clock seconds the simulation took.
    backend_call_s : wall seconds spent inside grammar-backend calls (hybrid; 0 in model mode).
    validation_s : wall seconds spent checking finished outputs against their specs (hybrid).
    compile_errors : specs that failed to compile (spec key → reason, in key order); their
        requests ended with ``abort_reason="compile_error"``.
    workload : the generated (or replayed) workload, with what did not make it into
        its requests (``Workload.report()``); ``None`` for :func:`simulate` on
        requests built by hand.
    grammar_profile : the grammar costs the run measured (hybrid; ``None`` in model mode),
        saved as ``grammar_profile.json``.
    live : where a ``live`` run ran (``None`` in the other modes), saved as ``live.json``.
    rank_steps : a run of several rank processes: each rank's own step records
        (:mod:`cdbench.harness.live.rank_steps`), saved as ``rank_steps.parquet``; ``None`` otherwise.
    tables_written : the tables went to a :class:`RecordSink` as the run went, which wrote them; ``requests``
        and ``steps`` are then empty.
    """

    requests: pd.DataFrame
    steps: pd.DataFrame
    summary: Summary
    timeline: Timeline = field(default_factory=Timeline)
    wall_s: float = 0.0
    backend_call_s: float = 0.0
    validation_s: float = 0.0
    compile_errors: Mapping[str, str] = field(default_factory=dict)  # (a CompileErrors: built when read)
    workload: Workload | None = None
    tables_written: bool = False
    grammar_profile: GrammarProfile | None = None
    live: LiveInfo | None = None
    rank_steps: pd.DataFrame | None = None

    @property
    def outside_backend_share(self) -> float:
        """Share of wall time spent outside grammar-backend calls (hybrid's own overhead).

        Output validation counts as outside: it is cdbench's work, not the engine's.
        """
        return 1.0 - self.backend_call_s / self.wall_s if self.wall_s else 0.0


class RecordSink(Protocol):
    """Where a run's records go as it runs (:class:`cdbench.results.stopped_run.RecordSpill` writes them into the
    run folder): the ended requests' rows in scheduler order and the steps, handed over every ``interval_s``, so
    the run holds neither table in memory and an interrupted or failed run keeps what it finished."""

    interval_s: float
    """Wall seconds between hand-overs (checked every few hundred iterations)."""

    def finished(self, requests: pd.DataFrame) -> None:
        """Rows of requests that ended, following the rows handed over before (``valid`` unchecked)."""

    def steps(self, steps: pd.DataFrame) -> None:
        """Rows of the steps since the last call."""

    def close(self, valid: np.ndarray | None) -> TableSource:
        """Every row was handed over: write the run's tables, ``valid`` (one code a request in scheduler
        order: -1 unchecked, 0 invalid, 1 valid; ``None``: all unchecked) filled in, and read them back."""

    def stopped(self, result: RunResult, total: int, error: BaseException) -> None:
        """The run ended early with ``error``: ``result`` holds the ``total`` requests' finished ones and
        their summary (its tables written by :meth:`close`)."""


def empty_result() -> RunResult:
    """A run that finished nothing (one stopped before its simulation began)."""
    requests, steps = RequestTable(0).to_frame(), StepLog().to_frame()
    return RunResult(requests, steps, summarize(requests, steps, LogHistogram(), LogHistogram()))


def _stopped_result(sched: Scheduler, slo: SLO | None, timeline: Timeline, start: float,
                    executor: GrammarExecutor, sink: RecordSink) -> RunResult:
    """What a run stopped mid-way finished: the ended requests' rows, every step so far, their summary."""
    sched.tallies.flush()  # the buffered per-step counters (summing early changes no value)
    sink.steps(sched.steps.take())
    sink.finished(sched.take_rest())
    summary = summarize_streamed(sink.close(None), sched.itl, sched.fill_hist, slo, sched.idle_iterations,
                                 sched.draft_positions, *kv_description(sched.kv))
    return RunResult(RequestTable(0).to_frame(), StepLog().to_frame(), summary, timeline, time.perf_counter() - start,
                     executor.backend_call_s, executor.validation_s, sched.compile_errors, tables_written=True)


def simulate(requests: Sequence[Request] | Iterable[Request], scheduler: SchedulerConfig, executor: GrammarExecutor,
             gpu: GpuCosts, seed: int = 0, max_concurrency: int | None = None, slo: SLO | None = None,
             trace_steps: int = 2000, progress: Callable[[float], None] | None = None,
             live: LiveStep | None = None, records: RecordSink | None = None,
             count: int | None = None) -> RunResult:
    """Simulate ``requests`` under ``scheduler`` with the given cost sources.

    ``requests`` may also be an iterable that is not held, yielding the requests in scheduler order
    (by arrival, then id), with ``count`` saying how many (:class:`~cdbench.harness.scheduler.Scheduler`).

    ``progress`` is called with the fraction of requests ended (0..1) now and then; ``live``
    runs every step for real instead of pricing it (``live`` mode). ``records`` is handed the
    ended requests' rows and the steps every ``records.interval_s`` seconds, writes the tables
    and gives them back for the summary (computed from them chunk by chunk,
    :func:`~cdbench.harness.streamed.summarize_streamed`: the same figures), and is handed what the
    run finished if it stops early (an interrupt or an error, which is then raised on).
    """
    start = time.perf_counter()
    timeline = Timeline(max_steps=trace_steps)
    n_requests = count if count is not None else len(requests)  # type: ignore[arg-type]
    total = max(n_requests, 1)
    on_progress = (lambda ended: progress(ended / total)) if progress is not None else None
    if records is not None:
        sink, show, due = records, on_progress, start + records.interval_s

        def on_progress(ended: int) -> None:
            nonlocal due
            if show is not None:
                show(ended)
            if time.perf_counter() >= due:
                # steps first: a run killed between the two writes leaves no finished request without its steps
                sink.steps(sched.steps.take())
                sink.finished(sched.take_finished())
                due = time.perf_counter() + sink.interval_s

    sched = Scheduler(scheduler, requests, executor, gpu, count=count, seed=seed, max_concurrency=max_concurrency,
                      timeline=timeline if trace_steps else None, on_progress=on_progress, live=live)
    try:
        sched.run()
    except BaseException as err:  # Ctrl-C included: what finished is kept
        if records is not None:
            records.stopped(_stopped_result(sched, slo, timeline, start, executor, records),
                            n_requests, err)
        raise
    live_info = live.info() if live is not None else None
    if records is not None:
        records.steps(sched.steps.take())
        records.finished(sched.take_finished())
        checked = sched.rec.valid if not sched.reuse and (sched.rec.valid >= 0).any() else None
        summary = summarize_streamed(records.close(checked), sched.itl, sched.fill_hist, slo, sched.idle_iterations,
                                     sched.draft_positions, *kv_description(sched.kv))
        wall_s = time.perf_counter() - start
        return RunResult(RequestTable(0).to_frame(), StepLog().to_frame(), summary, timeline, wall_s,
                         executor.backend_call_s, executor.validation_s, sched.compile_errors,
                         grammar_profile=_profile(executor, n_requests, seed), live=live_info, tables_written=True)
    requests_frame = sched.requests_frame()
    steps_frame = sched.steps.to_frame()
    summary = summarize(requests_frame, steps_frame, sched.itl, sched.fill_hist, slo, sched.idle_iterations,
                        sched.draft_positions, *kv_description(sched.kv))
    summary.time_windows = time_windows(requests_frame, slo)
    wall_s = time.perf_counter() - start
    return RunResult(requests_frame, steps_frame, summary, timeline, wall_s, executor.backend_call_s,
                     executor.validation_s, sched.compile_errors, grammar_profile=_profile(executor, n_requests, seed),
                     live=live_info)


def _profile(executor: GrammarExecutor, n_requests: int, seed: int) -> GrammarProfile | None:
    return executor.measured_profile(f"in situ: measured by a hybrid run of {n_requests} requests, seed {seed}")


def max_context(requests: Sequence[Request], spec_tokens: int = 0) -> int:
    """The longest context any request reaches: prompt, thinking (and its end token), output, drafts."""
    return max((max(1, r.prompt_len) + r.think_len + 1 + max(1, r.output_len) + spec_tokens for r in requests),
               default=1)


def run(config: RunConfig, progress: Progress | None = None, records: RecordSink | None = None) -> RunResult:
    """Run ``config``: generate its workload, build its cost sources, simulate.

    ``progress`` is called with the stage and its fraction done: the share of
    requests built while the workload is generated, then of requests ended.
    ``records`` as in :func:`simulate`.
    """
    # Imported here so that simulate() stays usable without the workload generator's dependencies.
    from cdbench.backends.registry import create_backend
    from cdbench.backends.vocab import load_vocab
    from cdbench.harness.executors.hybrid import HybridExecutor
    from cdbench.harness.executors.model import ModelExecutor
    from cdbench.workloads.generator import generate

    # Each stage names itself before its first slow step, so the progress display moves from the start.
    if progress is not None:
        progress(f"loading the {config.vocab} vocabulary", 0.0)
    vocab = load_vocab(config.vocab)
    spec_decode = config.workload.spec_decode  # (a replayed trace's workload takes the config's too)
    scheduler = config.scheduler_config(spec_tokens=spec_decode.k, spec_drafter=spec_decode.drafter)
    # several ranks as processes (live mode: one a GPU) or data-parallel ranks: cdbench.harness.live.ranks
    ranked = scheduler.ranks > 1 and (config.mode == "live" or scheduler.parallel == "dp")
    # a streamed model run of a generated workload never holds its requests: they are built as the spec
    # pricing reads them, and again as the scheduler enters them (the trace file's, a third time)
    streamed = config.mode == "model" and records is not None and config.workload.trace is None and not ranked
    workload = generate(config.workload, vocab, progress=False,  # the caller owns the progress display
                        on_progress=(lambda f: progress("generating the workload", f)) if progress else None,
                        held=not streamed)
    gpu = config.costs.gpu_costs()
    live = None
    if config.mode == "live" and not ranked:
        if progress is not None:
            progress(f"building {config.costs.model} on the GPU", 0.0)
        live = config.costs.live_step(max_context(workload.requests, spec_decode.k),
                                      scheduler.cuda_graph_sizes, scheduler.kv_block_size,
                                      scheduler.max_running_requests,
                                      spec_decode.k if spec_decode.drafter == "mtp" else 0,
                                      memory_fraction=scheduler.kv_memory_fraction,
                                      max_tokens=scheduler.max_batched_tokens, spec_tokens=spec_decode.k)
    if config.mode in ("hybrid", "live"):
        if progress is not None:
            progress(f"loading {config.backend.name}", 0.0)
        if ranked:  # each rank builds its own backend
            from cdbench.harness.live.ranks import HybridExecutors

            executors: Callable[[], GrammarExecutor] = HybridExecutors(
                config.backend.name, dict(config.backend.options), config.vocab, spec_decode.alpha,
                workload.config.seed, workload.pools, config.seed)
        else:
            backend = create_backend(config.backend.name, vocab, **config.backend.options)
            executor: GrammarExecutor = HybridExecutor(backend, spec_decode.alpha, workload.draft_source(vocab),
                                                       seed=config.seed)
    else:
        costs = config.costs.grammar_costs(config.backend.name, config.seed, config.backend.options,
                                           requests=workload.iter_requests if streamed else workload.requests,
                                           vocab=config.vocab, progress=progress)
        coverage = getattr(costs, "coverage", None)
        executor = ModelExecutor(costs, spec_decode.alpha)
        executors = partial(ModelExecutor, costs, spec_decode.alpha)
    if ranked:
        result = _simulate_ranked(config, workload, scheduler, gpu, executors, progress)
    else:
        result = simulate(workload.iter_requests() if streamed else workload.requests, scheduler, executor, gpu,
                          count=config.workload.num_requests if streamed else None, seed=config.seed,
                          max_concurrency=workload.max_concurrency, slo=config.slo,
                          trace_steps=config.trace_steps,
                          progress=(lambda f: progress("simulating", f)) if progress else None, live=live,
                          records=records,
                          )
    result.workload = workload
    if config.mode == "model":
        result.summary.spec_costs = coverage
    if isinstance(gpu, RooflineGpuCosts) and config.mode != "live":
        result.summary.forward_calibration = gpu.forward.calibration_source
        result.summary.forward_speed = gpu.forward.speed
    return result


def _simulate_ranked(config: RunConfig, workload: Workload, scheduler: SchedulerConfig,
                     gpu: GpuCosts, executors: Callable[[], GrammarExecutor], progress: Progress | None) -> RunResult:
    """A run of several ranks (:mod:`cdbench.harness.live.ranks`), each building its grammar executor from
    ``executors``: live mode's as processes, one a GPU."""
    from cdbench.harness.costs.hardware import resolve_model
    from cdbench.harness.live.ranks import LiveSpec, RankJob, simulate_ranks

    spec_decode = workload.config.spec_decode
    live = None
    if config.mode == "live":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("mode 'live' runs every step on a CUDA GPU; this machine has none "
                             "(hybrid mode runs the same grammar work with the GPU modelled)")
        live = LiveSpec(resolve_model(config.costs.model), config.costs.logits_width(),
                        max_context(workload.requests, spec_decode.k), "cuda", config.costs.live_kv_tokens,
                        logits_dtype=str(config.costs.logits_dtype()).removeprefix("torch."),
                        graph_sizes=tuple(scheduler.cuda_graph_sizes), block_size=scheduler.kv_block_size,
                        max_requests=scheduler.max_running_requests, memory_fraction=scheduler.kv_memory_fraction,
                        max_tokens=scheduler.max_batched_tokens, spec_tokens=spec_decode.k)
    if progress is not None:
        progress(f"running {scheduler.ranks} {scheduler.parallel.upper()} ranks", 0.0)
    job = RankJob(scheduler.parallel, tuple(workload.requests), scheduler, executors, gpu, live, config.seed,
                  workload.max_concurrency, config.trace_steps)
    ranked = simulate_ranks(job, config.slo, (lambda f: progress("simulating", f)) if progress else None)
    return RunResult(ranked.requests, ranked.steps, ranked.summary, ranked.timeline, ranked.wall_s,
                     ranked.backend_call_s, ranked.validation_s, ranked.compile_errors,
                     grammar_profile=ranked.grammar_profile, live=ranked.live, rank_steps=ranked.rank_steps)
