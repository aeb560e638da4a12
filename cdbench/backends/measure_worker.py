"""The subprocess side of ``cdbench profile``: real engine calls, timed.

A worker process loads the vocabulary once, builds each backend the first time
a task names it (construction is not compile time), and then, per task:
compiles the spec cold, walks the valid instances token by token timing the
first fill after each token, accept and rollback, and feeds the invalid
instances to check they are rejected. It talks to the parent over a pipe:

``("compiling",)`` when the timed compile starts (the parent's timeout clock),
``("compiled", status)`` when it ends, then ``("done", ItemResult)``.

Engine calls run here and not in the parent so that a hang can be killed and a
segfault only takes this process down (see :mod:`cdbench.backends.measure_pool`).
Memory is capped here too (:func:`cap_memory`), so one item that needs more
than its share (outlines-core can need tens of GB on a JSON schema with long
string bounds) ends as ``oom`` instead of taking the machine down.
A worker ends with its parent, even one killed by SIGKILL
(:func:`die_with_parent`), so a compile hanging in it never outlives the run.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import importlib.util
import os
import resource
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil

from cdbench.backends.base import (
    CompileError,
    ConstraintSpec,
    GrammarBackend,
    MaskFormat,
    Matcher,
)

ItemStatus = Literal["ok", "unsupported", "error", "timeout", "crash", "oom"]


@dataclass(frozen=True)
class Instance:
    """One text to feed a grammar, tokenized; ``label`` says how it was made."""

    text: str
    tokens: tuple[int, ...]
    label: str = "oracle"


@dataclass(frozen=True)
class ProfileTask:
    """One corpus item with its instances: the unit a worker profiles per backend."""

    corpus: str
    item_id: str
    spec: ConstraintSpec
    valid: tuple[Instance, ...] = ()
    invalid: tuple[Instance, ...] = ()
    instance_failure: str = ""

    @property
    def kind(self) -> str:
        return self.spec.kind


@dataclass(frozen=True)
class BatchWalkTask:
    """A run's texts walked the way its batches walk them: ``walks[i] = (s, tokens)`` is the ``i``-th
    structured request in arrival order, walking ``tokens`` under ``specs[s]``; up to ``width`` walks
    advance together, one fill each per step, a finished walk's slot taken by the next (see
    :func:`walk_in_batch`). ``gap_s``: seconds each step sleeps between its fills and its accepts, as an
    engine's loop waits for the step's forward there (0: none). ``compiles``: the specs are compiled
    ``before`` the walk, or ``between`` its steps, each where its first walk joins."""

    corpus: str
    item_id: str
    specs: tuple[ConstraintSpec, ...]
    walks: tuple[tuple[int, tuple[int, ...]], ...]
    width: int
    repeats: int = 1
    gap_s: float = 0.0
    compiles: Literal["before", "between"] = "before"
    kind: str = "batch"
    instance_failure: str = ""


@dataclass
class TokenTimes:
    """Per-token measurements of the valid-instance walks of one item (parallel lists)."""

    instance: list[int] = field(default_factory=list)
    position: list[int] = field(default_factory=list)
    fill_us: list[float] = field(default_factory=list)
    accept_us: list[float] = field(default_factory=list)
    rollback_us: list[float | None] = field(default_factory=list)
    forced_tokens: list[int] = field(default_factory=list)


@dataclass
class ItemResult:
    """What one backend did with one corpus item (one row of ``items.parquet``).

    ``false_rejects`` counts valid instances the backend refused, the first one
    located by ``first_reject_position`` (token index) and ``first_reject_text``
    (the text accepted so far, then the refused token's text in ``[[...]]``);
    ``refusals`` lists each refused instance's index and the position it was
    refused at (its length: accepted to the end, but not terminated).
    ``false_accepts`` counts invalid instances it accepted to the end, EOS
    included; ``false_accept_labels`` names their mutations. ``sched_ns``:
    nanoseconds the worker's threads ran and waited for a CPU over the item's
    timed compile and walks, and their wall time (:func:`sched_delta`; ``None``:
    not asked).
    """

    corpus: str
    item_id: str
    kind: str
    backend: str
    status: ItemStatus
    message: str = ""
    compile_ms: float | None = None
    warnings: list[str] = field(default_factory=list)
    instance_failure: str = ""
    n_valid: int = 0
    false_rejects: int = 0
    first_reject_position: int | None = None
    refusals: list[list[int]] = field(default_factory=list)
    first_reject_text: str = ""
    n_invalid: int = 0
    false_accepts: int = 0
    false_accept_labels: list[str] = field(default_factory=list)
    walk_error: str = ""
    tokens: TokenTimes = field(default_factory=TokenTimes)
    sched_ns: tuple[int, int, int] | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.corpus, self.item_id, self.backend)


@dataclass(frozen=True)
class SchedTimes:
    """This process's threads as the kernel's scheduler counted them at ``wall_ns`` (the monotonic clock):
    per thread id, nanoseconds on a CPU and runnable but waiting for one."""

    wall_ns: int
    threads: dict[str, tuple[int, int]]


def sched_times() -> SchedTimes | None:
    """This process's :class:`SchedTimes`, from Linux's ``/proc/self/task/*/schedstat`` (``None`` where the
    kernel does not keep them)."""
    threads: dict[str, tuple[int, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as file:
                on_cpu, waiting, _ = file.read().split()
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        threads[tid] = (int(on_cpu), int(waiting))
    return SchedTimes(time.monotonic_ns(), threads) if threads else None


def sched_delta(before: SchedTimes | None, after: SchedTimes | None) -> tuple[int, int, int] | None:
    """Nanoseconds this process's threads ran on a CPU, and waited runnable for one, between two
    :func:`sched_times` (the threads alive at ``after``), and the wall nanoseconds between the two
    (``None``: not measured). The waiting is the
    threads' own as well as other work's: xgrammar's compile threads outnumbering the cores wait for
    each other (:class:`~cdbench.harness.costs.host.CoreShare` tells the two apart)."""
    if before is None or after is None:
        return None
    on_cpu = waiting = 0
    for tid, (cpu, wait) in after.threads.items():
        cpu0, wait0 = before.threads.get(tid, (0, 0))
        on_cpu, waiting = on_cpu + cpu - cpu0, waiting + wait - wait0
    return on_cpu, waiting, after.wall_ns - before.wall_ns


def sched_since(before: SchedTimes | None) -> tuple[int, int, int] | None:
    """:func:`sched_delta` from ``before`` to now (``None``, reading nothing, where ``before`` is: not asked)."""
    return None if before is None else sched_delta(before, sched_times())


def load_plugin(plugin: str) -> None:
    """Import ``plugin`` so that it registers its backends.

    ``plugin`` is a module name (``tests.profile.profile_backends``), a
    ``module:function`` pair (the function is called with no arguments), or a
    path to a ``.py`` file. Workers import the same plugins as the parent.
    """
    if plugin.endswith(".py"):
        path = Path(plugin).resolve()
        if not path.is_file():
            raise ValueError(f"plugin file {plugin!r} does not exist")
        name = f"cdbench_plugin_{path.stem}"
        if name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return
    module_name, _, attr = plugin.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"plugin {plugin!r} cannot be imported: {exc}") from exc
    if attr:
        hook = getattr(module, attr, None)
        if not callable(hook):
            raise ValueError(f"plugin {plugin!r}: {module_name} has no callable {attr!r}")
        hook()


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def watch_parent(poll_s: float = 1.0) -> None:
    """End this process (exit status 1) once its parent has gone, checked every ``poll_s`` seconds.

    The portable fallback of :func:`die_with_parent`: a daemon thread notices
    that ``os.getppid()`` changed (the process was re-parented). It needs the
    GIL, so an engine call that holds the GIL delays it until the call returns.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def die_with_parent() -> str:
    """Make this process end when its parent does; returns the means used.

    On Linux the kernel kills it with SIGKILL the moment the parent dies
    (``prctl(PR_SET_PDEATHSIG)``), whatever this process is doing; elsewhere
    :func:`watch_parent` polls. A parent that died before this call is noticed
    at the next read or write of the worker's pipe.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            return "prctl"
    watch_parent()
    return "watcher"


def cap_memory(budget: int) -> int:
    """Let this process grow by at most ``budget`` bytes of data from now on; returns the limit set.

    The limit is ``RLIMIT_DATA`` (heap and private writable mappings) at the
    current data size plus ``budget``, set once the worker has started (imports,
    plugins, vocabulary), so ``budget`` is what its engines may use. Not
    ``RLIMIT_AS``: address space counts reservations never touched (glibc's
    per-thread malloc arenas, torch's reserved ranges), so a cap on it fails long
    before memory is used. Past the limit Python raises ``MemoryError``;
    outlines-core and llguidance (Rust) print ``memory allocation of N bytes
    failed`` and abort; xgrammar (C++) raises or aborts, or, when its thread pool
    cannot start a thread, waits until the compile timeout. Measured on a
    2-CPU machine (outlines-core 0.2.14, a compile after construction): with the
    Qwen3.6 vocabulary a two-property object schema adds 9 MiB of data, one
    string with ``maxLength: 300`` adds 1.3 GiB in 104 s and aborts under a
    1000 MiB budget; with cl100k that schema adds about 290 MiB
    (``tests/profile/test_profile_memory.py`` runs it under 60 MB).
    """
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = psutil.Process().memory_info().data + budget
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit


def _allowed(mask_row: Any, token: int, mask_format: MaskFormat) -> bool:
    if mask_format is MaskFormat.BOOL:
        return bool(mask_row[token])
    return bool((int(mask_row[token >> 5]) >> (token & 31)) & 1)


def _compile_timed(backend: GrammarBackend, spec: ConstraintSpec):
    start = time.perf_counter_ns()
    grammar = backend.compile(spec)
    return grammar, (time.perf_counter_ns() - start) / 1e6


def walk_valid(
    backend: GrammarBackend,
    matcher: Matcher,
    instance: Instance,
    index: int,
    times: TokenTimes,
    rollback_every: int,
    decode: Any,
) -> tuple[int, str] | None:
    """Teacher-force ``instance``; record times in ``times``.

    Returns ``None`` when every token was allowed, accepted and the matcher
    terminated after the last one, else ``(position, text)`` of the refusal.
    Only the first fill after each accept is timed: llguidance caches the mask
    of a state, so a second fill would measure the cache.
    """
    mask = backend.allocate_mask(1)
    row = mask.numpy()[0]
    tokens = instance.tokens
    last = len(tokens) - 1
    clock = time.perf_counter_ns
    for pos, token in enumerate(tokens):
        t0 = clock()
        matcher.fill_mask(mask, 0)
        t1 = clock()
        allowed = _allowed(row, token, backend.mask_format)
        forced = len(matcher.jump_forward())
        t2 = clock()
        accepted = matcher.accept(token)
        t3 = clock()
        times.instance.append(index)
        times.position.append(pos)
        times.fill_us.append((t1 - t0) / 1e3)
        times.accept_us.append((t3 - t2) / 1e3)
        times.forced_tokens.append(forced)
        rollback_us = None
        if accepted and rollback_every > 0 and pos % rollback_every == rollback_every - 1 and pos < last:
            t4 = clock()
            matcher.rollback(1)
            rollback_us = (clock() - t4) / 1e3
            if not matcher.accept(token):
                times.rollback_us.append(rollback_us)
                return pos, f"{decode(tokens[:pos])}[[{decode(tokens[pos:pos + 1])}]] (refused after rollback)"
        times.rollback_us.append(rollback_us)
        if not (accepted and allowed):
            if accepted:
                why = "accepted but masked out"
            elif matcher.is_terminated():
                why = "refused: the matcher had already terminated"
            else:
                why = "refused by accept"
            return pos, f"{decode(tokens[:pos])}[[{decode(tokens[pos:pos + 1])}]] ({why})"
    if not matcher.is_terminated():
        return len(tokens), f"{decode(tokens)}[[]] (not terminated after the last token)"
    return None


def accepts_to_end(matcher: Matcher, instance: Instance) -> bool:
    """True when the matcher accepts every token of ``instance`` and terminates."""
    for token in instance.tokens:
        if not matcher.accept(token):
            return False
    return matcher.is_terminated()


def profile_item(
    backend_name: str,
    backend: GrammarBackend,
    task: ProfileTask,
    rollback_every: int,
    decode: Any,
    notify: Any = None,
    pace: bool = False,
) -> ItemResult:
    """Compile ``task.spec`` cold on ``backend`` and check and time its instances.

    ``notify`` (if given) receives ``("compiling",)`` before the timed compile
    and ``("compiled", status, compile_ms)`` after it. ``pace``: set
    ``result.sched_ns`` over the timed compile and walks (:func:`sched_delta`).
    """
    result = ItemResult(
        corpus=task.corpus,
        item_id=task.item_id,
        kind=task.kind,
        backend=backend_name,
        status="ok",
        instance_failure=task.instance_failure,
    )
    if notify:
        notify(("compiling",))
        # the parent wakes to read it: on a core it shares with this process, let it read it now rather
        # than inside the timed compile
        os.sched_yield()
    before = sched_times() if pace else None
    try:
        grammar, result.compile_ms = _compile_timed(backend, task.spec)
    except CompileError as exc:
        result.status = "unsupported" if exc.unsupported else "error"
        result.message = exc.message or str(exc)
    except MemoryError:
        result.status, result.message = "oom", "out of memory while compiling"
    except Exception as exc:  # an engine bug that is not a CompileError is still that item's error
        result.status = "error"
        result.message = f"{type(exc).__name__}: {exc}"
    if notify:
        notify(("compiled", result.status, result.compile_ms))
    if result.status != "ok":
        return result
    result.warnings = list(grammar.warnings)
    if not (task.valid or task.invalid):
        # nothing to walk (a run's compile sequence): no collection either, since a full one empties the
        # caches the next compile would find warm, as no engine's loop does between compiles (xgrammar on
        # Glaive schemas: 2.5 ms a compile after one, 1.5 ms without)
        result.sched_ns = sched_since(before)
        return result
    gc.collect()
    # A collection pause inside a timed call would be charged to the engine.
    gc.disable()
    try:
        for index, instance in enumerate(task.valid):
            result.n_valid += 1
            refusal = walk_valid(
                backend, backend.matcher(grammar), instance, index, result.tokens, rollback_every, decode
            )
            if refusal is not None:
                result.false_rejects += 1
                result.refusals.append([index, refusal[0]])
                if result.first_reject_position is None:
                    result.first_reject_position, result.first_reject_text = refusal
        for instance in task.invalid:
            result.n_invalid += 1
            if accepts_to_end(backend.matcher(grammar), instance):
                result.false_accepts += 1
                result.false_accept_labels.append(instance.label)
    except MemoryError:
        result.status, result.message = "oom", "out of memory while walking the instances"
    except Exception as exc:
        result.walk_error = f"{type(exc).__name__}: {exc}"
    finally:
        gc.enable()
    result.sched_ns = sched_since(before)
    return result


def _compile_specs(backend: GrammarBackend, specs: Sequence[ConstraintSpec], grammars: dict[int, Any], start: int,
                   stop: int) -> int:
    """Compile ``specs[start:stop]`` into ``grammars`` by index (untimed: the compile sequence times them; one
    that does not compile is left out); returns how far the specs are compiled."""
    for at in range(start, stop):
        try:
            grammars[at] = backend.compile(specs[at])
        except CompileError:
            pass
    return max(start, stop)


def walk_in_batch(backend_name: str, backend: GrammarBackend, task: BatchWalkTask) -> ItemResult:
    """Time every fill and accept of ``task``'s walks, interleaved as a batch interleaves them.

    An engine fills the rows of a step one grammar after another into one mask it keeps, then, once
    the step's tokens are sampled, accepts each row's token one grammar after another, so each
    grammar meets caches its neighbours have just used; walked alone, a grammar finds them warm.
    Each of ``task.repeats`` rounds starts from an empty engine cache and compiles its own grammars
    (untimed: the compile sequence times them), so that no round meets grammars an earlier round
    already walked (a grammar keeps what its fills computed); the walks advance together,
    ``task.width`` at a time in arrival order, a finished walk's row taken by the next. The specs
    are compiled in order, all before the walk (``task.compiles`` ``before``) or as the walks meet
    them (``between``: a walk joining compiles every spec up to its own not compiled yet, between the
    steps of the walks in flight, as a run compiles a spec when its request arrives; a compile evicts
    what the walks in flight kept in cache, and their later fills pay for it).
    A walk stops at a token its grammar refuses (as the request would abort); walks of a spec
    that does not compile are skipped. ``tokens.instance`` is the walk's index and
    ``tokens.position`` the answer position of the fill (``fill_us``) and of the accept of the token
    there (``accept_us``, timed alone: the step's accepts come after all its fills, and after
    ``task.gap_s`` of sleep, in which the host's other work may take the caches the fills warmed).
    No draft is walked, so nothing is rolled back (``rollback_us`` holds ``None``).
    """
    result = ItemResult(corpus=task.corpus, item_id=task.item_id, kind=task.kind, backend=backend_name,
                        status="ok")
    mask = backend.allocate_mask(max(1, task.width))
    times, clock = result.tokens, time.perf_counter_ns
    try:
        for _ in range(task.repeats):
            backend.clear_engine_cache()
            grammars: dict[int, Any] = {}  # spec index -> its grammar (absent: it did not compile)
            compiled = 0  # the specs before this index are compiled (or failed to)
            if task.compiles == "before":
                compiled = _compile_specs(backend, task.specs, grammars, 0, len(task.specs))
            waiting = deque((i, s, tokens) for i, (s, tokens) in enumerate(task.walks) if tokens)
            gc.collect()
            gc.disable()  # a collection pause inside a timed fill would be charged to the engine
            active: list[list[Any]] = []  # [walk index, matcher, tokens, position]
            while waiting or active:
                while waiting and len(active) < task.width:
                    index, s, tokens = waiting.popleft()
                    compiled = _compile_specs(backend, task.specs, grammars, compiled, s + 1)
                    if s in grammars:
                        active.append([index, backend.matcher(grammars[s]), tokens, 0])
                for row, walk in enumerate(active):
                    t0 = clock()
                    walk[1].fill_mask(mask, row)
                    times.fill_us.append((clock() - t0) / 1e3)
                    times.instance.append(walk[0])
                    times.position.append(walk[3])
                if task.gap_s:
                    time.sleep(task.gap_s)
                still = []
                for walk in active:  # in the fills' order, so each accept sits beside its row's fill
                    index, matcher, tokens, position = walk
                    t0 = clock()
                    accepted = matcher.accept(tokens[position])
                    times.accept_us.append((clock() - t0) / 1e3)
                    times.rollback_us.append(None)
                    if accepted and position + 1 < len(tokens):
                        walk[3] = position + 1
                        still.append(walk)
                active = still
            gc.enable()
    except MemoryError:
        result.status, result.message = "oom", "out of memory while walking in batch"
    except Exception as exc:
        result.status, result.message = "error", f"{type(exc).__name__}: {exc}"
    finally:
        gc.enable()
    return result


WARM_UP_SPEC = ConstraintSpec("json_schema", {
    "type": "object", "required": ["s"],
    "properties": {"s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
                   "b": {"type": "boolean"}, "a": {"type": "array", "items": {"type": "string"}},
                   "o": {"type": "object", "properties": {"e": {"enum": ["x", "y"]}}}}})
"""What a worker that measures as an engine would compiles before each task, untimed (``warm_up``): the
rules every JSON schema shares, which an engine has compiled long before any spec of a run arrives."""


def warm_up_engine(backend: GrammarBackend) -> None:
    """Put ``backend`` in the state of an engine that has compiled other grammars, but not this one: its
    shared work kept (:data:`WARM_UP_SPEC`), nothing of earlier tasks (so measurements do not depend on
    the order of the tasks)."""
    backend.clear_engine_cache()
    try:
        backend.compile(WARM_UP_SPEC)
    except CompileError:
        pass  # a backend without JSON schemas has nothing to warm


def worker_main(conn: Any, vocab_name: str, plugins: list[str], rollback_every: int, backend_options: dict,
                memory_budget: int, stderr_path: str, warm_up: bool = False, pace: bool = False) -> None:
    """Serve tasks from ``conn`` until it sends ``None`` (the entry point of a worker process).

    ``memory_budget``: bytes the engines may use beyond the worker's start-up
    (:func:`cap_memory`). ``stderr_path``: a file that takes
    this process's descriptor 2, so the parent can read why it died (a native
    engine's last words, e.g. an allocation failure, come only there).
    ``warm_up``: before each task, :func:`warm_up_engine`. ``pace``: each result carries its threads' run
    and wait times over its timed work (:func:`sched_delta`).
    """
    die_with_parent()
    fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    from cdbench.backends.registry import create_backend
    from cdbench.backends.vocab import load_vocab

    for plugin in plugins:
        load_plugin(plugin)
    vocab = load_vocab(vocab_name)
    cap_memory(memory_budget)
    backends: dict[str, GrammarBackend] = {}
    conn.send(("ready",))
    while True:
        message = conn.recv()
        if message is None:
            return
        backend_name, task = message
        if backend_name not in backends:
            try:
                backends[backend_name] = create_backend(
                    backend_name, vocab, **backend_options.get(backend_name, {})
                )
            except Exception as exc:  # reported on the item; the parent decides whether to go on
                conn.send(("done", ItemResult(
                    corpus=task.corpus, item_id=task.item_id, kind=task.kind, backend=backend_name,
                    status="oom" if isinstance(exc, MemoryError) else "error",
                    message=f"backend construction failed: {type(exc).__name__}: {exc}",
                )))
                continue
        if isinstance(task, BatchWalkTask):
            conn.send(("compiled", "ok", None))  # the whole walk runs under the walk deadline
            before = sched_times() if pace else None
            result = walk_in_batch(backend_name, backends[backend_name], task)
            result.sched_ns = sched_since(before)
        else:
            if warm_up:
                warm_up_engine(backends[backend_name])
            result = profile_item(backend_name, backends[backend_name], task, rollback_every, vocab.decode, conn.send,
                                  pace)
        conn.send(("done", result))
