"""A run's compiles in run order, timed the way the spec-cost store times them and the ways a live process meets them.

``model`` mode prices a run's compiles by the store's run-order sequence (``measure_sequence``: a worker
process compiles the run's specs one after another on one fresh engine). On an H200 host, live runs compiled
the same specs in the same order at 1.12-1.22x the stored sequence (``reports/fidelity/live_vs_model.md``,
"Out of sample again"), while on a 2-core machine without a GPU a process compiling serially matched it.
This benchmark compiles a trace's run order in five conditions, in rotated order each round, all on the CPUs
this process may use:

- ``worker``: the store's own path (``measure_sequence``, one repeat, into a scratch store);
- ``process``: a spawned process that never touches the device, compiling on its main thread on an engine that
  keeps every grammar, as live and hybrid modes do;
- ``idle``: this process, a model's weights and a captured decode step on the device, nothing running;
- ``inflight``: the same with steps in flight, as a live run's scheduler compiles between a step's launch and
  its end: ``--queued`` steps launched before each compile, waited for after it;
- ``busy``: the same while a thread replays that decode step back to back and waits for each (a CUDA graph on
  a GPU; the wait may hold a core).

    taskset -c 0-3 python benchmarks/compile_order_beside_forward.py RUN/workload.trace.jsonl --out compiles.csv

Prints each condition's sum per round and, per band of the worker's time, the median ratio of each
condition over ``worker`` in the same round.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_beside_forward import StepLoop, timed, write_rows  # noqa: E402

from cdbench.backends.base import ConstraintSpec  # noqa: E402
from cdbench.backends.registry import create_backend  # noqa: E402
from cdbench.backends.vocab import load_vocab  # noqa: E402
from cdbench.harness.costs.spec_costs import SpecCostSettings, measure_sequence, run_order  # noqa: E402
from cdbench.workloads.trace import read_trace  # noqa: E402

BANDS = [(0.0, 0.01), (0.01, 0.2), (0.2, float("inf"))]
CONDITIONS = ("worker", "process", "idle", "inflight", "busy")


def compile_in_order(backend: str, vocab: str, specs: list[ConstraintSpec],
                     before: Callable[[], object] | None = None, after: Callable[[], object] | None = None,
                     ) -> list[float | None]:
    """Each spec's compile seconds on one fresh engine that keeps every grammar, as a live run's engine
    meets them (``None``: it failed); ``before`` and ``after`` each compile, untimed."""
    engine = create_backend(backend, load_vocab(vocab))
    kept, times = [], []
    for spec in specs:
        if before is not None:
            before()
        times.append(timed(engine, spec, kept))
        if after is not None:
            after()
    return times


def _process_main(conn, backend: str, vocab: str, specs: list[ConstraintSpec]) -> None:
    conn.send(compile_in_order(backend, vocab, specs))


def in_process(backend: str, vocab: str, specs: list[ConstraintSpec]) -> list[float | None]:
    """:func:`compile_in_order` in a spawned process, which never imports the device's runtime state."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_process_main, args=(there, backend, vocab, specs))
    proc.start()
    times = here.recv()
    proc.join()
    return times


def in_worker(backend: str, vocab: str, specs: list[ConstraintSpec]) -> list[float | None]:
    with tempfile.TemporaryDirectory() as store:
        settings = SpecCostSettings(spec_store=store, measure_repeats=1)
        return measure_sequence(specs, backend, {}, vocab, settings).compile_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a run's workload trace (workload.trace.jsonl)")
    parser.add_argument("--backend", default="xgrammar")
    parser.add_argument("--vocab", default=None, help="default: the trace's")
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64, help="decode rows of the busy condition's step")
    parser.add_argument("--kv", type=int, default=1024, help="cached tokens a row of that step")
    parser.add_argument("--queued", type=int, default=4, help="steps in flight over each compile (inflight)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="CSV: one row a (round, condition, spec)")
    args = parser.parse_args(argv)

    workload = read_trace(args.trace).workload
    vocab = args.vocab or workload.vocab_name
    ordered = run_order(workload.requests, args.backend, vocab)
    specs = [o.spec for o in ordered]
    print(f"{len(specs)} specs in run order ({args.backend}, {vocab}); rounds of {', '.join(CONDITIONS)}")
    loop = StepLoop(args.model, args.device, args.rows, args.kv)

    def launch() -> None:
        for _ in range(args.queued):
            loop.replay()

    def wait() -> None:
        if loop.cuda:
            torch.cuda.synchronize(loop.ref.device)
    run = {
        "worker": lambda: in_worker(args.backend, vocab, specs),
        "process": lambda: in_process(args.backend, vocab, specs),
        "idle": lambda: compile_in_order(args.backend, vocab, specs),
        "inflight": lambda: compile_in_order(args.backend, vocab, specs, launch, wait),
    }
    rows = []
    for round_ in range(args.rounds):
        times: dict[str, list[float | None]] = {}
        steps = 0
        shift = round_ % len(CONDITIONS)
        for condition in CONDITIONS[shift:] + CONDITIONS[:shift]:
            start = time.perf_counter()
            if condition == "busy":
                with loop:
                    before = loop.steps
                    times[condition] = compile_in_order(args.backend, vocab, specs)
                    steps = loop.steps - before
            else:
                times[condition] = run[condition]()
            print(f"round {round_} {condition:8} sum {sum(t for t in times[condition] if t is not None):7.2f} s "
                  f"(wall {time.perf_counter() - start:6.1f} s)" + (f", {steps} steps beside" if condition == "busy"
                                                                   else ""), flush=True)
        for at, o in enumerate(ordered):
            rows += [{"round": round_, "condition": c, "spec": o.label, "order": at, "compile_s": times[c][at]}
                     for c in CONDITIONS]
        both = [at for at in range(len(specs)) if all(times[c][at] is not None for c in CONDITIONS)]
        for low, high in BANDS:
            band = [at for at in both if low <= times["worker"][at] < high]
            if band:
                ratios = " ".join(f"{c} {statistics.median(times[c][at] / times['worker'][at] for at in band):.3f}"
                                  for c in CONDITIONS[1:])
                print(f"  worker {low:g}-{high:g} s: {len(band)} specs, over worker: {ratios}")
        sums = {c: sum(times[c][at] for at in both) for c in CONDITIONS}
        print("  sums over worker: " + " ".join(f"{c} {sums[c] / sums['worker']:.3f}" for c in CONDITIONS[1:]))
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
