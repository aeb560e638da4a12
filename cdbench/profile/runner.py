"""``cdbench profile``: grammar backends side by side on real corpora.

For every corpus item and backend, a worker process (see
:mod:`cdbench.backends.measure_worker`) compiles the spec cold and times it
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ByteSize, ConfigDict, Field

from cdbench.backends.engine_log import is_logged_warning
from cdbench.backends.measure_pool import WorkerPool, default_worker_memory
from cdbench.backends.measure_worker import (
    Instance,
    ItemResult,
    ProfileTask,
    TokenTimes,
    load_plugin,
)

if TYPE_CHECKING:
    from rich.console import Console

ITEMS_JSONL = "items.jsonl"
CONFIG_JSON = "profile_config.json"
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
    :func:`~cdbench.backends.measure_worker.cap_memory`); left out, it is
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
