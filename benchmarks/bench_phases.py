"""Where a ``model`` run's simulation CPU goes: each phase of the scheduler loop's µs and calls a request.

Asks issue 32's question of speed (a million requests in under 100 s of simulation on one core: 100 µs a
request): the built-in default workload at N requests, run and saved as ``cdbench run --mode model -n N``
runs it, in this process. Two runs: the first times each phase (the CPU seconds of its calls, on the
thread's clock: what other work on the core takes is not counted); the second counts what each phase
calls (the calls into Python functions, and into C: numpy's functions and methods among them; an array
operator such as ``a + b`` calls no function and is not counted), its clock slowed by the counting.
Phases: a decode run (``Scheduler._decode_run``: identical decode steps taken at once, or ``None`` where
the iteration runs alone), an iteration (``_iterate``: polls, admission, a prompt's step), an arrival
(``_arrive``: the compile, the request's cost pools), the requests entered ahead of their arrival
(``_enter_ahead``: their accept rows and curves drawn together), the step log's hand-over to the records
(``StepLog.take``), the requests' (``take_finished``), and the summary read back from the streamed tables
(``summarize_streamed``); ``other`` is the rest of the simulation stage (the event loop, the workload's
generator, the tables' writes).

Run from the repository root of the tree to measure::

    python benchmarks/bench_phases.py --requests 30000 --core 1

Found (2-CPU x86-64 machine shared with other work, default workload, 30,000 requests on core 1, at 897307a;
``reports/scheduler_benchmark.md``, the section of 2026-11-28 "Model mode's CPU a request, phase by phase")::

    phase                   µs a request   calls   Python calls a request   C calls     numpy
    decode run                     118.8    1.90                     77.7     120.1      38.7
    iteration                       55.5    1.05                     51.0      64.8      14.1
    entered ahead                   50.4    0.00                     42.4      48.8       1.4
    arrival                         28.3    1.00                     28.5      26.5       3.2
    step log hand-over              21.2    0.00                      2.9       2.4       0.1
    requests hand-over               1.2    0.00                      1.1       3.2       0.0
    summary read back                8.7    0.00                      4.6       4.2       0.4
    other                           35.8       -                     12.5      19.3       0.0
    simulation                     320.0       -                    220.7     289.5      57.9

The phases' CPU spreads by 5 to 10 % from run to run where other work shares the machine (a decode run's
118.8 to 127.4 µs in two runs of one tree); the counts do not move.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

# (phase, the object whose attribute runs it, that attribute): summarize_streamed as run.py calls it
PHASES = [
    ("decode run", "cdbench.harness.scheduler:Scheduler", "_decode_run"),
    ("iteration", "cdbench.harness.scheduler:Scheduler", "_iterate"),
    ("entered ahead", "cdbench.harness.scheduler:Scheduler", "_enter_ahead"),
    ("arrival", "cdbench.harness.scheduler:Scheduler", "_arrive"),
    ("step log hand-over", "cdbench.harness.records:StepLog", "take"),
    ("requests hand-over", "cdbench.harness.scheduler:Scheduler", "take_finished"),
    ("summary read back", "cdbench.harness.run", "summarize_streamed"),
]


def _owner(where: str) -> object:
    module, _, cls = where.partition(":")
    owner = importlib.import_module(module)
    return getattr(owner, cls) if cls else owner


def simulate(n: int) -> float:
    """``cdbench run --mode model -n n`` into a temporary folder, without its report: its simulation stage's
    CPU seconds (from ``simulating`` to ``saving the results``, as ``bench_streaming.py`` reads them)."""
    from cdbench.cli.support import load_run_tree
    from cdbench.results.run_config import validate_run_config
    from cdbench.results.run_folder import record_run

    tree, source = load_run_tree(None, {"mode": "model", "requests": n}, [])
    config = validate_run_config(tree, source)
    stages: dict[str, float] = {}
    record_run(config, Path(tempfile.mkdtemp()) / "run", finish=lambda run: None,
               progress=lambda stage, fraction: stages.setdefault(stage, time.process_time()))
    return stages["saving the results"] - stages["simulating"]


def timed(n: int) -> tuple[float, dict[str, tuple[int, float]]]:
    """A run's simulation CPU seconds and each phase's calls and CPU seconds (its calls timed in a wrapper on the
    thread's clock: a core shared with other work does not count the time they take)."""
    tallies: dict[str, list] = {}
    originals = []
    for phase, where, name in PHASES:
        owner = _owner(where)
        original, tally = getattr(owner, name), tallies.setdefault(phase, [0, 0.0])
        originals.append((owner, name, original))

        def timing(*args, _f: Callable = original, _tally: list = tally, **kwargs):
            start = time.thread_time()
            try:
                return _f(*args, **kwargs)
            finally:
                _tally[0] += 1
                _tally[1] += time.thread_time() - start

        setattr(owner, name, timing)
    try:
        cpu = simulate(n)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return cpu, {phase: (calls, seconds) for phase, (calls, seconds) in tallies.items()}


def counted(n: int) -> dict[str, tuple[int, int, int]]:
    """Each phase's calls into Python functions, into C, and into numpy's C functions and methods, over a run's
    simulation stage (``other``: outside the phases), counted by a profile hook."""
    code_of = {getattr(_owner(where), name).__code__: phase for phase, where, name in PHASES}
    python, c_calls, numpy_calls = Counter(), Counter(), Counter()
    stack: list[tuple[str, object]] = []  # the phases entered, innermost last, with their frames

    def hook(frame, event: str, arg) -> None:
        if event == "call":
            phase = code_of.get(frame.f_code)
            if phase is not None:
                stack.append((phase, frame))
            python[stack[-1][0] if stack else "other"] += 1
        elif event == "return":
            if stack and stack[-1][1] is frame:
                stack.pop()
        elif event == "c_call":
            phase = stack[-1][0] if stack else "other"
            c_calls[phase] += 1
            owner = getattr(arg, "__self__", None)
            if (getattr(arg, "__module__", None) or type(owner).__module__ or "").startswith("numpy"):
                numpy_calls[phase] += 1

    from cdbench.results import run_folder

    record_run = run_folder.record_run

    def counting(*args, progress, **kwargs):  # the hook set from the simulation's start to its save
        def on_stage(stage: str, fraction: float) -> None:
            if stage == "simulating":
                sys.setprofile(hook)
            elif stage == "saving the results":
                sys.setprofile(None)
            progress(stage, fraction)

        try:
            return record_run(*args, progress=on_stage, **kwargs)
        finally:
            sys.setprofile(None)

    run_folder.record_run = counting
    try:
        simulate(n)
    finally:
        run_folder.record_run = record_run
    return {phase: (python[phase], c_calls[phase], numpy_calls[phase]) for phase in python}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30_000)
    parser.add_argument("--core", type=int, default=None, help="pin this process to this CPU core")
    args = parser.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    n = args.requests
    cpu, times = timed(n)
    counts = counted(n)
    # the phases do not nest (an open loop issues its next arrival from the event loop), so the rest is theirs
    times["other"] = (None, cpu - sum(seconds for _, seconds in times.values()))
    times["simulation"] = (None, cpu)
    counts["simulation"] = tuple(sum(v[i] for v in counts.values()) for i in range(3))
    print(f"{'phase':22s} {'µs a request':>13s} {'calls':>7s} {'Python calls a request':>24s} {'C calls':>9s} "
          f"{'numpy':>9s}")
    for phase in [*(phase for phase, _, _ in PHASES), "other", "simulation"]:
        calls, seconds = times[phase]
        python, c_calls, numpy_calls = counts.get(phase, (0, 0, 0))
        share = "-" if calls is None else f"{calls / n:.2f}"
        print(f"{phase:22s} {seconds / n * 1e6:13.1f} {share:>7s} {python / n:24.1f} {c_calls / n:9.1f} "
              f"{numpy_calls / n:9.1f}")


if __name__ == "__main__":
    main()
