"""What a run will take, estimated from its request count before anything is built: memory and time.

A run streams its records to its folder as it goes (``harness/streamed.py``), its
summary and report read them back a row group at a time (``reports/binned.py``),
and, in ``model`` mode, it holds the grammar cost pools of the requests in flight
only (``costs/cost_tables.py``) and lets the workload's requests go once its
scheduler and cost tables are built (``Workload.release``; the trace file is
written from the workload's seeded streams again). What still grows with the
request count is what is built before the simulation starts and held while it
runs: the workload's requests and their specs while the run is set up (every
request is its own spec in the default workload), the spec prices, spec keys
and per-request arrays of the scheduler and its cost tables, and the compile
cache's and compile outcomes' entries. So a ``model`` run's peak comes when its
scheduler is built, and later stages fit in the memory the released requests
leave. :func:`refusal` says why a run cannot run when its estimate is beyond the
memory this machine has available, before it allocates anything.

The constants come from peak resident memory of the built-in default config in
``model`` mode, run and saved (report included) in a fresh process per size
(commit 7a87bfc, Python 3.11, 2-CPU x86-64 Linux machine shared with other
work, load average 1-6, each run pinned to one core)::

    python benchmarks/bench_run_memory.py --requests 5000 20000 40000

         5000 requests: peak    582.6 MiB, CPU     7.8 s
        20000 requests: peak    692.3 MiB, CPU    21.9 s
        40000 requests: peak    723.2 MiB, CPU    45.7 s
    fit: base 582 MiB + 4075 bytes/request; 1090 µs of CPU/request

and a million requests (the same commit, the resident memory and its peak
printed every 20 s of a run as ``bench_streaming.py`` makes it): 2,025 MiB,
set before the simulation starts and unchanged over its first five minutes (at
9ca3a41, before a JSON Schema copy read its item's schema and before the spec
pricing and the cost tables held less a request, 2,360 MiB, held to half of the
simulation). Small runs peak while saving (the report's figures, the trace), so
their slope overstates what a long run adds; :data:`BYTES_PER_REQUEST` is the
slope of the four sizes together (1,459 bytes; 1,513 from the base to a million
alone; 1,819 at 9ca3a41).
Before the report read the tables a row group at a time the same fit of the
three small sizes gave 10,804 bytes a request (commit 71293d8), and a million
requests peaked at 7.9 GB. The CPU time a request adds,
:data:`SECONDS_PER_REQUEST`, is that fit's (71293d8, a quieter machine: this
session's 1,172 µs is inflated by the load; no per-iteration code changed since).

Other modes hold the workload's requests for the whole run (the hybrid
executor reads them at every step): :data:`HELD_WORKLOAD_BYTES` a request more,
what generating the default workload adds (832 bytes a request, measured at
three quarters of a million requests).

The base (interpreter, torch, pandas, the vocabulary) is already resident when
the check runs, so the estimate is the requests' share alone. Time is CPU
time, which does not depend on what else the machine runs; on a busy machine
the wall time is longer.

Other workloads differ (longer outputs mean more steps and inter-token
latencies per request, a reused spec costs less than a new one; ``hybrid`` mode
adds the backend's compiled grammars and its own time per call), so the estimate
is a guide for the order of magnitude: a run that is refused is far out of reach,
not at its edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
from rich.filesize import decimal as _bytes

if TYPE_CHECKING:
    from cdbench.harness.config import RunConfig

BYTES_PER_REQUEST = 1_459
"""Peak resident memory a request adds to a ``model`` run (the fit's slope; see the module docstring)."""

HELD_WORKLOAD_BYTES = 832
"""What a request of the workload adds where the run holds the workload to its end (every mode but ``model``)."""

SECONDS_PER_REQUEST = 930e-6
"""CPU time a request adds to a ``model``-mode run (the fit's slope, same measurement)."""


@dataclass(frozen=True)
class Footprint:
    """The estimated memory a run adds to its process, and its CPU time (``None``: not estimated)."""

    requests: int
    memory_bytes: int
    seconds: float | None

    def describe(self) -> str:
        """E.g. ``about 8.8 TB of memory (8.8 kB a request) and 17.5 days of CPU time``."""
        text = f"about {_bytes(self.memory_bytes)} of memory ({_bytes(self.memory_bytes // max(self.requests, 1))} a request)"
        if self.seconds is not None:
            text += f" and {_duration(self.seconds)} of CPU time"
        return text


def estimate(config: RunConfig) -> Footprint | None:
    """The footprint of ``config`` (``None`` for a replayed trace: its size is the trace file's)."""
    n = config.workload.num_requests
    if n is None:
        return None
    if config.mode == "model":
        return Footprint(n, n * BYTES_PER_REQUEST, n * SECONDS_PER_REQUEST)
    return Footprint(n, n * (BYTES_PER_REQUEST + HELD_WORKLOAD_BYTES), None)


def available_memory() -> int:
    """Bytes of memory this machine can give a process now without swapping (``MemAvailable`` on Linux)."""
    return int(psutil.virtual_memory().available)


def refusal(config: RunConfig) -> str | None:
    """Why ``config`` cannot run on this machine (its estimate beside what is available), or ``None`` when it can."""
    footprint = estimate(config)
    if footprint is None:
        return None
    available = available_memory()
    if footprint.memory_bytes <= available:
        return None
    return (f"{footprint.requests:,} requests need {footprint.describe()}; this machine has "
            f"{_bytes(available)} available: use fewer requests (workload.num_requests)")


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.2g} s"
