"""What a run will take, estimated from its request count before anything is built: memory and time.

A run streams its records to its folder as it goes (``harness/streamed.py``) and,
in ``model`` mode, holds the grammar cost pools of the requests in flight only
(``costs/cost_tables.py``); what still grows with the request count is the
workload's requests and their specs (generated before the run and kept for its
trace file), the spec keys, compile outcomes and spec prices of the run, its
request table, and the saved tables the report reads (the step table: about ten
rows a request in the default workload). So its peak still grows linearly with
the request count, at a smaller slope than when every record and cost pool was
held. :func:`refusal` says why a run cannot run when its estimate is beyond the
memory this machine has available, before it allocates anything.

The constants are the slopes of least-squares fits of the peak resident
memory and the CPU time of the built-in default config in ``model`` mode, run
and saved (report included) in a fresh process per size (commit 71293d8,
Python 3.11, 2-CPU x86-64 Linux machine, each run pinned to one core)::

    python benchmarks/bench_run_memory.py --requests 5000 20000 40000

         5000 requests: peak    631.1 MiB, CPU     6.6 s
        20000 requests: peak    817.0 MiB, CPU    20.1 s
        40000 requests: peak    994.6 MiB, CPU    39.1 s
    fit: base 591 MiB + 10804 bytes/request; 930 µs of CPU/request

(The fit before, on branch ``streaming``: 8,839 bytes and 1,510 µs a request;
drawing the cost pools only where read took the CPU down; the memory a request
adds rose between the two fits, not traced. With every record and cost pool held for the whole run, a 20,000-request run
of this config peaked at 4.4 GB on this machine; before the trace file was
written a line at a time and the report stopped copying the step table, the fit
gave 11,390 bytes a request. The constant before, 12,842 bytes, was measured at
commit 161545f.)

The base (interpreter, torch, pandas, the vocabulary) is already resident when
the check runs, so the estimate is the requests' share alone. Time is CPU
time, which does not depend on what else the machine runs; on a busy machine
the wall time is longer.

Other workloads differ (longer outputs mean more steps and inter-token
latencies per request; ``hybrid`` mode adds the backend's compiled grammars and
its own time per call), so the estimate is a guide for the order of magnitude:
a run that is refused is far out of reach, not at its edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
from rich.filesize import decimal as _bytes

if TYPE_CHECKING:
    from cdbench.harness.config import RunConfig

BYTES_PER_REQUEST = 10_804
"""Peak resident memory a request adds to a run (the fit's slope; see the module docstring)."""

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
        text = f"about {_bytes(self.memory_bytes)} of memory ({_bytes(BYTES_PER_REQUEST)} a request)"
        if self.seconds is not None:
            text += f" and {_duration(self.seconds)} of CPU time"
        return text


def estimate(config: RunConfig) -> Footprint | None:
    """The footprint of ``config`` (``None`` for a replayed trace: its size is the trace file's)."""
    n = config.workload.num_requests
    if n is None:
        return None
    seconds = n * SECONDS_PER_REQUEST if config.mode == "model" else None
    return Footprint(n, n * BYTES_PER_REQUEST, seconds)


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
