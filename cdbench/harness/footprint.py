"""What a run will take, estimated from its request count before anything is built: memory and time.

A run streams its records to its folder as it goes (``harness/streamed.py``), and its
summary and report read them back a row group at a time (``reports/binned.py``). A
``model`` run of a generated workload, saved as ``cdbench run`` saves it, holds no
request of it at any time (``harness/run.py``): the requests are built as the spec
pricing reads them (an item's copies priced once, by the item:
``costs/spec_costs.py``) and again as the scheduler issues them, each into a slot
reused once it ended and its row was written (``harness/scheduler.py``), with the
cost tables' per-request columns in the same slots and the cost pools of the
requests in flight (``costs/cost_tables.py``). What it holds beyond the requests in
flight is bounded by the corpus (its items' spec keys, instance pools and texts, the
failed specs and compile errors by item) and by fixed sizes (the histograms, the
remembered spec keys, the buffered steps and rows between two writes, the row groups
joined at the end, the quantile candidates of the summary, at most
``streamed.SELECT_LIMIT`` values a statistic), which a run fills within its first
million requests or so. Past that its memory does not grow with the request count:
:data:`STREAMED_BYTES` whatever the count, the largest peak measured (below). What still
grows is the Parquet writers' and readers' metadata (a row group per 131,072 rows of a
table: about 25 kB a row group of steps while the join writes it, 71 row groups at a
million requests), tens of MiB at ten million requests, less than the peak's spread
from run to run. The disk the run folder takes grows with the count (1.6 GB a million
requests): :func:`disk_refusal` refuses results that will not fit beside what is free.

Other runs hold the workload's requests and the scheduler's state for every
request to their end (``hybrid`` and ``live`` modes, whose executor reads the
requests themselves; data-parallel ranks): :data:`BYTES_PER_REQUEST` and
:data:`HELD_WORKLOAD_BYTES` a request, from the measurements of the ``model``
path before it streamed (commit 7a87bfc: the slope of the peak over 5,000 to a
million requests of the default config, 1,459 bytes, and generating the default
workload, 832 bytes a request at three quarters of a million requests).

:data:`STREAMED_BYTES` is the peak resident memory of the built-in default config in ``model`` mode, run and
saved (report included) in a fresh process per size, beyond what the process holds when this check runs (the
interpreter, torch, pandas and the vocabulary: 517.7 MiB resident at the check of ``cdbench run --mode model -n
1000000``), measured on a 2-CPU x86-64 Linux machine shared with other work, each run pinned to one core::

    python benchmarks/bench_streaming.py --requests 100000 1000000 --core 1

       100000 requests: peak 800.3 MiB (at the simulation's start 753.9 MiB, at its end 793.8 MiB)
      1000000 requests: peak 875.9 MiB (at the simulation's start 546.6 MiB, at its end 775.6 MiB)

(load average 1.9 to 2.7; commit 0535289.) The peak is the report's, on what the summary left; since it hands
a row group on in slices (7a5e982) a million requests peaked at 803.4 MiB, the tree before at 852.8 in turn
with it (``reports/scheduler_benchmark.md``). From a million requests on it does not grow with the count: three million
requests peaked at 859.5 MiB against 913.9 for a million of the same tree, their summaries read back at 836.3
MiB both (59ee3fb), and ten million requests at 995.9 MiB (cb3d18e, before the failed copies' errors and
labels were held by item and the kind sequence packed: about 7 of the 11 bytes a request it added over its
million, by the counts of ``reports/scheduler_benchmark.md``); the peaks of
one size spread by tens of MiB from run to run (a million: 798 to 965 MiB over the sessions of
``reports/scheduler_benchmark.md``, issue 32). :data:`STREAMED_BYTES` takes the highest of them, the ten
million's 995.9 MiB, over the 517.7 MiB base. Before the requests were generated as they arrive (d63b13a) a
million requests peaked at 2,025 MiB.

The CPU time a request adds, :data:`SECONDS_PER_REQUEST`, is the whole command's CPU time over the
million requests above (405.0 s: the simulation 339.1 s, the spec pricing, the joins, the summary and the
report the rest).

Other workloads differ (longer outputs mean more steps and inter-token
latencies per request, a reused spec costs less than a new one; ``hybrid`` mode
adds the backend's compiled grammars and its own time per call), so the estimate
is a guide for the order of magnitude: a run that is refused is far out of reach,
not at its edge.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from rich.filesize import decimal as _bytes

if TYPE_CHECKING:
    from cdbench.harness.config import RunConfig

STREAMED_BYTES = 479 * 2**20
"""Peak resident memory a streamed ``model`` run adds, whatever its request count (see the module docstring)."""

BYTES_PER_REQUEST = 1_459
"""Peak resident memory a request adds to a run that holds its requests' state to the end (see the module
docstring)."""

HELD_WORKLOAD_BYTES = 832
"""What a request of the workload adds where the run holds the workload to its end (every run but a streamed
``model`` run)."""

FOLDER_BYTES_PER_REQUEST = 1_600
"""Disk a request adds to its run folder: ten million requests of the built-in default config in ``model`` mode
took 16 GB (``reports/scheduler_benchmark.md``, "Ten million requests to the end")."""

SECONDS_PER_REQUEST = 405e-6
"""CPU time a request adds to a ``model``-mode run (see the module docstring)."""


@dataclass(frozen=True)
class Footprint:
    """The estimated memory a run adds to its process, and its CPU time (``None``: not estimated)."""

    requests: int
    memory_bytes: int
    seconds: float | None
    grows: bool = True  # whether the memory grows with the request count (``False``: a streamed run's bound)

    def describe(self) -> str:
        """E.g. ``about 8.8 TB of memory (8.8 kB a request) and 17.5 days of CPU time``."""
        each = f"{_bytes(self.memory_bytes // max(self.requests, 1))} a request" if self.grows else \
            "whatever the request count"
        text = f"about {_bytes(self.memory_bytes)} of memory ({each})"
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
        return Footprint(n, STREAMED_BYTES, n * SECONDS_PER_REQUEST, grows=False)
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


def folder_bytes(configs: Iterable[RunConfig]) -> int:
    """The disk the run folders of ``configs`` will take together (:data:`FOLDER_BYTES_PER_REQUEST` a request;
    a replayed trace counts its file's size, as its requests are not counted before it is read)."""
    total = 0
    for config in configs:
        n = config.workload.num_requests
        if n is not None:
            total += n * FOLDER_BYTES_PER_REQUEST
        elif config.workload.trace is not None and Path(config.workload.trace).is_file():
            total += Path(config.workload.trace).stat().st_size
    return total


def free_disk(folder: Path) -> int:
    """Bytes free on the file system ``folder`` is (or will be) on: its nearest existing parent's."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def disk_refusal(needed: int, folder: Path) -> str | None:
    """Why results of ``needed`` bytes cannot be written under ``folder`` (``None``: they fit)."""
    free = free_disk(folder)
    if needed <= free:
        return None
    return (f"the run folders need about {_bytes(needed)} of disk ({_bytes(FOLDER_BYTES_PER_REQUEST)} a request); "
            f"{folder} has {_bytes(free)} free: use fewer requests (workload.num_requests) or another --out")


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.2g} s"
