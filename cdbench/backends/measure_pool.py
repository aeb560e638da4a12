"""Grammar backends in worker processes: timed calls that a hang, a crash or a memory blow-up cannot
take down with the caller.

:class:`WorkerPool` hands ``(backend name, task)`` jobs to ``spawn``-ed worker processes
(:mod:`cdbench.backends.measure_worker`) and yields one
:class:`~cdbench.backends.measure_worker.ItemResult` per job: a compile still running after
``compile_timeout_s`` is killed and recorded as ``timeout``, a worker that dies records ``crash``,
one past its memory cap ``oom``; a fresh worker takes the next job. ``cdbench profile`` and model
mode's on-demand spec measurement (:mod:`cdbench.harness.spec_costs`) both measure through it.
"""

from __future__ import annotations

import multiprocessing
import re
import signal
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Protocol

import psutil
from pydantic import ByteSize

from cdbench.backends.measure_worker import ItemResult, ProfileTask, worker_main

# Worker start-up (imports, vocabulary) and backend construction are not timed
# compile work, but a worker stuck there must not stall the run forever.
STARTUP_TIMEOUT_S = 300.0
# What a process that ran out of memory writes last: Rust's allocation-failure abort, C++'s uncaught
# std::bad_alloc, an uncaught Python MemoryError, an ENOMEM error.
_OUT_OF_MEMORY = re.compile(r"memory allocation of \d+ bytes failed|std::bad_alloc|MemoryError|Cannot allocate memory")

WORKER_MEMORY_SHARE = 0.8
"""Share of the memory available at the start that the workers get by default, in equal parts; the rest
is left for the parent (which holds every task and result) and whatever else the machine runs."""


def default_worker_memory(workers: int) -> int:
    """Each of ``workers`` workers' memory cap when none is given (:data:`WORKER_MEMORY_SHARE`)."""
    return int(psutil.virtual_memory().available * WORKER_MEMORY_SHARE / workers)


class PoolSettings(Protocol):
    """What a :class:`WorkerPool` reads from its settings (``ProfileConfig`` has all of it)."""

    vocab: str
    plugins: list[str]
    rollback_every: int
    backend_options: dict[str, dict[str, Any]]
    worker_memory: ByteSize
    workers: int
    compile_timeout_s: float
    walk_timeout_s: float


@dataclass
class _Worker:
    process: Any
    conn: Any
    stderr: Path  # the worker's descriptor 2: read when it dies, for why
    stderr_start: int = 0  # its size when the current job was sent: what the job wrote comes after
    job: tuple[str, ProfileTask] | None = None
    deadline: float = 0.0
    phase: str = "idle"  # idle | starting | compile | walk
    compile_ms: float | None = None


def _death_message(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"worker killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"worker exited with code {exitcode}"


class WorkerPool:
    """Worker processes that each serve any backend; one that crashed or timed out is replaced.

    Workers are ``spawn``-ed children of this process, so that they die with it
    (:func:`~cdbench.backends.measure_worker.die_with_parent`; a ``forkserver``
    child would outlive it, its parent being the fork server, which waits for
    its children). ``warm_up``: each task meets its engine warmed and without
    the earlier tasks' cached work (:func:`~cdbench.backends.measure_worker.warm_up_engine`),
    as an engine meets a new spec. ``pace``: each result carries its threads' run and wait times
    (:attr:`~cdbench.backends.measure_worker.ItemResult.sched_ns`). The kernel ties a worker to the thread
    that started it, so drive a pool from one thread. Use as a context manager; :meth:`run` yields
    one :class:`ItemResult` per job.
    """

    def __init__(self, config: PoolSettings, warm_up: bool = False, pace: bool = False) -> None:
        self.config, self.warm_up, self.pace = config, warm_up, pace
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self._logs = tempfile.TemporaryDirectory(prefix="cdbench-profile-workers-")
        self._started = 0

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        for worker in self._workers:
            self._stop(worker)
        self._workers.clear()
        self._logs.cleanup()

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        self._started += 1
        stderr = Path(self._logs.name) / f"worker-{self._started}.stderr"
        process = self._ctx.Process(
            target=worker_main,
            args=(child, self.config.vocab, self.config.plugins, self.config.rollback_every,
                  self.config.backend_options, self.config.worker_memory, str(stderr), self.warm_up, self.pace),
            daemon=True,
        )
        process.start()
        child.close()
        return _Worker(process, parent, stderr, phase="starting", deadline=time.monotonic() + STARTUP_TIMEOUT_S)

    def _stop(self, worker: _Worker) -> None:
        if worker.process.is_alive():
            try:
                worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            worker.process.join(timeout=2)
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join()
        worker.conn.close()
        worker.stderr.unlink(missing_ok=True)

    def _failed(self, worker: _Worker, status: str, message: str) -> ItemResult:
        backend, task = worker.job  # type: ignore[misc]
        return ItemResult(
            corpus=task.corpus, item_id=task.item_id, kind=task.kind, backend=backend,
            status=status, message=message, compile_ms=worker.compile_ms,
            instance_failure=task.instance_failure,
        )

    def _out_of_memory(self, what: str) -> str:
        return f"{what} (worker memory cap {self.config.worker_memory.human_readable(decimal=True)})"

    def _retire(self, worker: _Worker) -> None:
        worker.process.kill()
        self._stop(worker)
        self._workers.remove(worker)

    def run(self, jobs: Iterable[tuple[str, ProfileTask]]) -> Iterator[ItemResult]:
        """Profile each ``(backend, task)`` job; results come in completion order."""
        pending = deque(jobs)
        while pending or any(w.job is not None for w in self._workers):
            # Start workers (again, after a crash or timeout) only while jobs wait for them.
            free = sum(1 for w in self._workers if w.job is None)
            for _ in range(min(self.config.workers - len(self._workers), len(pending) - free)):
                self._workers.append(self._start())
            for worker in self._workers:
                if worker.phase == "idle" and pending:
                    worker.job = pending.popleft()
                    worker.stderr_start = worker.stderr.stat().st_size if worker.stderr.exists() else 0
                    worker.conn.send(worker.job)
                    worker.phase, worker.compile_ms = "starting", None
                    worker.deadline = time.monotonic() + STARTUP_TIMEOUT_S
            busy = [w for w in self._workers if w.phase != "idle"]
            timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic()) if busy else None
            wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=timeout)
            for worker in busy:
                result = self._poll(worker)
                if result is not None:
                    yield result

    def _poll(self, worker: _Worker) -> ItemResult | None:
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if message[0] == "ready":
                    if worker.job is None:
                        worker.phase = "idle"
                elif message[0] == "compiling":
                    worker.phase = "compile"
                    worker.deadline = time.monotonic() + self.config.compile_timeout_s
                elif message[0] == "compiled":
                    worker.phase, worker.compile_ms = "walk", message[2]
                    worker.deadline = time.monotonic() + self.config.walk_timeout_s
                elif message[0] == "done":
                    result = message[1]
                    if result.status == "oom":
                        # What is left of a worker after a MemoryError is not trusted with the next item.
                        result.message = self._out_of_memory(result.message)
                        self._retire(worker)
                    worker.job, worker.phase = None, "idle"
                    return result
        except (EOFError, OSError):
            pass  # the worker died; handled below
        if not worker.process.is_alive():
            death = _death_message(worker.process.exitcode)
            last_words = _last_line(worker.stderr, worker.stderr_start)
            if worker.job is None:
                raise RuntimeError(f"a profile worker failed to start ({death}{': ' + last_words if last_words else ''})")
            if _OUT_OF_MEMORY.search(last_words):
                result = self._failed(worker, "oom", self._out_of_memory(f"{death}: {last_words}"))
            else:
                result = self._failed(worker, "crash", f"{death}: {last_words}" if last_words else death)
            self._retire(worker)
            return result
        if time.monotonic() >= worker.deadline:
            if worker.job is None:
                raise RuntimeError(f"a profile worker did not start within {STARTUP_TIMEOUT_S:.0f} s")
            if worker.phase == "compile":
                message = f"compile exceeded {self.config.compile_timeout_s:g} s"
            elif worker.phase == "walk":
                message = f"instance walk exceeded {self.config.walk_timeout_s:g} s"
            else:
                message = f"backend construction exceeded {STARTUP_TIMEOUT_S:g} s"
            result = self._failed(worker, "timeout", message)
            self._retire(worker)
            return result
        return None


def _last_line(path: Path, start: int = 0) -> str:
    """The last non-empty line written to a worker's descriptor 2 after byte ``start`` (empty when none)."""
    try:
        with path.open("rb") as file:
            file.seek(max(start, file.seek(0, 2) - 4096))
            tail = file.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
