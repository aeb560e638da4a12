"""The profile workers' memory cap: an item past it is ``oom``, reported, and the next item runs in a fresh worker."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import load_vocab
from cdbench.cli.app import app
from cdbench.harness.costs.grammar_profile import GrammarProfile
from cdbench.backends.measure_pool import WORKER_MEMORY_SHARE
from cdbench.profile.runner import ProfileConfig, profile_tasks
from cdbench.backends.measure_worker import Instance, ProfileTask

PLUGIN = str(Path(__file__).with_name("profile_backends.py"))


@pytest.fixture(scope="module")
def vocab():
    return load_vocab("cl100k")


def _task(vocab, item_id: str, options: list[str], valid: list[str] = ()) -> ProfileTask:
    eos = vocab.eos_token_ids[0]
    return ProfileTask("toy", item_id, ConstraintSpec("choice", options),
                       valid=tuple(Instance(v, tuple(vocab.encode(v)) + (eos,)) for v in valid))


def test_an_item_past_the_cap_is_oom_and_the_profile_goes_on_in_a_fresh_worker(vocab, tmp_path):
    # 2 GB asked under a 200 MB cap: refused by the cap (without one it is only reserved, never touched).
    tasks = [
        _task(vocab, "before", ["alpha", "beta"], valid=["alpha"]),
        _task(vocab, "compile", ["HOG 2000"]),
        _task(vocab, "walk", ["WALKHOG 2000"], valid=["WALKHOG 2000"]),
        _task(vocab, "after", ["gamma delta", "epsilon"], valid=["gamma delta"]),
    ]
    config = ProfileConfig(backends=["toy_crashy"], corpora=["toy"], vocab="cl100k", plugins=[PLUGIN],
                           worker_memory="200MB")
    store, new = profile_tasks(config, tasks, tmp_path, progress=False)
    status = {key[1]: r for key, r in store.results.items()}
    assert new == 4
    assert status["compile"].status == "oom" and status["compile"].compile_ms is None
    assert status["compile"].message == "out of memory while compiling (worker memory cap 200.0MB)"
    assert status["walk"].status == "oom" and status["walk"].compile_ms is not None
    assert "out of memory while walking the instances" in status["walk"].message
    assert status["before"].status == "ok" and status["after"].status == "ok"
    assert status["after"].false_rejects == 0 and status["after"].tokens.fill_us


def test_a_native_engine_aborting_for_memory_is_oom(tmp_path):
    """outlines-core (Rust) aborts on a failed allocation; its last words on stderr say why.

    The schema's long string bound makes outlines-core build a large index (about 300 MB beyond its
    construction with this vocabulary); its construction takes about 12 MB, within the cap.
    """
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 300}}, "required": ["name"]}
    tasks = [ProfileTask("real", "long-string", ConstraintSpec("json_schema", schema))]
    config = ProfileConfig(backends=["outlines"], corpora=["real"], vocab="cl100k", worker_memory="60MB")
    store, _ = profile_tasks(config, tasks, tmp_path, progress=False)
    (result,) = store.results.values()
    assert result.status == "oom", result
    assert "worker killed by SIGABRT: memory allocation of" in result.message
    assert result.message.endswith("(worker memory cap 60.0MB)")


def test_the_default_cap_is_a_share_of_the_available_memory_per_worker():
    one, two = (ProfileConfig(backends=["toy"], corpora=["c"], workers=n).worker_memory for n in (1, 2))
    total = psutil.virtual_memory().total
    assert 0 < one <= WORKER_MEMORY_SHARE * total and two == pytest.approx(one / 2, rel=0.2)


def test_the_cli_takes_the_cap_reports_the_oom_item_in_one_line_and_keeps_the_rest(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": item_id, "kind": "choice", "spec": spec, "source": "tests",
                                          "license": "MIT"}) + "\n"
                              for item_id, spec in (("hog", ["HOG 2000"]), ("fine", ["yes", "no"]))))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["profile", "--backends", "toy_crashy", "--corpus", str(corpus), "--vocab",
                                      "cl100k", "--plugin", PLUGIN, "--out", str(out), "--no-progress",
                                      "--worker-memory", "200MB"])
    assert result.exit_code == 0, result.output
    assert "2 results (2 new)" in result.output
    assert "oom: 1 item ran out of the 200.0MB worker memory cap (--worker-memory)" in result.output
    report = (out / "report.md").read_text()
    assert "out of memory while compiling (worker memory cap 200.0MB)" in report and "worker memory=200.0MB" in report
    assert GrammarProfile.load(out / "profile_toy_crashy.parquet").kinds["choice"].statuses == {"ok": 1, "oom": 1}

    bad = CliRunner().invoke(app, ["profile", "--backends", "toy", "--corpus", str(corpus), "--plugin", PLUGIN,
                                   "--out", str(tmp_path / "bad"), "--worker-memory", "lots"])
    assert bad.exit_code == 2 and bad.output.strip() == "error: --worker-memory 'lots' is not a size (e.g. 8GB, 512MiB)"



def test_a_resume_with_a_larger_cap_tries_the_oom_items_again(vocab, tmp_path):
    tasks = [_task(vocab, "fits", ["alpha", "beta"], valid=["alpha"]), _task(vocab, "hog", ["HOG 2000"])]

    def profile(cap: str):
        config = ProfileConfig(backends=["toy_crashy"], corpora=["toy"], vocab="cl100k", plugins=[PLUGIN],
                               worker_memory=cap)
        store, new = profile_tasks(config, tasks, tmp_path, progress=False)
        return {key[1]: r.status for key, r in store.results.items()}, new

    assert profile("200MB") == ({"fits": "ok", "hog": "oom"}, 2)
    assert profile("200MB") == ({"fits": "ok", "hog": "oom"}, 0)  # the same cap: nothing to try again
    assert profile("100MB") == ({"fits": "ok", "hog": "oom"}, 0)  # a smaller one neither
    assert profile("3GB") == ({"fits": "ok", "hog": "ok"}, 1)  # the 2 GB item now fits; the ok item stays
    # the store read afresh keeps the later result
    assert profile("3GB") == ({"fits": "ok", "hog": "ok"}, 0)
    assert len((tmp_path / "items.jsonl").read_text().splitlines()) == 2  # the superseded oom line is gone
