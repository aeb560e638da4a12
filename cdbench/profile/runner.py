"""``cdbench profile``: grammar backends side by side on real corpora.

For every corpus item and backend, a worker process (see
:mod:`cdbench.profile.worker`) compiles the spec cold and times it
(TTFM), walks the item's oracle instances timing the first mask fill after each
token (TBM), accept and rollback, counts the forced (jump-forward) tokens at
each step, and checks correctness: valid instances must be accepted, mutated
invalid ones (see :mod:`cdbench.profile.mutations`) rejected.

Isolation: a compile still running after ``compile_timeout_s`` is killed and
recorded as ``timeout``; a worker that dies (segfault, abort) records ``crash``
for its item; one that runs out of its memory cap (``worker_memory``) records
``oom``; in each case a fresh worker takes the next job and the profile goes on.
Workers die with the parent process, even when it is killed with SIGKILL.

Resumable: each item's result is appended to ``items.jsonl`` as soon as it is
known; a rerun with the same output folder skips what is there, except items
that ran out of memory when the rerun's ``worker_memory`` is larger than the
stored run's: those are tried again. A rerun with settings that change the
results is refused before anything is built.

Example
-------
>>> from cdbench.profile.runner import ProfileConfig, run_profile   # doctest: +SKIP
>>> run_profile(ProfileConfig(backends=["xgrammar"], corpora=["embedded"], limit=10), "out/p")
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import re
import signal
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
from pydantic import BaseModel, ByteSize, ConfigDict, Field

from cdbench.backends.engine_log import is_logged_warning
from cdbench.profile.worker import (
    Instance,
    ItemResult,
    ProfileTask,
    TokenTimes,
    load_plugin,
    worker_main,
)

if TYPE_CHECKING:
    from rich.console import Console

ITEMS_JSONL = "items.jsonl"
CONFIG_JSON = "profile_config.json"
# Worker start-up (imports, vocabulary) and backend construction are not timed
# compile work, but a worker stuck there must not stall the run forever.
STARTUP_TIMEOUT_S = 300.0
WORKER_MEMORY_SHARE = 0.8
"""Share of the memory available at the start that the workers get by default, in equal parts; the rest
is left for the parent (which holds every task and result) and whatever else the machine runs."""
# What a process that ran out of memory writes last: Rust's allocation-failure abort, C++'s uncaught
# std::bad_alloc, an uncaught Python MemoryError, an ENOMEM error.
_OUT_OF_MEMORY = re.compile(r"memory allocation of \d+ bytes failed|std::bad_alloc|MemoryError|Cannot allocate memory")


def default_worker_memory(workers: int) -> int:
    """Each of ``workers`` workers' memory cap when none is given (:data:`WORKER_MEMORY_SHARE`)."""
    return int(psutil.virtual_memory().available * WORKER_MEMORY_SHARE / workers)


class ProfileConfig(BaseModel):
    """Everything that decides what ``cdbench profile`` measures.

    ``limit`` caps the items taken from each corpus (the first ones, in file
    order). ``valid_instances`` oracle instances and up to ``invalid_instances``
    mutations are checked per item. Every ``rollback_every``-th accepted token
    is rolled back (timed) and accepted again; 0 disables that.
    ``backend_options`` go to ``create_backend`` per backend name; the default
    turns xgrammar's compile cache off, so every compile is cold (backends are
    built once per worker; their construction is not compile time).
    ``worker_memory`` caps what each worker's engines may allocate beyond its
    start-up (bytes, or a size such as ``8GB``; see
    :func:`~cdbench.profile.worker.cap_memory`); left out, it is
    :func:`default_worker_memory`.
    """

    model_config = ConfigDict(extra="forbid")

    backends: list[str] = Field(min_length=1)
    corpora: list[str] = Field(min_length=1)
    vocab: str = "qwen3.6"
    limit: int | None = Field(default=None, ge=1)
    seed: int = 0
    compile_timeout_s: float = Field(default=60.0, gt=0)
    walk_timeout_s: float = Field(default=600.0, gt=0)
    workers: int = Field(default=1, ge=1)
    valid_instances: int = Field(default=1, ge=0)
    invalid_instances: int = Field(default=3, ge=0)
    rollback_every: int = Field(default=4, ge=0)
    # Fixed when the config is made (and recorded with it): the memory available then, shared among the workers.
    worker_memory: ByteSize = Field(default_factory=lambda data: ByteSize(default_worker_memory(data["workers"])), gt=0)
    plugins: list[str] = Field(default_factory=list)
    # Compiles are timed cold: engine-side compile caches are off.
    backend_options: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: {"xgrammar": {"compiler_cache": False}}
    )

    def results_identity(self) -> dict[str, Any]:
        """The fields that must be equal for stored results to be reused on resume."""
        return self.model_dump(
            include={"vocab", "seed", "valid_instances", "invalid_instances", "rollback_every", "backend_options"}
        )


class ResumeMismatchError(ValueError):
    """The output folder holds results of a profile with different settings."""


@dataclass
class PreparedTasks:
    """The items to profile, and what could not be read."""

    tasks: list[ProfileTask]
    skipped: list[str] = field(default_factory=list)


@dataclass
class ProfileRun:
    """Where a profile's outputs are, and how many results it holds."""

    out_dir: Path
    results: int
    new_results: int
    skipped_lines: list[str]
    files: list[Path]
    engine_log_lines: int = 0  # lines the engines logged while compiling, kept in the results' warnings
    out_of_memory: int = 0  # results with status oom


# ---------------------------------------------------------------------------
# Results store (items.jsonl), resumable


def result_to_json(result: ItemResult) -> str:
    return json.dumps(asdict(result), ensure_ascii=False, separators=(",", ":"))


def result_from_json(line: str) -> ItemResult:
    data = json.loads(line)
    data["tokens"] = TokenTimes(**data["tokens"])
    return ItemResult(**data)


class ResultStore:
    """``items.jsonl`` in ``out_dir``: one line per (item, backend), flushed per item.

    A torn last line (the run was killed while writing it) is dropped on open,
    so that item is simply profiled again; of an item run again (an ``oom``
    under a larger cap), only the later line is kept.
    """

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / ITEMS_JSONL
        self.results: dict[tuple[str, str, str], ItemResult] = {}
        if self.path.exists():
            good: dict[tuple[str, str, str], str] = {}  # a key's later line (an oom item run again) wins
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    result = result_from_json(line)
                except (json.JSONDecodeError, TypeError, KeyError):
                    continue
                self.results[result.key] = result
                good[result.key] = line
            self.path.write_text("".join(f"{line}\n" for line in good.values()), encoding="utf-8")
        self._file = self.path.open("a", encoding="utf-8")

    def __contains__(self, key: tuple[str, str, str]) -> bool:
        return key in self.results

    def append(self, result: ItemResult) -> None:
        self._file.write(result_to_json(result) + "\n")
        self._file.flush()
        self.results[result.key] = result

    def close(self) -> None:
        self._file.close()


# ---------------------------------------------------------------------------
# Worker pool


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
    (:func:`~cdbench.profile.worker.die_with_parent`; a ``forkserver``
    child would outlive it, its parent being the fork server, which waits for
    its children). The kernel ties a worker to the thread that started it, so
    drive a pool from one thread. Use as a context manager; :meth:`run` yields
    one :class:`ItemResult` per job.
    """

    def __init__(self, config: ProfileConfig) -> None:
        self.config = config
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
            args=(child, self.config.vocab, self.config.plugins, self.config.rollback_every, self.config.backend_options,
                  self.config.worker_memory, str(stderr)),
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


# ---------------------------------------------------------------------------
# The run


@contextmanager
def _progress(enabled: bool, console: Console | None = None) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("{task.description:<24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
    ) as bar:
        yield bar


def check_resume(config: ProfileConfig, out_dir: str | Path) -> dict[str, Any] | None:
    """Raise :class:`ResumeMismatchError` if ``out_dir`` holds results made with other settings; else return
    the stored profile's recorded config (``None``: nothing stored)."""
    out_dir = Path(out_dir)
    path = out_dir / CONFIG_JSON
    stored = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    if stored is not None:
        identity = config.results_identity()
        differing = sorted(k for k in identity if stored.get(k) != identity[k])
        if differing:
            raise ResumeMismatchError(
                f"{out_dir} holds a profile made with different {', '.join(differing)} "
                f"({', '.join(f'{k}={stored.get(k)!r}' for k in differing)}); use another --out, or --overwrite to "
                "start afresh"
            )
    return stored


def _record_config(config: ProfileConfig, out_dir: Path) -> None:
    path = out_dir / CONFIG_JSON
    path.write_text(json.dumps(config.model_dump(), indent=2) + "\n", encoding="utf-8")


def profile_tasks(
    config: ProfileConfig,
    tasks: list[ProfileTask],
    out_dir: str | Path,
    progress: bool = True,
    on_result: Callable[[ItemResult], None] | None = None,
    console: Console | None = None,
) -> tuple[ResultStore, int]:
    """Profile ``tasks`` on every backend of ``config`` into ``out_dir/items.jsonl``.

    Jobs already stored there are skipped (resume); an ``oom`` result is run
    again when ``config.worker_memory`` is larger than the stored run's cap. With
    ``progress``, one bar per backend counts its items done (stored ones
    included) on ``console`` (rich's default when ``None``). Returns the store
    and the number of new results.
    """
    out_dir = Path(out_dir)
    earlier_cap = (check_resume(config, out_dir) or {}).get("worker_memory")
    retry_oom = earlier_cap is not None and config.worker_memory > earlier_cap
    out_dir.mkdir(parents=True, exist_ok=True)
    _record_config(config, out_dir)
    for plugin in config.plugins:
        load_plugin(plugin)
    store = ResultStore(out_dir)

    def pending(key: tuple[str, str, str]) -> bool:
        return key not in store or (retry_oom and store.results[key].status == "oom")

    jobs = [
        (backend, task)
        for task in tasks
        for backend in config.backends
        if pending((task.corpus, task.item_id, backend))
    ]
    new = 0
    try:
        with _progress(progress, console) as bar, WorkerPool(config) as pool:
            bars = {}
            if bar is not None:
                for backend in config.backends:
                    done = sum(1 for t in tasks if not pending((t.corpus, t.item_id, backend)))
                    bars[backend] = bar.add_task(backend, total=len(tasks), completed=done)
            for result in pool.run(jobs):
                store.append(result)
                new += 1
                if on_result is not None:
                    on_result(result)
                if bar is not None:
                    bar.advance(bars[result.backend])
    finally:
        store.close()
    return store, new


def prepare_tasks(config: ProfileConfig, progress: bool = True) -> PreparedTasks:
    """Load the corpora and build each item's valid and invalid instances (seeded)."""
    from cdbench.backends.vocab import load_vocab
    from cdbench.profile import sources
    from cdbench.profile.mutations import mutate
    from cdbench.workloads.instances import PoolCache
    from cdbench.workloads.validate import validity_check

    vocab = load_vocab(config.vocab)
    eos = vocab.eos_token_ids[0]
    prepared = PreparedTasks(tasks=[])
    loaded: list[sources.SourceItem] = []
    for corpus in config.corpora:
        items, skipped = sources.load_items(corpus, config.limit)
        prepared.skipped.extend(skipped)
        loaded.extend(items)

    def instance(text: str, label: str) -> Instance:
        return Instance(text, tuple(vocab.encode(text)) + (eos,), label)

    cache = PoolCache()
    with _progress(progress) as bar:
        bar_id = bar.add_task("instances", total=len(loaded)) if bar is not None else None
        for item in loaded:
            valid, failure = sources.oracle_instances(item, vocab, config.valid_instances, config.seed, cache)
            invalid = []
            if valid:
                # One stream per item id, so an item's mutations do not depend on the other items.
                digest = hashlib.blake2b(f"{item.corpus}/{item.item_id}".encode(), digest_size=8).digest()
                rng = np.random.default_rng([config.seed, int.from_bytes(digest, "little")])
                mutations = mutate(item.spec, valid[0][0], validity_check(item.spec), rng, config.invalid_instances)
                invalid = [instance(m.text, m.label) for m in mutations]
            prepared.tasks.append(ProfileTask(
                item.corpus, item.item_id, item.spec,
                tuple(Instance(text, tokens) for text, tokens in valid), tuple(invalid), failure,
            ))
            if bar is not None:
                bar.advance(bar_id)
    return prepared


def run_profile(config: ProfileConfig, out_dir: str | Path, progress: bool = True) -> ProfileRun:
    """Prepare, profile (resumably), and write the parquet files, profiles and report."""
    from cdbench.profile.outputs import write_outputs

    out_dir = Path(out_dir)
    # Before the instances are built (and cached on disk): a refused resume leaves no trace.
    check_resume(config, out_dir)
    prepared = prepare_tasks(config, progress)
    store, new = profile_tasks(config, prepared.tasks, out_dir, progress)
    wanted = {(t.corpus, t.item_id, b) for t in prepared.tasks for b in config.backends}
    results = [r for k, r in store.results.items() if k in wanted]
    files = write_outputs(results, config, out_dir, skipped=prepared.skipped)
    logged = sum(is_logged_warning(w) for r in results for w in r.warnings)
    return ProfileRun(out_dir, len(results), new, prepared.skipped, files, logged,
                      sum(r.status == "oom" for r in results))
