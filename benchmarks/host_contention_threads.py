"""Host CPU contention measured with real threads: a scheduler step's CPU work beside N running compiles.

The simulator's contention model (``cdbench/harness/contention.py``) stretches a step's host CPU work by
(running compiles + the loop) / cores once they outnumber the cores. This script measures that on this
machine, the way an engine shares it: compile threads in the scheduler's process loop over real compiles of
a corpus's specs (the backend's own compile cache off), while the main thread runs steps of real work: mask
fills of a batch of matchers (native code) and a fixed piece of pure-Python work (the engine's own Python).

Two measurements:

* **GIL**: how late a thread that sleeps 1 ms wakes while a compile runs in a thread of the process and in a
  separate process (a compile that held the GIL would delay the thread in the first case only);
* **cores**: per number of compile threads N (0..``--max-compiles``, in shuffled order, ``--rounds`` times), a
  step's wall time against N = 0 — its mean (the loop's throughput: what processor sharing predicts), its
  median and p99 (the kernel hands out time slices of milliseconds, so a short step is either untouched or
  waits a whole slice) — the main thread's cores, the compile threads' (their CPU seconds per second) and
  the other processes' (from ``/proc/stat``, since the machine is shared).

Prints markdown tables. Run from the repository root:

    .venv/bin/python benchmarks/host_contention_threads.py [--backend xgrammar] [--rounds 3] [--max-compiles 4]

Found (this 2-core development VM, xgrammar on Kubernetes schemas; reports/spec_costs/contention.md): a compile
thread delays a 1-ms sleeper no more than a compile process does (p99 4.0 ms either way: the cores are shared,
the GIL is not held); a step's mean stretch grows with the compiles beside it (1.9-2.3x with one, 3.3x with two)
while its median stays at 1.01-1.08x and its p99 goes to 3.4-12.9x: the kernel hands out millisecond slices, so
a short step either runs whole or waits one out. xgrammar's compiles use more than one core (its max_threads 8),
which is why scheduler.compile_cores exists.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import threading
import time
from pathlib import Path
from time import perf_counter, process_time, thread_time

import numpy as np

from cdbench.backends import ConstraintSpec, create_backend

CORPUS = Path(__file__).resolve().parents[1].parent / "shared/corpora/jsonschemabench_kubernetes_sampled.jsonl"
NO_CACHE = {"xgrammar": {"compiler_cache": False}}  # every compile a real one


def load_specs(path: Path) -> list[ConstraintSpec]:
    return [ConstraintSpec(d["kind"], d["spec"]) for d in map(json.loads, path.read_text().splitlines())]


def compile_loop(backend_name: str, vocab: str, path: Path, stop, ready, offset: int) -> None:
    """Compile the corpus's specs one after another (from ``offset``) until ``stop`` is set."""
    backend = create_backend(backend_name, vocab, **NO_CACHE.get(backend_name, {}))
    specs = load_specs(path)
    ready.set()
    i = offset
    while not stop.is_set():
        try:
            backend.compile(specs[i % len(specs)])
        except Exception:  # noqa: BLE001 (a spec the backend refuses still took its compile's time)
            pass
        i += 1


def python_work(n: int = 20_000) -> int:
    """A fixed piece of pure-Python work (about 1 ms alone on a 2020s core)."""
    x = 0
    for k in range(n):
        x += k * k
    return x


def cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def gil_latency(backend_name: str, vocab: str, path: Path, seconds: float) -> list[tuple[str, float, float, float]]:
    """Sleep-1-ms overshoot percentiles (ms) with no compile, a compile thread and a compile process."""
    rows = []
    for where in ("none", "thread", "process"):
        workers = []
        if where != "none":
            events = threading.Event if where == "thread" else mp.Event
            stop, ready = events(), events()
            kind = threading.Thread if where == "thread" else mp.Process
            workers = [kind(target=compile_loop, args=(backend_name, vocab, path, stop, ready, 0), daemon=True)]
            workers[0].start()
            ready.wait()
            time.sleep(0.3)
        late = []
        end = perf_counter() + seconds
        while perf_counter() < end:
            t0 = perf_counter()
            time.sleep(0.001)
            late.append((perf_counter() - t0 - 0.001) * 1e3)
        if workers:
            stop.set()
            workers[0].join()
        rows.append((where, *np.percentile(late, [50, 99]).tolist(), max(late)))
    return rows


class Step:
    """A step's CPU work: fill every row of a batch of matchers (native), then the fixed Python work."""

    def __init__(self, backend_name: str, vocab: str, specs: list[ConstraintSpec], rows: int) -> None:
        backend = create_backend(backend_name, vocab)
        grammars = []
        for spec in specs:
            try:
                grammars.append(backend.compile(spec))
            except Exception:  # noqa: BLE001
                continue
            if len(grammars) == 4:
                break
        self.fills = [backend.matcher(grammars[i % len(grammars)]).fill_mask for i in range(rows)]
        self.mask = backend.allocate_mask(rows)

    def run(self) -> tuple[float, float]:
        t0 = perf_counter()
        for row, fill in enumerate(self.fills):
            fill(self.mask, row)
        t1 = perf_counter()
        python_work()
        return t1 - t0, perf_counter() - t1


def measure(step: Step, n: int, where: str, args: argparse.Namespace) -> dict:
    """Steps for ``args.window`` seconds beside ``n`` compiles looping in threads of this process, or
    in processes of their own (``where``: "thread" or "process")."""
    events, kind = (threading.Event, threading.Thread) if where == "thread" else (mp.Event, mp.Process)
    stop = events()
    readies = [events() for _ in range(n)]
    threads = [kind(target=compile_loop, daemon=True, args=(args.backend, args.vocab, args.corpus, stop, ready, 17 * i))
               for i, ready in enumerate(readies)]
    for thread in threads:
        thread.start()
    for ready in readies:
        ready.wait()
    time.sleep(0.3)
    walls = []
    busy0, total0 = cpu_busy()
    wall0, proc0, main0 = perf_counter(), process_time(), thread_time()
    while perf_counter() - wall0 < args.window:
        walls.append(sum(step.run()))
    wall = perf_counter() - wall0
    proc, main = process_time() - proc0, thread_time() - main0
    busy1, total1 = cpu_busy()
    stop.set()
    for thread in threads:
        thread.join()
    machine = (busy1 - busy0) / (total1 - total0) * os.cpu_count()  # cores busy, all processes
    return dict(walls=walls, mean=wall / len(walls), main_cores=main / wall, process_cores=proc / wall,
                machine_cores=machine, load=os.getloadavg()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="xgrammar")
    parser.add_argument("--vocab", default="qwen3.6")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="JSONL corpus whose specs are compiled")
    parser.add_argument("--rows", type=int, default=32, help="mask rows a step fills")
    parser.add_argument("--max-compiles", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=1.5, help="seconds of steps per measurement")
    parser.add_argument("--gil-seconds", type=float, default=2.0, help="0: skip the GIL measurement")
    args = parser.parse_args()
    mp.set_start_method("fork")
    print(f"host: {os.cpu_count()} CPUs; load average (1, 5, 15 min): "
          + ", ".join(f"{x:.2f}" for x in os.getloadavg()))

    if args.gil_seconds > 0:
        print(f"\n### GIL: a thread sleeping 1 ms wakes late by (ms), {args.backend} compiles looping beside it\n")
        print("| compile in | p50 | p99 | max |\n|---|---:|---:|---:|")
        for where, p50, p99, worst in gil_latency(args.backend, args.vocab, args.corpus, args.gil_seconds):
            print(f"| {where} | {p50:.2f} | {p99:.2f} | {worst:.2f} |")

    step = Step(args.backend, args.vocab, load_specs(args.corpus), args.rows)
    cases = [(n, where) for n in range(args.max_compiles + 1) for where in ("thread", "process") if n or where == "thread"]
    results: dict[tuple[int, str], list[dict]] = {case: [] for case in cases}
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(cases)
        for n, where in cases:
            results[n, where].append(measure(step, n, where, args))
    print(f"\n### Cores: a step ({args.rows} {args.backend} fills, then ~1 ms of Python) beside N compiles, "
          f"{args.rounds} rounds of {args.window} s\n")
    print("Stretch: against no compile. Cores: CPU seconds per second of the main thread, of this process (the "
          "main thread and any compile threads) and of the whole machine (every process, compile processes "
          "and other users' included).\n")
    print("| N | compiles in | steps | mean ms | mean stretch | model (N + 1) / cores | median stretch | p99 stretch | "
          "main | process | machine | load |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for n, where in sorted(results):
        rs = results[n, where]
        walls = np.concatenate([r["walls"] for r in rs])
        mean = float(np.mean([r["mean"] for r in rs]))  # (each round's window over its steps: the loop's pace)
        median, p99 = np.percentile(walls, [50, 99]).tolist()
        base = base or (mean, median, p99)
        model = max(1.0, (n + 1) / os.cpu_count())
        cores = [statistics.median(r[key] for r in rs) for key in ("main_cores", "process_cores", "machine_cores")]
        print(f"| {n} | {where if n else '-'} | {len(walls)} | {mean * 1e3:.3f} | {mean / base[0]:.2f} | {model:.2f} | "
              f"{median / base[1]:.2f} | {p99 / base[2]:.2f} | " + " | ".join(f"{c:.2f}" for c in cores)
              + f" | {statistics.median(r['load'] for r in rs):.1f} |")
    print("\nload average after (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
