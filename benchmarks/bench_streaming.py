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

Run from the repository root (sizes as you like; each takes its own time)::

    python benchmarks/bench_streaming.py --requests 20000 40000 --core 1

Found (2-CPU x86-64 machine shared with other work, default workload, branch
``streaming`` at the commit that added this file)::

    see the commit message and docs/architecture.md (footprint.py) for the
    numbers of the run that set footprint.BYTES_PER_REQUEST
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = """
import json, resource, sys, tempfile, time
from pathlib import Path
from cdbench.cli.support import load_run_tree
from cdbench.reports.run_report import build_report
from cdbench.results.run_folder import record_run, validate_run_config

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

stages = {}
def progress(stage, fraction):
    stages.setdefault(stage, cpu())

tree, source = load_run_tree(None, {"mode": "model", "requests": int(sys.argv[1])}, [])
config = validate_run_config(tree, source)
start = cpu()
record_run(config, Path(tempfile.mkdtemp()) / "run", progress=progress, finish=build_report)
end = cpu()
print(json.dumps({"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "simulate_cpu_s": stages["saving the results"] - stages["simulating"], "cpu_s": end - start}))
"""


def measure(requests: int, core: int | None) -> dict[str, float]:
    pin = ["taskset", "-c", str(core)] if core is not None else []
    out = subprocess.run([*pin, sys.executable, "-c", _CHILD, str(requests)], stdout=subprocess.PIPE, text=True,
                         check=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[20_000, 40_000])
    parser.add_argument("--core", type=int, default=None, help="pin each run to this CPU core (taskset)")
    args = parser.parse_args()
    rows = []
    for n in args.requests:
        row = measure(n, args.core)
        rows.append((n, row["peak_bytes"]))
        print(f"{n:>10} requests: peak {row['peak_bytes'] / 2**20:8.1f} MiB, simulation {row['simulate_cpu_s']:8.1f} s "
              f"CPU ({row['simulate_cpu_s'] / n * 1e6:.0f} µs a request), whole run {row['cpu_s']:8.1f} s CPU", flush=True)
    for (n0, p0), (n1, p1) in zip(rows, rows[1:]):
        print(f"{n0} -> {n1} requests: {(p1 - p0) / (n1 - n0):.0f} bytes of peak memory a request")


if __name__ == "__main__":
    main()
