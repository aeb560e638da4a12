"""Which machine measured a cost, and how fast its CPU is: a host identity and a fixed short CPU benchmark.

Grammar costs (compile, mask fill) are measured on one host and priced in
``model`` mode for another. Those costs are branchy single-threaded native
code (C++ xgrammar, Rust llguidance) plus Python glue, so they scale with a
CPU's single-thread speed on that kind of code, not with its core count or
vector units. :func:`run_benchmark` times a fixed mix of such work that
cdbench ships; its score carries seconds between hosts
(:func:`time_scale`). A host is identified by its CPU model, logical core
count and architecture (:attr:`HostInfo.id`), never by its score, so one
machine keeps one id however noisy its measurements; the benchmark runs once
per id and is cached in ``<store_dir>/hosts/<id>.json`` (:func:`this_host`).

The score is in reference units: ``1.0`` is the speed of the host the
constants :data:`REFERENCE_S` were taken on (an AMD EPYC Zen 4 KVM guest,
CPU family 25 model 17, 2 cores, CPython 3.11); ``2.0`` runs the mix in
half its time. It covers the interpreter as well as the CPU, as grammar
engines' Python glue does.

>>> a = HostInfo(id="a1", name="A (2 cores)", cpu_model="A", cores=2, arch="x86_64", score=2.0,
...              benchmark_version=BENCHMARK_VERSION, measured="2026-01-01")
>>> time_scale(a, a.model_copy(update={"id": "b2", "score": 1.0}))  # a second here costs two there
2.0
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import platform
import random
import re
import resource
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

BENCHMARK_VERSION = 1
"""Bumped whenever the benchmark's work changes: scores of different versions are not comparable."""

REPEATS = 7
"""Times each part runs; its best (least) time counts, the one least disturbed by other load."""

REFERENCE_S = {"python": 0.030, "regex": 0.031, "json": 0.036, "zlib": 0.019}
"""Best thread CPU seconds of each part on the reference host (score 1.0): the median of 8 runs' bests there."""


class HostError(ValueError):
    """A host that is not recorded, an unreadable host record, or scores that cannot be compared."""


class HostInfo(BaseModel):
    """One machine and its benchmark score, as recorded in ``<store_dir>/hosts/<id>.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(description="hash of cpu_model, cores and arch: stable across runs, never of the score")
    name: str = Field(description="human readable, e.g. 'AMD EPYC 7R13 (2 cores)'")
    cpu_model: str
    cores: int = Field(gt=0, description="logical cores this process may use")
    arch: str
    score: float = Field(gt=0, description="run_benchmark(): reference units, higher is faster (1.0: REFERENCE_S)")
    benchmark_version: int
    measured: str = Field(description="ISO date of the benchmark")


# ----------------------------------------------------------------------------- the benchmark

_WORDS = ("alpha", "beta", "gamma", "delta", "object", "string", "number", "items", "required", "properties",
          "minLength", "pattern", "enum", "const", "anyOf", "null", "true", "false")

_PATTERNS = (
    r"[A-Za-z_][A-Za-z0-9_]*",
    r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?",
    r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}",
    r"\d{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])",
    r'"(?:[^"\\]|\\.)*"',
    r"(?:alpha|beta|gamma|delta)_(?:[1-9]|[1-8][0-9]|9[0-6])\b",
    r"(?i)(?:required|properties|pattern)\s+(?:\w+\s+){0,2}\"",
    r"^\w+ = (\d+); (\w+)@(\w+)\.example\.org",
)


def _inputs() -> tuple[str, str]:
    """Fixed text (log-like lines) and a JSON document, from a seeded generator's ``random()`` (whose sequence
    Python keeps across versions)."""
    rng = random.Random(27)

    def pick(words: tuple[str, ...]) -> str:
        return words[int(rng.random() * len(words))]

    lines = []
    for i in range(3000):
        n = int(rng.random() * 10**6)
        lines.append(f"{pick(_WORDS)}_{i % 97} = {n}; user{n % 1000}@host{i % 13}.example.org "
                     f"2024-{1 + n % 12:02d}-{1 + n % 28:02d} {pick(_WORDS)} \"{pick(_WORDS)} {n / 7:.3f}\"")
    doc = [{"id": i, "name": pick(_WORDS) + str(i), "score": round(rng.random() * 100, 4), "ok": i % 3 == 0,
            "tags": [pick(_WORDS) for _ in range(4)], "parent": None if i % 5 else i // 5,
            "nested": {"a": [i, i + 1, {"b": pick(_WORDS)}], "c": "x" * (i % 17)}} for i in range(1500)]
    return "\n".join(lines), json.dumps(doc)


def _python(text: str, _doc: str) -> int:
    """Interpreter work: a character-level tokenizer over a transition table, then counting, sorting, formatting."""
    kinds = dict.fromkeys("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_", "w")
    kinds.update(dict.fromkeys("0123456789", "d"))
    tokens: list[str] = []
    current: list[str] = []
    state = ""
    for ch in text:
        kind = kinds.get(ch, "p")
        if kind != state and current:
            tokens.append("".join(current))
            current = []
        state = kind
        if kind != "p":
            current.append(ch)
    counts: dict[str, int] = {}
    for token in tokens:
        counts[token] = counts.get(token, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return len(",".join(f"{word}:{n}" for word, n in ranked).split(","))


def _regex(text: str, _doc: str) -> int:
    """Regex compiles (parsed in Python, uncached) and matches (C backtracking) over the text."""
    re.purge()
    return sum(len(re.compile(p, re.MULTILINE).findall(text)) for p in _PATTERNS)


def _json(_text: str, doc: str) -> int:
    """JSON parse and serialise (the C accelerator): many small dicts, lists and strings."""
    value = json.loads(doc)
    return len(json.dumps(value, sort_keys=True)) + len(json.dumps(json.loads(json.dumps(value)), indent=1))


def _zlib(text: str, doc: str) -> int:
    """Deflate at two levels (hash-chain match search) and inflate."""
    data = (text + doc).encode()
    return sum(len(zlib.decompress(zlib.compress(data, level))) for level in (1, 6))


_PARTS: dict[str, Callable[[str, str], int]] = {"python": _python, "regex": _regex, "json": _json, "zlib": _zlib}


def run_benchmark() -> float:
    """This machine's score in reference units (higher is faster; 1.0 = the host of :data:`REFERENCE_S`).

    Each part runs :data:`REPEATS` times, the parts taking turns so that a
    burst of other load hits one repeat of each rather than every repeat of
    one; a repeat is timed in thread CPU time with the garbage collector off
    (as ``timeit`` does), and a part's best repeat counts. The score is the
    geometric mean over the parts of ``REFERENCE_S[part] / best``. About 1 s
    on the reference host, single-threaded.
    """
    text, doc = _inputs()
    best = dict.fromkeys(_PARTS, math.inf)
    gc.collect()
    gc.disable()
    try:
        for _ in range(REPEATS):
            for name, part in _PARTS.items():
                start = time.thread_time()
                part(text, doc)
                best[name] = min(best[name], time.thread_time() - start)
    finally:
        gc.enable()
    return math.exp(sum(math.log(REFERENCE_S[n] / best[n]) for n in _PARTS) / len(_PARTS))


# ----------------------------------------------------------------------------- contention

def _busy_ns() -> dict[int, int] | None:
    """Nanoseconds each CPU has been busy since boot, steal included (a hypervisor running something
    else), from ``/proc/stat`` (``None``: not Linux)."""
    try:
        with open("/proc/stat", encoding="ascii") as file:
            lines = file.readlines()
    except OSError:
        return None
    tick_ns = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    busy = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
            busy[int(name[3:])] = (user + nice + system + irq + softirq + steal) * tick_ns
    return busy


def _took(before: dict[int, int], after: dict[int, int], cpus: Iterable[int]) -> int:
    """Busy nanoseconds of ``cpus`` between two :func:`_busy_ns` readings."""
    return sum(after[c] - before.get(c, after[c]) for c in cpus if c in after)


def _own_cpu_ns() -> int:
    """CPU nanoseconds of this process and of its children that have ended (the measuring workers, once
    their pool is closed)."""
    self_, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return round((self_.ru_utime + self_.ru_stime + children.ru_utime + children.ru_stime) * 1e9)


class CoreShare:
    """How much of this process's cores other work took meanwhile (a context manager around a measurement
    whose workers end inside it).

    ``others_ns``: the busy time of the CPUs this process may use, less its own and its ended children's
    CPU time, over ``wall_ns``. :meth:`pace` turns it, with the measured work's run, wait and wall times
    (threads of the workers, :func:`~cdbench.backends.measure_worker.sched_delta`), into how much longer
    that work took than it would have alone: its threads' waiting counts only as far as other work, in
    the timed work's share of the wall time, could have caused it, since a multi-threaded engine's
    threads also wait for each other where they outnumber the cores. ``/proc/stat`` counts in clock
    ticks (10 ms), so a measurement of under a second reads coarsely.

    ``host_busy``: the share of the host's other CPUs (those this process may not use) busy meanwhile
    (``None``: there are none, or not Linux). Work there makes no thread of the measurement wait, so
    :meth:`pace` cannot see it, yet it slows the measurement through the caches and clocks the cores
    share: twelve busy cores of sixteen slowed xgrammar compiles on the other four by up to 16 % at the
    median (``reports/fidelity/live_vs_model.md``, "Out of sample again").
    """

    def __init__(self) -> None:
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.others_ns: int | None = None
        self.host_busy: float | None = None
        self.wall_ns = 0

    def __enter__(self) -> CoreShare:
        self._busy, self._own, self._start = _busy_ns(), _own_cpu_ns(), time.monotonic_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        busy = _busy_ns()
        self.wall_ns = time.monotonic_ns() - self._start
        if busy is None or self._busy is None:
            return
        self.others_ns = max(0, _took(self._busy, busy, self.cpus) - (_own_cpu_ns() - self._own))
        elsewhere = busy.keys() - self.cpus
        if elsewhere and self.wall_ns > 0:
            self.host_busy = min(1.0, _took(self._busy, busy, elsewhere) / (len(elsewhere) * self.wall_ns))

    def pace(self, on_cpu_ns: int, waiting_ns: int, timed_wall_ns: int) -> float | None:
        """(run + the waiting other work explains) / run of timed work that ran ``timed_wall_ns`` of the
        wall time: 1.0 uncontended, 2.0 as beside one busy thread on one core (``None``: not measured, or
        no run time)."""
        if self.others_ns is None or on_cpu_ns <= 0 or self.wall_ns <= 0:
            return None
        others = self.others_ns * min(1.0, timed_wall_ns / self.wall_ns)
        return (on_cpu_ns + min(waiting_ns, others)) / on_cpu_ns


def others_share_now(seconds: float = 0.3) -> float | None:
    """The share of this process's cores that other work keeps busy now, over ``seconds`` of sleep
    (``None``: not Linux)."""
    with CoreShare() as share:
        time.sleep(seconds)
    return None if share.others_ns is None else share.others_ns / (max(1, len(share.cpus)) * share.wall_ns)


# ----------------------------------------------------------------------------- hosts

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _cores() -> int:
    """Logical cores this process may use (its affinity, where that is fewer than the machine's)."""
    cores = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cores = min(cores, len(os.sched_getaffinity(0)))
    return cores


def _record_path(store_dir: Path, host_id: str) -> Path:
    return Path(store_dir) / "hosts" / f"{host_id}.json"


def _read(path: Path) -> HostInfo:
    try:
        return HostInfo.model_validate_json(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise HostError(f"{path}: cannot read host record: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise HostError(f"{path}: invalid host record field {field!r}: {first['msg']}") from exc


def _write(store_dir: Path, host: HostInfo) -> None:
    """Write the record atomically, so a reader never sees half of one."""
    path = _record_path(store_dir, host.id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=f".{host.id}.",
                                     suffix=".tmp", delete=False) as tmp:
        tmp.write(host.model_dump_json(indent=1) + "\n")
    os.replace(tmp.name, path)


def this_host(store_dir: Path, rerun: bool = False) -> HostInfo:
    """This machine's :class:`HostInfo`: its recorded one, else (or with ``rerun``) benchmarked and recorded.

    A record of another :data:`BENCHMARK_VERSION` is measured again.
    """
    cpu_model, cores, arch = _cpu_model(), _cores(), platform.machine() or "unknown"
    host_id = hashlib.sha256(f"{cpu_model}\n{cores}\n{arch}".encode()).hexdigest()[:12]
    path = _record_path(store_dir, host_id)
    if not rerun and path.is_file():
        recorded = _read(path)
        if recorded.benchmark_version == BENCHMARK_VERSION:
            return recorded
    host = HostInfo(id=host_id, name=f"{cpu_model} ({cores} core{'s' if cores != 1 else ''})",
                    cpu_model=cpu_model, cores=cores, arch=arch, score=run_benchmark(),
                    benchmark_version=BENCHMARK_VERSION, measured=datetime.now(UTC).date().isoformat())
    _write(store_dir, host)
    return host


def recorded_hosts(store_dir: Path) -> list[HostInfo]:
    """Every host recorded in ``store_dir``, by name then id."""
    paths = sorted((Path(store_dir) / "hosts").glob("*.json"))
    return sorted((_read(p) for p in paths), key=lambda h: (h.name, h.id))


def load_host(store_dir: Path, name_or_id: str) -> HostInfo:
    """A recorded host by its id, its name, or a prefix of its id that no other recorded id starts with."""
    hosts = recorded_hosts(store_dir)
    matches = [h for h in hosts if name_or_id in (h.id, h.name)]
    if not matches and name_or_id:
        matches = [h for h in hosts if h.id.startswith(name_or_id)]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(f"{h.id} ({h.name})" for h in hosts) or "none"
    what = "matches several hosts" if matches else "is not a recorded host"
    raise HostError(f"host {name_or_id!r} {what} in {Path(store_dir) / 'hosts'}; recorded: {known}")


def time_scale(measured_on: HostInfo, target: HostInfo) -> float:
    """The factor that turns seconds measured on ``measured_on`` into seconds on ``target``: the score ratio."""
    if measured_on.id == target.id:
        return 1.0
    if measured_on.benchmark_version != target.benchmark_version:
        raise HostError(f"hosts {measured_on.id} and {target.id} were scored by benchmark versions "
                        f"{measured_on.benchmark_version} and {target.benchmark_version}; rerun the older")
    return measured_on.score / target.score
