"""What a run will take, estimated from its request count before anything is built: memory and time.

A run streams its records to its folder as it goes (``harness/streamed.py``), and its
summary and report read them back a row group at a time (``reports/binned.py``). A
``model`` run of a generated workload, saved as ``cdbench run`` saves it, holds no
request of it at any time (``harness/run.py``): the requests are built as the spec
pricing reads them (an item's copies priced once, by the item:
``costs/spec_costs.py``) and again as the scheduler issues them, each into a slot
reused once it ended and its row was written (``harness/scheduler.py``), with the
cost tables' per-request columns in the same slots and the cost pools of the
requests in flight (``costs/cost_tables.py``). Its memory does not grow with the
request count while it simulates (a million requests: resident memory between 566 and
589 MiB from the spec pricing to the simulation's last step). What it holds beyond the
requests in flight is bounded by the corpus (its items' spec keys, instance pools
and texts) and by fixed sizes (the histograms, the remembered spec keys, the
buffered steps and rows between two writes, the row groups joined at the end, the
quantile candidates of the summary, at most ``streamed.SELECT_LIMIT`` values a
statistic). The peak is set after the last step, when the tables are joined and the
summary read back, and it still grows between 100,000 requests and a million
(:data:`STREAMED_BYTES_PER_REQUEST`, a third of what it was: the row groups and the
candidates have bounds, which a run reaches only past some size); the estimate is
:data:`STREAMED_BYTES` plus that a request, so it keeps growing past a million,
where the peak is expected to stop (ten million requests were not measured).

Other runs hold the workload's requests and the scheduler's state for every
request to their end (``hybrid`` and ``live`` modes, whose executor reads the
requests themselves; data-parallel ranks): :data:`BYTES_PER_REQUEST` and
:data:`HELD_WORKLOAD_BYTES` a request, from the measurements of the ``model``
path before it streamed (commit 7a87bfc: the slope of the peak over 5,000 to a
million requests of the default config, 1,459 bytes, and generating the default
workload, 832 bytes a request at three quarters of a million requests).

:data:`STREAMED_BYTES` and :data:`STREAMED_BYTES_PER_REQUEST` fit the peak resident memory of
the built-in default config in ``model`` mode, run and saved (report included) in a fresh process per
size, beyond the interpreter, torch, pandas and the vocabulary (about 500 MiB, resident
before the check runs), measured on a 2-CPU x86-64 Linux machine shared with
other work, each run pinned to one core::

    python benchmarks/bench_streaming.py --requests 100000 --core 1
    python benchmarks/bench_streaming.py --requests 1000000 --core 1

       100000 requests: peak 724.4 MiB (at the simulation's start 518.1 MiB, at its end 722.9 MiB)
      1000000 requests: peak 840.9 MiB (at the simulation's start 519.8 MiB, at its end 828.3 MiB)

(load average 1 to 11; the million's resident memory, sampled every 30 s, stayed between 566 and 589
MiB until its last step.) The peak grows by 116.5 MiB from 100,000 requests to a million, 136 bytes a
request (:data:`STREAMED_BYTES_PER_REQUEST`); :data:`STREAMED_BYTES` is the rest of the 100,000-request
peak over the 500 MiB base. Before (d790d55) it grew 396 bytes a request from 100,000 to 200,000 requests,
and before the requests were generated as they arrive (d63b13a) a million requests peaked at 2,025 MiB.

The CPU time a request adds, :data:`SECONDS_PER_REQUEST`, is the fit of
``bench_run_memory.py`` at 71293d8 (5,000 to 40,000 requests, a quieter
machine); a request's CPU did not change since.

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

STREAMED_BYTES = 212 * 2**20
"""Peak resident memory a streamed ``model`` run adds whatever its request count (see the module docstring)."""

STREAMED_BYTES_PER_REQUEST = 136
"""What a request still adds to a streamed ``model`` run's peak (up to a million requests: the row groups joined
and the summary's quantile candidates filling to their bounds; see the module docstring)."""

BYTES_PER_REQUEST = 1_459
"""Peak resident memory a request adds to a run that holds its requests' state to the end (see the module
docstring)."""

HELD_WORKLOAD_BYTES = 832
"""What a request of the workload adds where the run holds the workload to its end (every run but a streamed
``model`` run)."""

SECONDS_PER_REQUEST = 930e-6
"""CPU time a request adds to a ``model``-mode run (see the module docstring)."""


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


def streamed(config: RunConfig) -> bool:
    """Whether ``config``'s run holds none of its requests (``harness/run.py``): a ``model`` run of a generated
    workload on one rank (saved as ``cdbench run`` saves it: its records streamed)."""
    if config.mode != "model" or config.workload.trace is not None:
        return False
    spec_decode = config.workload.spec_decode
    scheduler = config.scheduler_config(spec_tokens=spec_decode.k, spec_drafter=spec_decode.drafter)
    return not (scheduler.ranks > 1 and scheduler.parallel == "dp")


def estimate(config: RunConfig) -> Footprint | None:
    """The footprint of ``config`` (``None`` for a replayed trace: its size is the trace file's)."""
    n = config.workload.num_requests
    if n is None:
        return None
    if streamed(config):
        return Footprint(n, STREAMED_BYTES + n * STREAMED_BYTES_PER_REQUEST, n * SECONDS_PER_REQUEST)
    seconds = n * SECONDS_PER_REQUEST if config.mode == "model" else None
    return Footprint(n, n * (BYTES_PER_REQUEST + HELD_WORKLOAD_BYTES), seconds)


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
