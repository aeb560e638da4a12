"""The profile runner: isolation (crash, timeout), correctness checks, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import load_vocab
from cdbench.harness.profile import ProfileConfig, ResumeMismatchError, ResultStore, profile_tasks
from cdbench.harness.profile_worker import Instance, ProfileTask

PLUGIN = str(Path(__file__).with_name("profile_backends.py"))


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


def test_crash_and_timeout_are_recorded_and_the_profile_goes_on(vocab, tmp_path):
    tasks = [
        _task(vocab, "before", ["alpha", "beta"], valid=["alpha"]),
        _task(vocab, "crash", ["CRASH now"], valid=["CRASH now"]),
        _task(vocab, "hang", ["HANG here"], valid=["HANG here"]),
        _task(vocab, "walkcrash", ["WALKCRASH"], valid=["WALKCRASH"]),
        _task(vocab, "walkhang", ["WALKHANG"], valid=["WALKHANG"]),
        _task(vocab, "after", ["gamma delta", "epsilon"], valid=["gamma delta"]),
    ]
    config = _config(["toy_crashy"], compile_timeout_s=3.0, walk_timeout_s=3.0)
    store, new = profile_tasks(config, tasks, tmp_path, progress=False)
    status = {key[1]: r for key, r in store.results.items()}
    assert new == 6
    assert status["before"].status == "ok" and status["after"].status == "ok"
    assert status["crash"].status == "crash" and "SIGABRT" in status["crash"].message
    assert status["hang"].status == "timeout" and "compile exceeded 3 s" in status["hang"].message
    assert status["hang"].compile_ms is None
    # Deaths and hangs after the compile keep the measured compile time.
    assert status["walkcrash"].status == "crash" and status["walkcrash"].compile_ms is not None
    assert status["walkhang"].status == "timeout" and "instance walk exceeded 3 s" in status["walkhang"].message
    assert status["walkhang"].compile_ms is not None
    # The items after the crash and the hang were still measured, token by token.
    assert status["after"].compile_ms is not None
    assert len(status["after"].tokens.fill_us) == len(tasks[-1].valid[0].tokens)
    assert status["after"].false_rejects == 0


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


def test_rollback_and_accept_times_are_recorded(vocab, tmp_path):
    text = "one two three four five six seven eight"
    tasks = [_task(vocab, "long", [text], valid=[text])]
    store, _ = profile_tasks(_config(["toy"], rollback_every=2), tasks, tmp_path, progress=False)
    (result,) = store.results.values()
    times = result.tokens
    n = len(tasks[0].valid[0].tokens)
    assert times.position == list(range(n))
    assert all(t > 0 for t in times.fill_us) and all(t > 0 for t in times.accept_us)
    # Every 2nd token but the last (EOS) is rolled back and accepted again.
    rolled = [p for p, r in zip(times.position, times.rollback_us) if r is not None]
    assert rolled == [p for p in range(1, n - 1, 2)]
    assert result.false_rejects == 0


def test_an_interrupted_profile_resumes_without_losing_or_repeating_items(vocab, tmp_path):
    tasks = [_task(vocab, f"item{i}", [f"option {i}", "other"], valid=[f"option {i}"]) for i in range(5)]
    config = _config(["toy"])

    class Interrupt(Exception):
        pass

    def stop_after_two(result, seen=[]):  # noqa: B006 - counts across calls on purpose
        seen.append(result)
        if len(seen) == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        profile_tasks(config, tasks, tmp_path, progress=False, on_result=stop_after_two)
    lines = (tmp_path / "items.jsonl").read_text().splitlines()
    assert len(lines) == 2
    # A write torn by the interruption is dropped and that item profiled again.
    with (tmp_path / "items.jsonl").open("a") as f:
        f.write(lines[-1][: len(lines[-1]) // 2])

    store, new = profile_tasks(config, tasks, tmp_path, progress=False)
    assert new == 3
    assert sorted(k[1] for k in store.results) == [f"item{i}" for i in range(5)]
    stored = [json.loads(line)["item_id"] for line in (tmp_path / "items.jsonl").read_text().splitlines()]
    assert sorted(stored) == [f"item{i}" for i in range(5)]
    assert len(ResultStore(tmp_path).results) == 5


def test_resume_with_different_settings_is_refused(vocab, tmp_path):
    tasks = [_task(vocab, "x", ["x1", "x2"], valid=["x1"])]
    profile_tasks(_config(["toy"]), tasks, tmp_path, progress=False)
    with pytest.raises(ResumeMismatchError, match="seed"):
        profile_tasks(_config(["toy"], seed=7), tasks, tmp_path, progress=False)


def test_plugins_load_by_path_or_module_and_bad_ones_are_named(tmp_path, monkeypatch):
    import sys

    from cdbench.backends.registry import available_backends
    from cdbench.harness.profile_worker import load_plugin

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
