"""What a run will take, estimated from its request count before anything is built: memory and time.

A run keeps every request, the scheduler's per-request and per-step tables and
the result frames in memory at once, so its peak grows linearly with the
request count. :func:`refusal` says why a run cannot run when its estimate is
beyond the memory this machine has available, before it allocates anything.

The constants are the slopes of least-squares fits of the peak resident
memory and the CPU time of the built-in default config in ``model`` mode, run
and saved (report included) in a fresh process per size (commit 161545f plus
this module, Python 3.11, 2-CPU x86-64 Linux machine shared with other work)::

    python benchmarks/bench_run_memory.py --requests 10000 50000 100000

        10000 requests: peak    650.4 MiB, CPU     9.5 s
        50000 requests: peak   1153.7 MiB, CPU    38.8 s
       100000 requests: peak   1753.6 MiB, CPU    73.9 s
    fit: base 533 MiB + 12842 bytes/request; 715 µs of CPU/request

The base (interpreter, torch, pandas, the vocabulary) is already resident when
the check runs, so the estimate is the requests' share alone. Time is CPU
time, which does not depend on what else the machine runs; on a busy machine
the wall time is longer (this one's 100,000 requests took 217 s of wall time).

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

BYTES_PER_REQUEST = 12_842
"""Peak resident memory a request adds to a run (the fit's slope; see the module docstring)."""

SECONDS_PER_REQUEST = 715e-6
"""CPU time a request adds to a ``model``-mode run (the fit's slope, same measurement)."""


@dataclass(frozen=True)
class Footprint:
    """The estimated memory a run adds to its process, and its CPU time (``None``: not estimated)."""

    requests: int
    memory_bytes: int
    seconds: float | None

    def describe(self) -> str:
        """E.g. ``about 12.8 TB of memory (12.8 kB a request) and 8.28 days of CPU time``."""
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
