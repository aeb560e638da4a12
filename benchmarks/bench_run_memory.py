"""Peak memory and wall time of ``cdbench run`` against its request count, for the up-front footprint check.

Each size runs in a fresh process (peak resident memory is per process), with
the built-in default config in ``model`` mode and everything a run keeps in
memory: the workload's requests, the scheduler's tables, the result frames and
the saved run folder (report included). Prints one row per size and the
least-squares fits ``peak = base + bytes_per_request × requests`` and the same
for the CPU time of the run (user + system: unlike wall time, it does not
depend on what else the machine is running); the CPU fit's slope gives
:data:`~cdbench.harness.footprint.SECONDS_PER_REQUEST`. A ``model`` run holds none
of its requests, so the memory fit's slope is what its bounded caches and the
allocator's high-water mark add (:data:`~cdbench.harness.footprint.STREAMED_BYTES`
is measured by ``bench_streaming.py`` at larger sizes).

Run from the repository root::

    python benchmarks/bench_run_memory.py --requests 10000 50000 100000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np

_CHILD = """
import json, resource, sys, tempfile, time
from pathlib import Path
from cdbench.cli.support import load_run_tree
from cdbench.reports.run_report import build_report
from cdbench.results.run_config import validate_run_config
from cdbench.results.run_folder import record_run

tree, source = load_run_tree(None, {"mode": "model", "requests": int(sys.argv[1])}, [])
config = validate_run_config(tree, source)
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

start, start_cpu = time.perf_counter(), cpu()
record_run(config, Path(tempfile.mkdtemp()) / "run", finish=build_report)
wall, cpu_s = time.perf_counter() - start, cpu() - start_cpu
print(json.dumps({"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "wall_s": wall,
                  "cpu_s": cpu_s}))
"""


def measure(requests: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(requests)], stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[10_000, 50_000, 100_000])
    args = parser.parse_args()
    rows = []
    for n in args.requests:
        row = measure(n)
        rows.append((n, row["peak_bytes"], row["cpu_s"]))
        print(f"{n:>9} requests: peak {row['peak_bytes'] / 2**20:8.1f} MiB, CPU {row['cpu_s']:7.1f} s, "
              f"wall {row['wall_s']:7.1f} s", flush=True)
    n, peak, cpu = (np.array(col, dtype=float) for col in zip(*rows))
    per_request, base = np.polyfit(n, peak, 1)
    seconds, _ = np.polyfit(n, cpu, 1)
    print(f"fit: base {base / 2**20:.0f} MiB + {per_request:.0f} bytes/request; {seconds * 1e6:.0f} µs of CPU/request")


if __name__ == "__main__":
    main()
