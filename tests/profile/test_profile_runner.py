"""The profile runner: isolation (crash, timeout, a killed parent), correctness checks, resume, progress."""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.registry import create_backend
from cdbench.backends.vocab import load_vocab
from cdbench.profile.runner import (
    CONFIG_JSON,
    ProfileConfig,
    ResumeMismatchError,
    profile_tasks,
    run_profile,
)
from cdbench.backends.measure_worker import (
    Instance,
    ProfileTask,
    load_plugin,
    profile_item,
    watch_parent,
)

PLUGIN = str(Path(__file__).with_name("profile_backends.py"))
REPO = Path(__file__).resolve().parents[2]
# Generous bounds for a process to appear or go away on a loaded machine; the
# tests wait for an event, they do not time it.
EVENT_DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def vocab():
    return load_vocab("cl100k")


def _instance(vocab, text: str, label: str = "oracle") -> Instance:
    return Instance(text, tuple(vocab.encode(text)) + (vocab.eos_token_ids[0],), label)


def _task(vocab, item_id: str, options: list[str], valid: list[str] = (), invalid: list[str] = ()) -> ProfileTask:
    return ProfileTask(
        corpus="toy",
        item_id=item_id,
        spec=ConstraintSpec("choice", options),
        valid=tuple(_instance(vocab, v) for v in valid),
        invalid=tuple(_instance(vocab, v, "mutated") for v in invalid),
    )


def _config(backends: list[str], **overrides) -> ProfileConfig:
    return ProfileConfig(backends=backends, corpora=["toy"], vocab="cl100k", plugins=[PLUGIN], **overrides)


def test_compile_crash_and_timeout_are_recorded_and_the_profile_goes_on(vocab, tmp_path):
    tasks = [
        _task(vocab, "before", ["alpha", "beta"], valid=["alpha"]),
        _task(vocab, "crash", ["CRASH now"], valid=["CRASH now"]),
        _task(vocab, "hang", ["HANG here"], valid=["HANG here"]),
        _task(vocab, "after", ["gamma delta", "epsilon"], valid=["gamma delta"]),
    ]
    config = _config(["toy_crashy"], compile_timeout_s=2.0)
    store, new = profile_tasks(config, tasks, tmp_path, progress=False)
    status = {key[1]: r for key, r in store.results.items()}
    assert new == 4
    assert status["before"].status == "ok" and status["after"].status == "ok"
    assert status["crash"].status == "crash" and "SIGABRT" in status["crash"].message
    assert status["hang"].status == "timeout" and "compile exceeded 2 s" in status["hang"].message
    assert status["crash"].compile_ms is None and status["hang"].compile_ms is None
    # The item after the crash and the hang was still measured, token by token, by a fresh worker.
    assert status["after"].compile_ms is not None
    assert len(status["after"].tokens.fill_us) == len(tasks[-1].valid[0].tokens)
    assert status["after"].false_rejects == 0


@pytest.mark.slow
def test_crash_and_timeout_during_the_walk_keep_the_compile_time(vocab, tmp_path):
    tasks = [
        _task(vocab, "walkcrash", ["WALKCRASH"], valid=["WALKCRASH"]),
        _task(vocab, "walkhang", ["WALKHANG"], valid=["WALKHANG"]),
        _task(vocab, "after", ["gamma delta", "epsilon"], valid=["gamma delta"]),
    ]
    config = _config(["toy_crashy"], walk_timeout_s=2.0)
    store, _ = profile_tasks(config, tasks, tmp_path, progress=False)
    status = {key[1]: r for key, r in store.results.items()}
    assert status["walkcrash"].status == "crash" and "SIGABRT" in status["walkcrash"].message
    assert status["walkhang"].status == "timeout" and "instance walk exceeded 2 s" in status["walkhang"].message
    assert status["walkcrash"].compile_ms is not None and status["walkhang"].compile_ms is not None
    assert status["after"].status == "ok" and status["after"].false_rejects == 0


def test_false_rejects_and_false_accepts_are_detected(vocab, tmp_path):
    tasks = [_task(vocab, "ab", ["abc", "xyz"], valid=["abc", "xyz"], invalid=["abd", "xy"])]
    # Two workers share the three jobs; results come back in completion order.
    config = _config(["toy", "toy_strict", "toy_lenient"], workers=2)
    store, _ = profile_tasks(config, tasks, tmp_path, progress=False)
    assert len(store.results) == 3
    by_backend = {key[2]: r for key, r in store.results.items()}

    correct = by_backend["toy"]
    assert (correct.n_valid, correct.false_rejects, correct.n_invalid, correct.false_accepts) == (2, 0, 2, 0)

    strict = by_backend["toy_strict"]
    assert strict.false_rejects == 1 and strict.false_accepts == 0
    assert strict.first_reject_position == 0
    assert "[[abc]]" in strict.first_reject_text and "refused by accept" in strict.first_reject_text

    lenient = by_backend["toy_lenient"]
    assert lenient.false_rejects == 0
    assert lenient.false_accepts == 2 and lenient.false_accept_labels == ["mutated", "mutated"]


def test_mask_and_accept_disagreements_missing_termination_and_warnings_are_recorded(vocab):
    # In-process: profile_item is what a worker runs per job.
    load_plugin(PLUGIN)
    task = _task(vocab, "ab", ["abc", "xyz"], valid=["xyz", "abc"], invalid=["abd"])
    n_abc = len(task.valid[1].tokens)

    def run(backend: str):
        return profile_item(backend, create_backend(backend, vocab), task, 0, vocab.decode)

    masky = run("toy_masky")
    # "xyz" passes; "abc" is accepted but its first token is not in the mask.
    assert (masky.n_valid, masky.false_rejects, masky.first_reject_position) == (2, 1, 0)
    assert masky.first_reject_text.endswith("[[abc]] (accepted but masked out)")

    endless = run("toy_endless")
    assert endless.false_rejects == 2 and endless.first_reject_position == len(task.valid[0].tokens)
    assert endless.first_reject_text == "xyz<|endoftext|>[[]] (not terminated after the last token)"
    assert endless.false_accepts == 0  # nothing terminates, so no invalid instance gets through

    warns = run("toy_warns")
    assert warns.warnings == ["toy: option order not enforced"]
    assert (warns.status, warns.false_rejects, warns.false_accepts) == ("ok", 0, 0)
    assert len(warns.tokens.fill_us) == len(task.valid[0].tokens) + n_abc
    assert run("toy").warnings == []


def test_rollback_and_accept_times_are_recorded(vocab):
    load_plugin(PLUGIN)
    text = "one two three four five six seven eight"
    task = _task(vocab, "long", [text], valid=[text])
    result = profile_item("toy", create_backend("toy", vocab), task, 2, vocab.decode)
    times = result.tokens
    n = len(task.valid[0].tokens)
    assert times.position == list(range(n))
    assert all(t > 0 for t in times.fill_us) and all(t > 0 for t in times.accept_us)
    # Every 2nd token but the last (EOS) is rolled back and accepted again.
    rolled = [p for p, r in zip(times.position, times.rollback_us) if r is not None]
    assert rolled == [p for p in range(1, n - 1, 2)]
    assert result.false_rejects == 0


@pytest.mark.slow
def test_an_interrupted_profile_resumes_without_losing_or_repeating_items(vocab, tmp_path):
    # An exception in the parent (Ctrl-C, say); a killed parent is tested below.
    tasks = [_task(vocab, f"item{i}", [f"option {i}", "other"], valid=[f"option {i}"]) for i in range(3)]
    config = _config(["toy"])

    class Interrupt(Exception):
        pass

    def stop_after_two(result, seen=[]):  # noqa: B006 - counts across calls on purpose
        seen.append(result)
        if len(seen) == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        profile_tasks(config, tasks, tmp_path, progress=False, on_result=stop_after_two)
    assert len((tmp_path / "items.jsonl").read_text().splitlines()) == 2
    store, new = profile_tasks(config, tasks, tmp_path, progress=False)
    assert new == 1
    stored = [json.loads(line)["item_id"] for line in (tmp_path / "items.jsonl").read_text().splitlines()]
    assert sorted(stored) == ["item0", "item1", "item2"]


def test_a_resume_with_different_settings_is_refused_before_anything_is_built(vocab, tmp_path, monkeypatch):
    corpus = tmp_path / "tiny.jsonl"
    corpus.write_text(json.dumps({"id": "c", "kind": "choice", "spec": ["red", "blue"], "source": "t", "license": "MIT"}) + "\n")
    out, cache = tmp_path / "out", tmp_path / "cache"
    monkeypatch.setenv("CDBENCH_CACHE_DIR", str(cache))
    out.mkdir()
    stored = json.dumps(_config(["toy"]).model_dump())
    (out / CONFIG_JSON).write_text(stored)
    mismatched = ProfileConfig(backends=["toy"], corpora=[str(corpus)], vocab="cl100k", plugins=[PLUGIN], seed=7)
    with pytest.raises(ResumeMismatchError, match="seed"):
        run_profile(mismatched, out, progress=False)
    with pytest.raises(ResumeMismatchError, match=r"seed=0"):
        profile_tasks(mismatched, [_task(vocab, "c", ["red", "blue"], valid=["red"])], out, progress=False)
    # No instance pool was built (they are cached on disk as they are made), nothing written.
    assert not cache.exists()
    assert [p.name for p in out.iterdir()] == [CONFIG_JSON]
    assert (out / CONFIG_JSON).read_text() == stored


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie nobody reaped counts as exited)."""
    stat = Path(f"/proc/{pid}/stat")
    if stat.parent.parent.is_dir():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError):
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_for(condition, what: str):
    deadline = time.monotonic() + EVENT_DEADLINE_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {EVENT_DEADLINE_S:g} s")


_PROFILE_SCRIPT = """
import pickle, sys
from cdbench.profile.runner import profile_tasks
config, tasks, out = pickle.loads(open(sys.argv[1], "rb").read())
profile_tasks(config, tasks, out, progress=False)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_killed_profile_takes_its_worker_along_and_resumes_where_it_stopped(vocab, tmp_path):
    from rich.console import Console

    pidfile, out = tmp_path / "worker.pid", tmp_path / "out"
    tasks = [
        _task(vocab, "a", ["alpha", "beta"], valid=["alpha"]),
        _task(vocab, "b", ["beta", "gamma"], valid=["gamma"]),
        _task(vocab, "hang", [f"HANG pidfile={pidfile}"]),
    ]
    # Jobs go item by item, backends in this order: toy_crashy hangs on the last job.
    backends = ["toy", "toy_crashy"]
    job = tmp_path / "job.pickle"
    # The compile timeout is far beyond the test: only the parent's death can end the hang.
    job.write_bytes(pickle.dumps((_config(backends, compile_timeout_s=3600), tasks, out)))
    parent = subprocess.Popen([sys.executable, "-c", _PROFILE_SCRIPT, str(job)], cwd=REPO)
    worker = None

    def hanging_worker() -> int | None:
        assert parent.poll() is None, f"the profile process exited early (status {parent.returncode})"
        return pidfile.exists() and int(pidfile.read_text())

    try:
        worker = _wait_for(hanging_worker, "the hanging compile")
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        _wait_for(lambda: _gone(worker), f"the exit of worker {worker} after its parent was killed")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if worker is not None and not _gone(worker):
            os.kill(worker, signal.SIGKILL)

    # One worker takes the jobs in order: all but the hanging one were stored before it began.
    items = out / "items.jsonl"
    lines = items.read_text().splitlines()
    assert [(json.loads(line)["item_id"], json.loads(line)["backend"]) for line in lines] == [
        ("a", "toy"), ("a", "toy_crashy"), ("b", "toy"), ("b", "toy_crashy"), ("hang", "toy")
    ]
    # A kill in the middle of a write leaves a torn last line: that result is dropped and made again.
    items.write_text("".join(f"{line}\n" for line in lines[:-1]) + lines[-1][: len(lines[-1]) // 2])

    screen = io.StringIO()
    # The compile timeout is not part of the results' identity, so the rerun resumes.
    store, new = profile_tasks(
        _config(backends, compile_timeout_s=1.0), tasks, out, console=Console(file=screen, width=100)
    )
    assert new == 2
    assert {(k[1], k[2]): r.status for k, r in store.results.items() if k[1] == "hang"} == {
        ("hang", "toy"): "ok", ("hang", "toy_crashy"): "timeout"
    }
    stored = [(json.loads(line)["item_id"], json.loads(line)["backend"]) for line in items.read_text().splitlines()]
    assert sorted(stored) == sorted((t.item_id, b) for t in tasks for b in backends)
    # One progress bar per backend, counting the results stored before the kill too.
    bars = {(line.split()[0], line.split()[2]) for line in screen.getvalue().splitlines() if line.strip()}
    assert bars == {("toy", "3/3"), ("toy_crashy", "3/3")}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_the_portable_fallback_ends_a_process_whose_parent_was_killed():
    # The fallback of die_with_parent, tested directly: parent -> child -> grandchild
    # watching the child; the child is killed, the grandchild must follow.
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child
        try:
            if os.fork() == 0:
                watch_parent(poll_s=0.05)
                os.write(write_end, f"{os.getpid()}\n".encode())
            time.sleep(3600)
        finally:
            os._exit(0)
    os.close(write_end)
    grandchild = None
    try:
        with os.fdopen(read_end) as pipe:
            grandchild = int(pipe.readline())
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        _wait_for(lambda: _gone(grandchild), f"the exit of process {grandchild} after its parent was killed")
    finally:
        if grandchild is not None and not _gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_plugins_load_by_path_or_module_and_bad_ones_are_named(tmp_path, monkeypatch):
    import sys

    from cdbench.backends.registry import available_backends
    from cdbench.backends.measure_worker import load_plugin

    load_plugin(PLUGIN)
    assert {"toy", "toy_lenient", "toy_strict", "toy_crashy"} <= set(available_backends())
    (tmp_path / "cdbench_hook_plugin.py").write_text("CALLED = []\ndef register():\n    CALLED.append(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    load_plugin("cdbench_hook_plugin:register")
    assert sys.modules["cdbench_hook_plugin"].CALLED == [1]
    with pytest.raises(ValueError, match="does not exist"):
        load_plugin(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="cannot be imported"):
        load_plugin("no_such_module_for_cdbench")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        load_plugin("json:nope")
