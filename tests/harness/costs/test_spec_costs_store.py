"""Model mode's spec prices: the content-addressed store, on-demand measurement, strict and predict, coverage.

The measuring tests run real xgrammar compiles in worker processes on a corpus of a few specs written
here, so they cost seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from cdbench.backends.base import ConstraintSpec
from cdbench.harness.config import RunConfig
from cdbench.harness.costs.grammar_profile import GrammarProfile
from cdbench.harness.costs.host import BENCHMARK_VERSION, HostInfo, this_host
from cdbench.harness.costs.spec_costs import (
    SPEC_SOURCES,
    FailedSpec,
    SpecCostsError,
    SpecCostSettings,
    SpecCoverage,
    price_specs,
)
from cdbench.harness.costs.spec_profile import SpecProfile, spec_key_hash
from cdbench.harness.costs.spec_store import SpecCostEntry, SpecCostStore, spec_digest
from cdbench.harness.run import run
from cdbench.workloads.request import Request

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]},
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}}, "required": ["city"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "number"}}, "required": ["ok", "n"]},
]
BROKEN = {"type": "object", "properties": {"x": {"$ref": "#/definitions/missing"}}}


def _corpus(path: Path, ids: list[str], broken: bool = False) -> Path:
    lines = [{"id": i, "kind": "json_schema", "spec": s, "source": "test", "license": "CC0"}
             for i, s in zip(ids, SCHEMAS)]
    if broken:
        lines.append({"id": "t/broken", "kind": "json_schema", "spec": BROKEN, "source": "test", "license": "CC0"})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _config(corpus: Path, store: Path, **costs) -> RunConfig:
    return RunConfig.model_validate({
        "mode": "model", "vocab": "cl100k",
        # the shipped profile is qwen3.6's: its kind shapes serve specs measured on cl100k here
        # keep: a store measured beside the other tests' work is not measured again (see the contention tests)
        "costs": {"spec_store": str(store), "measure_workers": 1, "allow_mismatched_profile": True,
                  "measure_contended": "keep", **costs},
        "workload": {"num_requests": 24, "corpus": [str(corpus)], "structured_ratio": 1.0,
                     "arrival": {"process": "poisson", "rate": 20.0}},
    })


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One store, filled by a first run over three specs, then a second run over the same corpus."""
    root = tmp_path_factory.mktemp("spec_costs")
    corpus = _corpus(root / "a.jsonl", ["t/a0", "t/a1", "t/a2"], broken=True)
    first = run(_config(corpus, root / "store"))
    second = run(_config(corpus, root / "store"))
    return root, corpus, first, second


def test_a_first_run_measures_every_spec_and_a_second_measures_nothing(measured):
    _, _, first, second = measured
    keys = first.requests.loc[first.requests["structured"], "spec_key"].nunique()
    # the workload's cache-distinct copies of a corpus item are measured once, as their item
    assert first.summary.spec_costs.measured_now == 4
    assert first.summary.spec_costs.specs["measured_here"] == keys
    assert second.summary.spec_costs.measured_now == 0
    assert second.summary.spec_costs.specs["measured_here"] == keys
    # xgrammar reuses work between compiles: the run's specs were also compiled in its order, once
    assert first.summary.spec_costs.compile_order == "run order, measured now"
    assert second.summary.spec_costs.compile_order == "run order"


def test_the_same_store_gives_the_same_run(measured):
    _, _, first, second = measured
    assert first.requests.equals(second.requests)
    assert first.steps.equals(second.steps)


def test_coverage_counts_are_exact(measured):
    _, _, first, _ = measured
    structured = int(first.requests["structured"].sum())
    coverage = first.summary.spec_costs
    assert sum(coverage.requests.values()) == structured
    assert set(coverage.specs) == set(SPEC_SOURCES)
    assert coverage.request_share("measured_here") == 1.0


def test_a_spec_that_fails_to_compile_is_recorded_listed_and_aborts_its_requests(measured):
    _, _, first, _ = measured
    failed = first.summary.spec_costs.failed
    aborted = first.requests[first.requests["abort_reason"] == "compile_error"]
    assert len(aborted) == first.summary.failed > 0
    # listed once, by its item, with every copy of it the run met counted
    assert [f.label for f in failed] == ["t/broken"]
    assert failed[0].copies == aborted["spec_key"].nunique() == first.summary.spec_costs.failed_copies
    assert failed[0].reason.startswith("error: ") and "definitions" in failed[0].reason


def test_the_store_is_content_addressed_so_other_ids_reuse_the_measurements(measured):
    root, _, _, _ = measured
    renamed = _corpus(root / "b.jsonl", ["other/x", "other/y", "other/z"])
    result = run(_config(renamed, root / "store"))
    assert result.summary.spec_costs.measured_now == 0
    assert result.summary.spec_costs.specs["measured_here"] == sum(result.summary.spec_costs.specs.values())


def test_strict_refuses_unmeasured_specs_and_lists_them(tmp_path):
    corpus = _corpus(tmp_path / "c.jsonl", ["t/s0", "t/s1", "t/s2"])
    with pytest.raises(SpecCostsError, match=r"strict' and 3 specs .*: t/s0, t/s1, t/s2;"):
        run(_config(corpus, tmp_path / "empty", spec_costs="strict"))


def test_strict_runs_once_everything_is_measured(measured):
    root, corpus, first, _ = measured
    result = run(_config(corpus, root / "store", spec_costs="strict"))
    assert result.requests.equals(first.requests)


# --- the store and pricing without worker processes --------------------------------------------------


def _host(host_id: str, score: float) -> HostInfo:
    return HostInfo(id=host_id, name=f"cpu-{host_id}", cpu_model="x", cores=2, arch="x86_64", score=score,
                    benchmark_version=BENCHMARK_VERSION, measured="2026-11-26")


def _entry(digest: str, host: HostInfo, compile_s: float) -> SpecCostEntry:
    costs = SpecProfile(kind="regex", status="ok", compile_s=compile_s, fills=4, fill_scale_s=1e-5,
                        fill_curve=[1.0] * 13, fill_residual=[1.0], accept_s=1e-6)
    return SpecCostEntry(digest=digest, backend="xgrammar", backend_version="0.2.8", vocab="cl100k", kind="regex",
                         host=host, status="ok", costs=costs, measured="test")


def test_entries_of_several_hosts_live_side_by_side(tmp_path):
    store = SpecCostStore(tmp_path)
    store.put(_entry("ab" * 16, _host("h1", 1.0), 0.01))
    store.put(_entry("ab" * 16, _host("h2", 2.0), 0.005))
    store.put(_entry("ab" * 16, _host("h1", 1.0), 0.02))  # the same host's later measurement replaces it
    entries = store.entries("ab" * 16)
    assert [(e.host.id, e.costs.compile_s) for e in entries] == [("h1", 0.02), ("h2", 0.005)]
    assert len(store) == 2 and store.entries("cd" * 16) == []


def test_concurrent_writers_never_leave_a_torn_entry(tmp_path):
    store = SpecCostStore(tmp_path)
    threads = [threading.Thread(target=lambda i=i: [store.put(_entry("ef" * 16, _host("h", 1.0), i * 1e-3))
                                                   for _ in range(20)]) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.entries("ef" * 16)) == 1
    assert not list(tmp_path.rglob(".tmp-*"))


def test_a_file_another_process_is_writing_is_not_read(tmp_path):
    # a run sharing the store lists the folder while another run's write is still in its temporary file
    store = SpecCostStore(tmp_path)
    path = store.put(_entry("23" * 16, _host("h1", 1.0), 0.01))
    (path.parent / ".tmp-abc123.json").write_text('{"digest": "23')
    assert [e.host.id for e in store.entries("23" * 16)] == ["h1"]
    assert len(store) == 1


def test_a_damaged_entry_is_named(tmp_path):
    store = SpecCostStore(tmp_path)
    path = store.put(_entry("01" * 16, _host("h", 1.0), 0.01))
    path.write_text("{not json")
    with pytest.raises(ValueError, match=str(path)):
        store.entries("01" * 16)


def test_the_digest_covers_backend_version_vocabulary_options_and_spec():
    spec = ConstraintSpec("regex", "[ab]+")
    base = spec_digest("xgrammar", "0.2.8", "qwen3.6", {}, spec)
    assert base == spec_digest("xgrammar", "0.2.8", "qwen3.6", {}, ConstraintSpec("regex", "[ab]+"))
    others = {spec_digest("llguidance", "0.2.8", "qwen3.6", {}, spec),
              spec_digest("xgrammar", "0.2.9", "qwen3.6", {}, spec),
              spec_digest("xgrammar", "0.2.8", "cl100k", {}, spec),
              spec_digest("xgrammar", "0.2.8", "qwen3.6", {"whitespace": "flexible"}, spec),
              spec_digest("xgrammar", "0.2.8", "qwen3.6", {}, ConstraintSpec("regex", "[ab]*"))}
    assert base not in others and len(others) == 5


def _regex_requests() -> list[Request]:
    return [Request(i, i * 0.1, 16, 8, ConstraintSpec("regex", f"[a-z]{{{i + 1}}}"), f"r/{i}") for i in range(3)]


def test_another_hosts_measurement_is_scaled_by_the_benchmark_ratio(tmp_path, monkeypatch):
    from cdbench.harness.costs import spec_costs, spec_store

    monkeypatch.setattr(spec_store, "backend_version", lambda backend: "0.2.8")
    monkeypatch.setattr(spec_costs, "backend_version", lambda backend: "0.2.8")
    store = SpecCostStore(tmp_path)
    here = this_host(tmp_path)
    there = _host("elsewhere", here.score * 2.0)  # twice as fast: its seconds cost twice as many here
    requests = _regex_requests()
    for r in requests:
        store.put(_entry(spec_digest("xgrammar", "0.2.8", "cl100k", {}, r.spec), there, 0.004))
    profile, coverage = price_specs(GrammarProfile.builtin("xgrammar"), "xgrammar", {}, "cl100k", requests,
                                    SpecCostSettings(spec_store=str(tmp_path), spec_costs="strict"))
    assert coverage.specs["measured_elsewhere"] == 3 and coverage.host_scales == {"cpu-elsewhere": 2.0}
    priced = profile.specs[spec_key_hash("regex:r/0")]
    assert priced.compile_s == pytest.approx(0.008) and priced.fill_scale_s == pytest.approx(2e-5)
    # priced for the other host, nothing is scaled
    (tmp_path / "hosts").mkdir(exist_ok=True)
    (tmp_path / "hosts" / "elsewhere.json").write_text(there.model_dump_json())
    profile, coverage = price_specs(GrammarProfile.builtin("xgrammar"), "xgrammar", {}, "cl100k", requests,
                                    SpecCostSettings(spec_store=str(tmp_path), spec_costs="strict", host="elsewhere"))
    assert coverage.specs["measured_here"] == 3
    assert profile.specs[spec_key_hash("regex:r/0")].compile_s == pytest.approx(0.004)


def test_shipped_profile_prices_its_own_corpus_by_content(tmp_path):
    """The embedded sample's specs are in the shipped profile, found by content: nothing to measure."""
    config = RunConfig.model_validate({"mode": "model", "costs": {"spec_store": str(tmp_path / "s"),
                                                                   "spec_costs": "strict"},
                                       "workload": {"num_requests": 60}})
    result = run(config)
    coverage = result.summary.spec_costs
    assert coverage.specs["profile"] == sum(coverage.specs.values()) > 0
    assert coverage.measured_now == 0


def test_a_profile_of_another_vocabulary_is_not_used_for_its_specs(tmp_path):
    requests = [Request(0, 0.0, 16, 8, ConstraintSpec("regex", "[a-z]+"), "r/x")]
    base = GrammarProfile.builtin("xgrammar")  # measured on qwen3.6
    base = base.model_copy(update={"spec_contents": {next(iter(base.specs)): "irrelevant"}})
    with pytest.raises(SpecCostsError):
        price_specs(base, "xgrammar", {}, "cl100k", requests, SpecCostSettings(spec_store=str(tmp_path),
                                                                               spec_costs="strict"))


def test_coverage_lines_never_hide_a_guess():
    from cdbench.harness.costs.spec_costs import SpecCoverage

    coverage = SpecCoverage(mode="predict", target_host="h", specs={"kind_fallback": 2, "measured_here": 1},
                            requests={"kind_fallback": 5, "measured_here": 5})
    lines = coverage.lines()
    assert "guessed per kind 2 (50% of requests)" in lines[0]
    assert any(line.startswith("warning: 2 specs were priced by a guess per kind") for line in lines)
    assert np.isclose(sum(share for *_, share in coverage.rows()), 1.0)


def test_predict_prices_unmeasured_specs_with_the_predictors_stated_error(tmp_path):
    requests = [Request(i, i * 0.1, 16, 8, ConstraintSpec("json_schema", s), f"p/{i}") for i, s in enumerate(SCHEMAS)]
    profile, coverage = price_specs(GrammarProfile.builtin("xgrammar"), "xgrammar", {}, "qwen3.6", requests,
                                    SpecCostSettings(spec_store=str(tmp_path), spec_costs="predict"))
    assert coverage.specs["predicted"] == 3 and coverage.measured_now == 0
    assert set(coverage.predictor_error) == {"json_schema"}
    assert any(line.startswith("predicted specs: held-out median |error| json_schema compile") for line in coverage.lines())
    priced = profile.specs[spec_key_hash("json_schema:p/0")]
    assert priced.compile_s > 0 and priced.fill_scale_s > 0 and priced.fill_residual
    assert len(SpecCostStore(tmp_path)) == 0  # nothing measured, nothing stored


def test_a_kind_the_predictor_cannot_price_keeps_the_counted_per_kind_fallback(tmp_path):
    requests = [Request(0, 0.0, 16, 8, ConstraintSpec("structural_tag", {"type": "structural_tag", "format": {
        "type": "const_string", "value": "x"}}), "st/0")]
    _, coverage = price_specs(GrammarProfile.builtin("xgrammar"), "xgrammar", {}, "qwen3.6", requests,
                              SpecCostSettings(spec_store=str(tmp_path), spec_costs="predict"))
    assert coverage.specs["kind_fallback"] == 1
    assert any(line.startswith("warning: 1 specs were priced by a guess per kind") for line in coverage.lines())


def test_a_measurement_past_its_timeout_is_recorded_as_timeout_and_aborts_its_requests(tmp_path):
    """outlines-core builds a DFA per regex: this one takes minutes (see backends/outlines.py), far past 2 s."""
    slow = ConstraintSpec("regex", "(a|b)*a(a|b){14}")
    requests = [Request(0, 0.0, 16, 8, slow, "r/slow"), Request(1, 0.1, 16, 8, ConstraintSpec("regex", "[ab]"), "r/fast")]
    settings = SpecCostSettings(spec_store=str(tmp_path), measure_timeout_s=2.0, measure_workers=1)
    profile, coverage = price_specs(GrammarProfile.builtin("outlines"), "outlines", {}, "cl100k", requests, settings)
    assert coverage.failed == [FailedSpec(label="r/slow", copies=1, reason="timeout: compile exceeded 2 s")]
    assert coverage.specs["measured_here"] == 2
    slow_costs = profile.specs[spec_key_hash("regex:r/slow")]
    assert slow_costs.status == "timeout" and slow_costs.compile_s == 2.0
    assert profile.specs[spec_key_hash("regex:r/fast")].status == "ok"


def test_compile_times_in_run_order_replace_each_specs_alone_and_scale_by_host(tmp_path, monkeypatch):
    from cdbench.harness.costs import spec_costs, spec_store
    from cdbench.harness.costs.spec_store import SequenceEntry, sequence_digest

    monkeypatch.setattr(spec_store, "backend_version", lambda backend: "0.2.8")
    monkeypatch.setattr(spec_costs, "backend_version", lambda backend: "0.2.8")
    store = SpecCostStore(tmp_path)
    here = this_host(tmp_path)
    requests = _regex_requests()
    for r in requests:
        store.put(_entry(spec_digest("xgrammar", "0.2.8", "cl100k", {}, r.spec), here, 0.004))
    settings = SpecCostSettings(spec_store=str(tmp_path), spec_costs="strict")
    profile, coverage = price_specs(GrammarProfile.builtin("xgrammar"), "xgrammar", {}, "cl100k", requests, settings)
    assert coverage.compile_order == "alone"  # strict never measures; nothing stored for this order
    assert profile.specs[spec_key_hash("regex:r/1")].compile_s == pytest.approx(0.004)
    faster = _host("fast", here.score * 2.0)
    store.put_sequence(SequenceEntry(
        digest=sequence_digest("xgrammar", "0.2.8", "cl100k", {}, [r.spec for r in requests]), backend="xgrammar",
        backend_version="0.2.8", vocab="cl100k", host=faster, compile_s=[0.010, 0.001, None], measured="test"))
    profile, coverage = price_specs(GrammarProfile.builtin("xgrammar"), "xgrammar", {}, "cl100k", requests, settings)
    assert coverage.compile_order == "run order"
    compiles = [profile.specs[spec_key_hash(f"regex:r/{i}")].compile_s for i in range(3)]
    assert compiles == pytest.approx([0.020, 0.002, 0.004])  # scaled to this host; a failed one keeps its own
    reordered = list(reversed(requests))
    _, coverage = price_specs(GrammarProfile.builtin("xgrammar"), "xgrammar", {}, "cl100k", reordered, settings)
    assert coverage.compile_order == "alone"  # another order is another sequence


def test_a_backend_the_workers_cannot_build_is_not_measured_and_never_silently_guessed(tmp_path):
    """A backend registered in this process only (no plugin) does not exist in the measuring workers."""
    from cdbench.backends.registry import create_backend, register_backend

    register_backend("in-process-only", lambda vocab, **options: create_backend("xgrammar", vocab, **options))
    requests = [Request(0, 0.0, 16, 8, ConstraintSpec("regex", "[ab]+"), "r/0")]
    _, coverage = price_specs(GrammarProfile.builtin("xgrammar"), "in-process-only", {}, "cl100k", requests,
                              SpecCostSettings(spec_store=str(tmp_path), measure_workers=1))
    assert coverage.specs["kind_fallback"] == 1 and coverage.measured_now == 0
    lines = coverage.lines()
    assert any(line.startswith("cannot measure here (backend construction failed") for line in lines)
    assert any(line.startswith("warning: 1 specs were priced by a guess per kind") for line in lines)


def test_a_text_the_grammar_refuses_is_kept_so_model_mode_aborts_its_requests_too(tmp_path):
    from cdbench.backends.vocab import load_vocab
    from cdbench.harness.costs.spec_costs import SpecToMeasure, measure_specs

    vocab = load_vocab("cl100k")
    eos = vocab.eos_token_ids[0]
    good = tuple(vocab.encode("ab")) + (eos,)
    bad = tuple(vocab.encode("ab")) + tuple(vocab.encode("9")) + (eos,)
    spec = ConstraintSpec("regex", "[ab]+")
    settings = SpecCostSettings(spec_store=str(tmp_path), measure_workers=1)
    outcome = measure_specs([SpecToMeasure("r/ab", spec, (good, bad))], "xgrammar", {}, "cl100k", settings)
    assert outcome.measured == 1
    from cdbench.harness.costs.spec_store import backend_version

    (entry,) = SpecCostStore(tmp_path).entries(spec_digest("xgrammar", backend_version("xgrammar"), "cl100k", {}, spec))
    assert (entry.costs.walks, entry.costs.rejected, entry.costs.rejected_at) == (2, 1, len(vocab.encode("ab")))


def test_a_profiles_compile_times_were_measured_in_a_run_and_are_not_replaced_by_the_run_order(tmp_path):
    """The shipped profile was measured in situ (in its run's order): its specs need no sequence pass."""
    config = RunConfig.model_validate({"mode": "model", "costs": {"spec_store": str(tmp_path / "s")},
                                       "workload": {"num_requests": 30}})
    coverage = run(config).summary.spec_costs
    assert coverage.specs["profile"] == sum(coverage.specs.values())
    assert coverage.compile_order == "alone" and len(SpecCostStore(tmp_path / "s")) == 0


# --- measurements that know how contended the host was ----------------------------------------------


def test_a_measurements_pace_counts_only_the_waiting_other_work_explains():
    from cdbench.backends.measure_worker import SchedTimes, sched_delta
    from cdbench.harness.costs.host import CoreShare

    before = SchedTimes(0, {"1": (1_000, 0), "2": (500, 100)})
    after = SchedTimes(9_000, {"1": (3_000, 2_000), "2": (500, 100), "3": (1_000, 0)})  # thread 3 started between
    assert sched_delta(before, after) == (3_000, 2_000, 9_000)
    share = CoreShare()
    share.wall_ns = 10_000
    share.others_ns = 4_000  # others kept the cores busy 4 us of the 10: 3.6 us of them in the timed 9
    assert share.pace(3_000, 2_000, 9_000) == pytest.approx((3_000 + 2_000) / 3_000)
    assert share.pace(3_000, 5_000, 9_000) == pytest.approx((3_000 + 3_600) / 3_000)
    share.others_ns = 0  # nothing else ran: the threads waited for each other
    assert share.pace(3_000, 2_000, 9_000) == 1.0
    assert share.pace(0, 2_000, 9_000) is None


def test_the_share_of_the_cores_counts_other_work_and_not_the_process_own(monkeypatch):
    import os

    from cdbench.harness.costs import host

    mine = sorted(os.sched_getaffinity(0))
    elsewhere = [max(mine) + 1, max(mine) + 2]  # two CPUs this process may not use
    readings = iter([{mine[0]: 100 * 10**9, elsewhere[0]: 0, elsewhere[1]: 50 * 10**9},
                     {mine[0]: 110 * 10**9, elsewhere[0]: 8 * 10**9, elsewhere[1]: 50 * 10**9}])
    monkeypatch.setattr(host, "_busy_ns", lambda: next(readings))
    own = iter([5 * 10**9, 12 * 10**9])
    monkeypatch.setattr(host, "_own_cpu_ns", lambda: next(own))
    clock = iter([0, 10 * 10**9])
    monkeypatch.setattr(host.time, "monotonic_ns", lambda: next(clock))
    with host.CoreShare() as share:
        pass
    assert share.others_ns == 3 * 10**9  # 10 s busy, 7 of them this process's and its ended children's
    assert share.host_busy == pytest.approx(8 / 20)  # the other CPUs: 8 s busy of 2 x 10 s


@pytest.mark.skipif(not Path("/proc/stat").is_file() or len(os.sched_getaffinity(0)) < 2,
                    reason="busy times are Linux's; needs a second CPU")
def test_a_busy_process_on_another_cpu_reads_as_a_busy_host():
    import subprocess
    import sys

    code = """
import os, subprocess, sys, time
mine, other = sorted(os.sched_getaffinity(0))[:2]
busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {other}))
os.sched_setaffinity(0, {mine})
from cdbench.harness.costs.host import CoreShare
try:
    time.sleep(0.3)
    with CoreShare() as share:
        time.sleep(0.6)
    print(share.host_busy, os.cpu_count() - 1)
finally:
    busy.kill()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    host_busy, others = (float(v) for v in out.stdout.split()[-2:])
    assert host_busy >= 0.7 / others  # one busy CPU among the others (its own CPU's load is pace's business)


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="busy times are Linux's")
def test_a_busy_process_beside_on_the_same_core_reads_as_most_of_it_taken():
    import subprocess
    import sys

    code = """
import os, subprocess, sys, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from cdbench.harness.costs.host import others_share_now
busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
try:
    time.sleep(0.2)
    print(others_share_now(0.5))
finally:
    busy.kill()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert float(out.stdout.split()[-1]) > 0.7


@pytest.mark.skipif(not Path("/proc/self/schedstat").is_file(), reason="run-queue times are Linux's")
def test_every_measurement_records_how_contended_its_host_was(measured):
    root, _, _, _ = measured
    store = SpecCostStore(root / "store")
    paces = [json.loads(p.read_text())["pace"] for p in (root / "store").glob("??/*/*.json")]
    sequences = [json.loads(p.read_text())["pace"] for p in (root / "store" / "sequences").glob("*/*/*.json")]
    walks = [json.loads(p.read_text())["pace"] for p in (root / "store" / "batch_fills").glob("*/*/*.json")]
    assert len(paces) == 4 and sequences and walks and len(store) == 4
    assert all(p is not None and p >= 1.0 for p in paces + sequences + walks)


def _set_pace(path: Path, pace: float) -> None:
    entry = json.loads(path.read_text())
    entry["pace"] = pace
    path.write_text(json.dumps(entry))


def _quiet_copy(measured, tmp_path) -> Path:
    """The fixture's store copied, every measurement in it marked as taken on uncontended cores of a quiet
    host (the fixture's own may have shared the cores, or the host, with the other tests)."""
    import shutil

    root, _, _, _ = measured
    store = tmp_path / "store"
    shutil.copytree(root / "store", store)
    for path in store.rglob("*.json"):
        if path.parent.name != "hosts":
            entry = json.loads(path.read_text())
            entry.update(pace=1.0, host_busy=0.0)
            path.write_text(json.dumps(entry))
    return store


def _contended_copy(measured, tmp_path, pace: float) -> Path:
    """The fixture's store copied (quiet), its first spec's entry marked as measured beside other work."""
    store = _quiet_copy(measured, tmp_path)
    path = sorted(p for p in store.glob("??/*/*.json") if json.loads(p.read_text())["status"] == "ok")[0]
    _set_pace(path, pace)
    return path


def test_a_contended_measurement_is_taken_again_once_the_cores_are_freer(measured, tmp_path, monkeypatch):
    from cdbench.harness.costs import spec_costs

    _, corpus, _, second = measured
    path = _contended_copy(measured, tmp_path, pace=3.0)
    monkeypatch.setattr(spec_costs, "others_share_now", lambda: 0.0)
    result = run(_config(corpus, tmp_path / "store", measure_contended="remeasure"))
    coverage = result.summary.spec_costs
    assert coverage.measured_now == 1 and coverage.remeasured == 1
    assert json.loads(path.read_text())["pace"] != 3.0  # replaced by the new measurement
    assert any("taken again" in line for line in coverage.lines())
    assert coverage.specs == second.summary.spec_costs.specs


def test_a_measurement_beside_a_busy_host_is_priced_as_it_is_and_counted(measured, tmp_path):
    _, corpus, _, second = measured
    store = _quiet_copy(measured, tmp_path)
    path = sorted(p for p in store.glob("??/*/*.json") if json.loads(p.read_text())["status"] == "ok")[0]
    entry = json.loads(path.read_text())
    entry["host_busy"] = 0.9
    path.write_text(json.dumps(entry))
    result = run(_config(corpus, store))
    coverage = result.summary.spec_costs
    # the run's specs of that entry's content (a corpus item's copies), not the others
    assert 1 <= coverage.busy_host < coverage.specs["measured_here"]
    assert coverage.contended == 0 and coverage.measured_now == 0
    assert any(line.startswith(f"note: {coverage.busy_host} specs") and "other CPUs" in line
               for line in coverage.lines())
    assert result.requests.equals(second.requests)  # priced as measured


def test_a_contended_measurement_is_kept_and_flagged_while_the_cores_are_as_busy(measured, tmp_path, monkeypatch):
    from cdbench.harness.costs import spec_costs

    _, corpus, _, second = measured
    path = _contended_copy(measured, tmp_path, pace=1.5)
    monkeypatch.setattr(spec_costs, "others_share_now", lambda: 0.5)  # other work keeps half the cores busy
    for mode in ("remeasure", "keep"):
        result = run(_config(corpus, tmp_path / "store", measure_contended=mode))
        coverage = result.summary.spec_costs
        assert coverage.measured_now == 0 and coverage.remeasured == 0
        assert coverage.contended >= 1
        assert any(line.startswith("warning: ") and "shared the host's cores" in line for line in coverage.lines())
        assert result.requests.equals(second.requests)  # priced as measured
    assert json.loads(path.read_text())["pace"] == 1.5


def test_a_compile_sequence_measured_beside_other_work_is_measured_again(measured, tmp_path, monkeypatch):
    from cdbench.harness.costs import spec_costs

    _, corpus, _, _ = measured
    paths = list((_quiet_copy(measured, tmp_path) / "sequences").glob("*/*/*.json"))  # (other corpora's too)
    for path in paths:
        _set_pace(path, 2.0)
    monkeypatch.setattr(spec_costs, "others_share_now", lambda: 0.0)
    result = run(_config(corpus, tmp_path / "store", measure_contended="remeasure"))
    assert result.summary.spec_costs.compile_order == "run order, measured now"
    assert result.summary.spec_costs.remeasured == 1
    assert sum(json.loads(path.read_text())["pace"] != 2.0 for path in paths) == 1
    again = run(_config(corpus, tmp_path / "store"))  # (keep: the new one may have shared the cores too)
    assert again.summary.spec_costs.compile_order == "run order"


def test_a_summary_listing_failed_copies_one_by_one_reads_as_one_entry_an_item():
    """``summary.json`` before failed specs were listed by content: label -> reason, a copy each."""
    old = {"t/a": "error", "t/b#copy1": "unsupported", "t/a#copy3": "error", "t/b#copy2": "unsupported",
           "t/a#copy9": "timeout"}
    coverage = SpecCoverage.model_validate({"mode": "measure", "target_host": "h", "specs": {}, "requests": {},
                                            "failed": old})
    assert [(f.label, f.copies, f.reason) for f in coverage.failed] == [
        ("t/a", 2, "error"), ("t/b", 2, "unsupported"), ("t/a", 1, "timeout")]
    assert coverage.failed_copies == len(old)
    assert coverage.lines()[-1].startswith("3 specs (5 spec keys) failed to measure, their requests abort: "
                                           "t/a: error (2 copies); t/b: unsupported (2 copies); t/a: timeout")
