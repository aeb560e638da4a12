"""Does a long ``model`` run fit? Peak memory and simulation CPU of ``cdbench run --mode model -n N``.

Asks issue 32's question: the built-in default workload at N requests (its
``model`` mode, no trace), run and saved as ``cdbench run`` does (records streamed
to the run folder, the report built), each size in a fresh process pinned to
one core. Prints per size the peak resident memory, the CPU time of the
simulation stage (from the start of ``simulating`` to ``saving the results``:
building each request's cost pools as it arrives, the loop, the summary read
back from the streamed tables) and of the whole command, then the growth of
memory per request between sizes (0 would be memory independent of the run's
length).

Run from the repository root (sizes as you like; each takes its own time); ``--tree`` runs
other source trees in turn with this one (e.g. ``main`` exported with ``git archive``), each
size and round in each tree before the next::

    python benchmarks/bench_streaming.py --requests 20000 40000 --core 1
    python benchmarks/bench_streaming.py --requests 20000 --rounds 2 --core 1 --tree /tmp/main --tree .

Found (2-CPU x86-64 machine shared with other work, default workload, each run
pinned to one core, at 57511d6; ``main`` before it took 1.4-1.5 ms a request,
``reports/scheduler_benchmark.md``)::

       20000 requests: peak  749.5 MiB (at the end of the simulation  656.4 MiB), simulation   19.4 s CPU (968 µs a request)
      100000 requests: peak 1324.1 MiB (at the end of the simulation  910.1 MiB), simulation   82.6 s CPU (826 µs a request)
     1000000 requests: peak 7872.4 MiB (at the end of the simulation 2829.2 MiB), simulation  807.0 s CPU (807 µs a request)

(At 9ca3a41 a million requests peak at about 2.4 GB, when the scheduler is built: the report reads the
tables a row group at a time and the workload is released for the simulation; at d63b13a about 2,025 MiB,
corpus copies sharing their item's spec and prices; ``reports/scheduler_benchmark.md``, issue 32's section.) Before that, the issue's targets were not met: a million requests take 13 minutes of simulation
on one core, not 100 s (about 9 steps a request of dozens of small numpy calls each,
and each structured request's own cost pools drawn as it arrives), and memory grows
with the run's length: about 2.2 kB a request at the simulation's end (the workload
generated whole, the per-request state of the scheduler and its spec bookkeeping;
see ``cdbench/harness/footprint.py``) and about 7 kB a request in all, the report
reading the request and step tables whole. Before the records were streamed and the
cost pools held for the requests in flight only, 20,000 requests peaked at 4.4 GB
(``/usr/bin/time -v cdbench run --mode model -n 20000``; 875 MB after).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

_CHILD = """
import json, resource, sys, tempfile, time
from pathlib import Path
from cdbench.cli.support import load_run_tree
from cdbench.reports.run_report import build_report
from cdbench.results.run_config import validate_run_config
from cdbench.results.run_folder import record_run

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()

def mark(stage):  # a line a stage as it starts, so a run stopped at its time limit still tells how far it got
    print(json.dumps({"stage": stage, "cpu_s": cpu() - start, "peak_bytes": peak(), "rss_bytes": rss()}), flush=True)

seen = set()
def progress(stage, fraction):
    if stage not in seen:
        seen.add(stage)
        mark(stage.split(" ")[0] if stage.startswith("loading") else stage)

tree, source = load_run_tree(None, {"mode": "model", "requests": int(sys.argv[1])}, [])
config = validate_run_config(tree, source)
start = cpu()
record_run(config, Path(tempfile.mkdtemp()) / "run", progress=progress, finish=lambda run: (mark("report"), build_report(run)))
mark("end")
"""


def measure(requests: int, core: int | None, tree: Path, limit_s: float | None) -> dict[str, dict[str, float]]:
    """One run of ``requests`` in a fresh process importing cdbench from ``tree``: each stage's CPU seconds,
    peak and resident memory as it started (``end``: the whole run's), up to the ``limit_s`` wall seconds."""
    pin = ["taskset", "-c", str(core)] if core is not None else []
    env = {**os.environ, "PYTHONPATH": str(tree)}
    stages: dict[str, dict[str, float]] = {}
    with subprocess.Popen([*pin, sys.executable, "-c", _CHILD, str(requests)], stdout=subprocess.PIPE, text=True,
                          env=env, cwd=tree) as child:
        timer = threading.Timer(limit_s, child.kill) if limit_s else None
        if timer is not None:
            timer.start()
        for line in child.stdout:
            if line.startswith("{"):
                row = json.loads(line)
                stages[row.pop("stage")] = row
        child.wait()
        if timer is not None:
            timer.cancel()
    return stages


def describe(n: int, stages: dict[str, dict[str, float]]) -> str:
    mib = 2**20
    parts = []
    if "simulating" in stages:
        parts.append(f"at the simulation's start {stages['simulating']['peak_bytes'] / mib:7.1f} MiB")
    if "saving the results" in stages:
        sim_cpu = stages["saving the results"]["cpu_s"] - stages["simulating"]["cpu_s"]
        parts.append(f"at its end {stages['saving the results']['peak_bytes'] / mib:7.1f} MiB")
        parts.append(f"before the report {stages['report']['peak_bytes'] / mib:7.1f} MiB" if "report" in stages else "")
        parts.append(f"simulation {sim_cpu:7.1f} s CPU ({sim_cpu / n * 1e6:.0f} µs a request)")
    if "end" in stages:
        return (f"{n:>9} requests: peak {stages['end']['peak_bytes'] / mib:7.1f} MiB ("
                + ", ".join(p for p in parts if p) + f"), whole run {stages['end']['cpu_s']:7.1f} s CPU")
    if not stages:
        return f"{n:>9} requests: stopped at the time limit before its first stage"
    last, row = list(stages.items())[-1]
    return (f"{n:>9} requests: stopped at the time limit after stage {last!r} ({row['cpu_s']:.1f} s CPU, peak "
            f"{row['peak_bytes'] / mib:.1f} MiB then; " + ", ".join(p for p in parts if p) + ")")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[20_000, 40_000])
    parser.add_argument("--core", type=int, default=None, help="pin each run to this CPU core (taskset)")
    parser.add_argument("--tree", type=Path, action="append",
                        help="a source tree to import cdbench from (repeat to compare trees, run in turn per size "
                             "and round); default: this repository")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each size in each tree")
    parser.add_argument("--limit-s", type=float, default=None,
                        help="wall seconds a run may take; one past it is stopped and reported as far as it got")
    args = parser.parse_args()
    trees = [t.resolve() for t in args.tree] if args.tree else [Path(__file__).resolve().parents[1]]
    rows: dict[Path, list[tuple[int, int]]] = {tree: [] for tree in trees}
    for n in args.requests:
        for _ in range(args.rounds):
            for tree in trees:
                load = os.getloadavg()[0]
                stages = measure(n, args.core, tree, args.limit_s)
                if "end" in stages:
                    rows[tree].append((n, stages["end"]["peak_bytes"]))
                print(f"{tree}: {describe(n, stages)}; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after",
                      flush=True)
    for tree, sizes in rows.items():
        firsts = {n: p for n, p in reversed(sizes)}  # each size's first run
        ordered = sorted(firsts.items())
        for (n0, p0), (n1, p1) in zip(ordered, ordered[1:]):
            print(f"{tree}: {n0} -> {n1} requests: {(p1 - p0) / (n1 - n0):.0f} bytes of peak memory a request")


if __name__ == "__main__":
    main()
