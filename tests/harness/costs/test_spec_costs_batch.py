"""Fills and accepts walked in batch: a run's texts walked together as its steps interleave them, and model
mode pricing each text's fills and accepts from that walk (``costs.measure_batch_rows``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.measure_worker import BatchWalkTask, walk_in_batch
from cdbench.backends.registry import create_backend
from cdbench.backends.vocab import load_vocab
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.costs.grammar_profile import (
    CompileMeasurement,
    GrammarProfile,
    WalkMeasurement,
)
from cdbench.harness.costs.host import BENCHMARK_VERSION, HostInfo, this_host
from cdbench.harness.costs.spec_costs import SpecCostSettings, price_specs
from cdbench.harness.costs.spec_profile import (
    SpecProfile,
    base_key_text,
    instance_key,
    spec_key_text,
)
from cdbench.harness.costs.spec_store import (
    BatchFillEntry,
    SpecCostEntry,
    SpecCostStore,
    backend_version,
    batch_digest,
    spec_digest,
)
from cdbench.harness.executors.model import ModelExecutor, ProfileGrammarCosts
from cdbench.harness.policies import HOST_COST_FIELDS, policy
from cdbench.harness.run import simulate
from cdbench.workloads.request import Request

VOCAB = "cl100k"


@pytest.fixture(scope="module")
def vocab():
    return load_vocab(VOCAB)


def _text(vocab, s: str) -> tuple[int, ...]:
    return tuple(vocab.encode(s)) + (vocab.eos_token_ids[0],)


def test_walks_advance_width_at_a_time_in_arrival_order_and_a_finished_walks_slot_is_taken(vocab):
    backend = create_backend("xgrammar", vocab)
    specs = (ConstraintSpec("regex", "[ab]+"), ConstraintSpec("regex", "[0-9]+"))
    long, short = _text(vocab, "ab" * 6), _text(vocab, "7")
    walks = ((0, long), (1, short), (1, _text(vocab, "42")))
    compiled, clears = [], []
    compile, clear = backend.compile, backend.clear_engine_cache
    backend.compile = lambda spec: compiled.append(spec) or compile(spec)
    backend.clear_engine_cache = lambda: clears.append(1) or clear()
    result = walk_in_batch("xgrammar", backend, BatchWalkTask("t", "w", specs, walks, width=2, repeats=2))
    assert result.status == "ok"
    # every repeat starts from an empty engine cache and its own grammars: a grammar keeps what its fills computed
    assert compiled == list(specs) * 2 and len(clears) == 2
    order = list(zip(result.tokens.instance, result.tokens.position, strict=True))
    per_repeat = len(order) // 2
    assert order[:per_repeat] == order[per_repeat:]  # each repeat walks the same way, with fresh matchers
    first = order[:per_repeat]
    # walks 0 and 1 start together; walk 2 takes walk 1's row once it ends, walk 0 still going
    assert first[:4] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert first[4:6] == [(0, 2), (2, 0)]
    assert per_repeat == len(long) + len(short) + len(walks[2][1])
    assert all(us > 0 for us in result.tokens.fill_us)
    # each fill's row accepts its token after the step's fills, timed beside it; nothing is rolled back
    assert len(result.tokens.accept_us) == len(order) and all(us > 0 for us in result.tokens.accept_us)
    assert result.tokens.rollback_us == [None] * len(order)


def test_each_spec_compiles_between_the_steps_where_the_run_meets_it(vocab):
    backend = create_backend("xgrammar", vocab)
    specs = (ConstraintSpec("regex", "[ab]+"), ConstraintSpec("regex", "[cd]+"), ConstraintSpec("regex", "[0-9]+"))
    # spec 1 has no walk: it compiles where the run meets it, just before spec 2, whose walk joins late
    walks = ((0, _text(vocab, "ab" * 6)), (0, _text(vocab, "ab")), (2, _text(vocab, "42")))
    events = []
    compile, matcher = backend.compile, backend.matcher

    class Logged:
        def __init__(self, inner):
            self.inner = inner

        def fill_mask(self, mask, row):
            events.append("fill")
            return self.inner.fill_mask(mask, row)

        def accept(self, token):
            return self.inner.accept(token)

    backend.compile = lambda spec: events.append(("compile", specs.index(spec))) or compile(spec)
    backend.matcher = lambda grammar: Logged(matcher(grammar))
    result = walk_in_batch("xgrammar", backend, BatchWalkTask("t", "w", specs, walks, width=2, compiles="between"))
    assert result.status == "ok" and set(result.tokens.instance) == {0, 1, 2}
    compiles = [i for i, e in enumerate(events) if e != "fill"]
    assert [events[i] for i in compiles] == [("compile", 0), ("compile", 1), ("compile", 2)]
    # spec 0 before the first step; specs 1 and 2 together once walk 1 ends and walk 2 takes its row
    assert compiles[0] == 0 and compiles[2] == compiles[1] + 1
    assert events[:compiles[1]].count("fill") == 2 * len(walks[1][1])
    fills_between = len(result.tokens.fill_us)
    events.clear()
    result = walk_in_batch("xgrammar", backend, BatchWalkTask("t", "w", specs, walks, width=2))
    # by default every spec compiles before the walk's first step; the walk itself is the same
    assert events[:3] == [("compile", 0), ("compile", 1), ("compile", 2)] and "fill" not in events[:3]
    assert len(result.tokens.fill_us) == fills_between
    key = ("xgrammar", backend_version("xgrammar"), VOCAB, {}, list(specs), list(walks), 2, 0.0)
    assert batch_digest(*key) == batch_digest(*key, "before")  # walks measured before the option keep their keys
    assert batch_digest(*key, "between") != batch_digest(*key)


def test_a_refused_token_ends_its_walk_and_a_spec_that_does_not_compile_is_skipped(vocab):
    backend = create_backend("xgrammar", vocab)
    specs = (ConstraintSpec("regex", "[ab]+"), ConstraintSpec("json_schema", {"$ref": "#/definitions/missing"}))
    refused = tuple(vocab.encode("ab")) + tuple(vocab.encode("9")) + (vocab.eos_token_ids[0],)
    walks = ((0, refused), (1, _text(vocab, "{}")))
    result = walk_in_batch("xgrammar", backend, BatchWalkTask("t", "w", specs, walks, width=4))
    assert set(result.tokens.instance) == {0}
    # fills at each accepted position and at the refused one, then the walk stops
    assert result.tokens.position == list(range(len(vocab.encode("ab")) + 1))


def _host(host_id: str, score: float) -> HostInfo:
    return HostInfo(id=host_id, name=f"cpu-{host_id}", cpu_model="x", cores=2, arch="x86_64", score=score,
                    benchmark_version=BENCHMARK_VERSION, measured="2026-11-27")


def _entry(digest: str, version: str, host: HostInfo) -> SpecCostEntry:
    costs = SpecProfile(kind="regex", status="ok", compile_s=0.004, fills=4, fill_scale_s=1e-5,
                        fill_curve=[1.0] * 13, fill_residual=[1.0], accept_s=1e-6)
    return SpecCostEntry(digest=digest, backend="xgrammar", backend_version=version, vocab=VOCAB, kind="regex",
                         host=host, status="ok", costs=costs, measured="test")


def test_stored_batch_fills_price_each_text_scaled_to_the_target_host(tmp_path, vocab):
    version = backend_version("xgrammar")
    store = SpecCostStore(tmp_path)
    here = this_host(tmp_path)
    texts = [_text(vocab, "a"), _text(vocab, "ab")]
    spec = ConstraintSpec("regex", "[ab]+")
    # two requests answer with the first text, one with the second: each distinct text is walked once, in the
    # order the run first meets it
    requests = [Request(i, 0.1 * i, 16, len(t), spec, "r/0", output_tokens=t)
                for i, t in enumerate([texts[0], texts[1], texts[0]])]
    store.put(_entry(spec_digest("xgrammar", version, VOCAB, {}, spec), version, here))
    settings = SpecCostSettings(spec_store=str(tmp_path), spec_costs="strict", measure_batch_rows=8)
    base = GrammarProfile.builtin("xgrammar")
    _, coverage = price_specs(base, "xgrammar", {}, VOCAB, requests, settings)
    assert coverage.fill_order == "alone"  # strict never measures, and nothing is stored for these walks
    walks = [(0, texts[0]), (0, texts[1])]
    faster = _host("fast", here.score * 2.0)  # seconds there are twice as long here
    store.put_batch_fills(BatchFillEntry(  # as stored before accepts were timed in the walk: fills alone
        format_version=1, digest=batch_digest("xgrammar", version, VOCAB, {}, [spec], walks, 8),
        backend="xgrammar", backend_version=version, vocab=VOCAB, host=faster, width=8, measured="test",
        fill_s=[[2e-5, 3e-5], [3e-5, None, 5e-5]]))
    profile, coverage = price_specs(base, "xgrammar", {}, VOCAB, requests, settings)
    assert coverage.fill_order == "8 at a time"
    run_base = spec_key_text("regex", "r/0")
    first = profile.instances[instance_key(run_base, texts[0])].fill_s
    second = profile.instances[instance_key(run_base, texts[1])].fill_s
    assert first == pytest.approx([4e-5, 6e-5])  # its walk's fills, times 2
    assert second[0] == pytest.approx(6e-5) and second[2] == pytest.approx(1e-4)
    assert second[1] is None  # neither the batch nor a walk alone timed it
    assert any(line.startswith("fills walked in batch (8 at a time)") for line in coverage.lines())
    # an entry of format 1 times no accepts: the texts' accepts stay their spec's
    assert coverage.accept_order == "alone" and not profile.instances[instance_key(run_base, texts[0])].accept_s
    off = settings.model_copy(update={"measure_batch_rows": None})
    assert price_specs(base, "xgrammar", {}, VOCAB, requests, off)[1].fill_order == "alone"


def test_a_run_walks_its_texts_in_batch_once_and_the_next_run_reuses_the_walk(tmp_path, vocab):
    requests = [Request(i, 0.05 * i, 16, 0, ConstraintSpec("regex", pattern), f"r/{i}",
                        output_tokens=_text(vocab, text))
                for i, (pattern, text) in enumerate([("[ab]+", "abab"), ("[0-9]+", "123"), ("[a-z]+ [a-z]+", "ok go")])]
    requests = [Request(r.request_id, r.arrival_s, 16, len(r.output_tokens), r.spec, r.spec_id,
                        output_tokens=r.output_tokens) for r in requests]
    settings = SpecCostSettings(spec_store=str(tmp_path), measure_workers=1, measure_repeats=1, measure_batch_rows=2)
    base = GrammarProfile.builtin("xgrammar")
    first, coverage = price_specs(base, "xgrammar", {}, VOCAB, requests, settings)
    assert coverage.fill_order == "2 at a time, measured now"
    second, coverage = price_specs(base, "xgrammar", {}, VOCAB, requests, settings)
    assert coverage.fill_order == "2 at a time" and coverage.measured_now == 0
    assert first.instances == second.instances  # the stored walk prices the same way
    for r in requests:
        text = second.instances[instance_key(spec_key_text("regex", r.spec_id), r.output_tokens)]
        assert len(text.fill_s) == len(r.output_tokens) and all(f is not None and f > 0 for f in text.fill_s)
        assert len(text.accept_s) == len(r.output_tokens) and all(a is not None and a > 0 for a in text.accept_s)
    # the walk as stored before accepts were timed in it: measure walks the texts again, for their accepts
    store = settings.store()
    [path] = (tmp_path / "batch_fills").glob("*/*/*.json")
    [entry] = store.batch_fills(path.parent.name)
    store.put_batch_fills(entry.model_copy(update={"format_version": 1, "accept_s": []}))
    third, coverage = price_specs(base, "xgrammar", {}, VOCAB, requests, settings)
    assert (coverage.fill_order, coverage.accept_order) == ("2 at a time, measured now",) * 2
    assert store.batch_fills(path.parent.name)[0].format_version == 2
    # the specs compiled between the walk's steps: another measurement, stored apart, named in the coverage
    between = settings.model_copy(update={"measure_batch_compiles": "between"})
    _, coverage = price_specs(base, "xgrammar", {}, VOCAB, requests, between)
    assert coverage.fill_order == "2 at a time, specs compiled between its steps, measured now"
    assert len(list((tmp_path / "batch_fills").glob("*/*/*.json"))) == 2


def _walks_of(vocab) -> tuple[ConstraintSpec, list[tuple[int, ...]], list[Request], list[tuple[int, tuple[int, ...]]]]:
    spec = ConstraintSpec("regex", "[ab]+")
    texts = [_text(vocab, "a"), _text(vocab, "ab")]
    requests = [Request(i, 0.1 * i, 16, len(t), spec, "r/0", output_tokens=t) for i, t in enumerate(texts)]
    return spec, texts, requests, [(0, texts[0]), (0, texts[1])]


def test_an_old_batch_entry_on_disk_still_loads_and_prices_fills_with_accepts_from_a_host_that_timed_them(
        tmp_path, vocab):
    version = backend_version("xgrammar")
    store = SpecCostStore(tmp_path)
    here = this_host(tmp_path)
    spec, texts, requests, walks = _walks_of(vocab)
    store.put(_entry(spec_digest("xgrammar", version, VOCAB, {}, spec), version, here))
    digest = batch_digest("xgrammar", version, VOCAB, {}, [spec], walks, 8)
    # a file as written before accepts were timed in the walk (no format 2 field, no accepts)
    old = {"format_version": 1, "digest": digest, "backend": "xgrammar", "backend_version": version, "vocab": VOCAB,
           "host": here.model_dump(), "measured": "2026-11-26", "width": 8, "fill_s": [[2e-5, 3e-5], [4e-5, 5e-5, 6e-5]]}
    folder = tmp_path / "batch_fills" / digest[:2] / digest
    folder.mkdir(parents=True)
    (folder / f"{here.id}.json").write_text(json.dumps(old))
    [loaded] = store.batch_fills(digest)
    assert loaded.format_version == 1 and loaded.accept_s == [] and loaded.fill_s == old["fill_s"]
    with pytest.raises(ValueError, match="an accept list per walk"):  # format 2 holds one per walk
        BatchFillEntry.model_validate({**old, "format_version": 2, "accept_s": [[1e-6, 1e-6]]})
    slower = _host("slow", here.score / 2.0)  # seconds there are half as long here
    store.put_batch_fills(BatchFillEntry(
        digest=digest, backend="xgrammar", backend_version=version, vocab=VOCAB, host=slower, width=8,
        measured="test", fill_s=[[9e-5, 9e-5], [9e-5, 9e-5, 9e-5]], accept_s=[[4e-6, 6e-6], [8e-6, None, 2e-6]]))
    settings = SpecCostSettings(spec_store=str(tmp_path), spec_costs="strict", measure_batch_rows=8)
    profile, coverage = price_specs(GrammarProfile.builtin("xgrammar"), "xgrammar", {}, VOCAB, requests, settings)
    assert (coverage.fill_order, coverage.accept_order) == ("8 at a time", "8 at a time")
    assert any(line.startswith("accepts walked in batch (8 at a time)") for line in coverage.lines())
    run_base = spec_key_text("regex", "r/0")
    first, second = (profile.instances[instance_key(run_base, t)] for t in texts)
    assert first.fill_s == pytest.approx([2e-5, 3e-5])  # fills: the target host's own entry, old as it is
    assert first.accept_s == pytest.approx([2e-6, 3e-6])  # accepts: the other host's walk, scaled to this one
    assert second.accept_s[0] == pytest.approx(4e-6) and second.accept_s[1] is None
    again, _ = price_specs(GrammarProfile.builtin("xgrammar"), "xgrammar", {}, VOCAB, requests, settings)
    assert again.instances == profile.instances  # the same store prices the same way


def test_model_mode_prices_a_texts_accepts_from_its_batch_walk_by_position_and_others_from_their_spec():
    """Two texts of one spec replay their fills; one also has its accepts timed in batch (dear at positions
    3-5), the other not. Each step's grammar processing is then that text's accept at the step's
    position; the other text's are the spec's (2 µs), as before."""
    out = 12
    texts = [tuple(range(100, 100 + out)), tuple(range(200, 200 + out))]
    base = base_key_text("regex:corp/one", "regex", "corp/one")
    walks = [WalkMeasurement("corp/one", "regex", fill_s=np.full(out, 1e-5), accept_s=np.full(out, 2e-6),
                             instance=instance_key(base, t)) for t in texts]
    profile = GrammarProfile.from_measurements("test", "qwen3.6", [CompileMeasurement("corp/one", "regex", "ok", 1e-3)],
                                               walks)
    timed = [1e-5] * out
    timed[3:6] = [1e-3] * 3
    timed[8] = None  # not timed there: the spec's accept
    key = instance_key(base, texts[0])
    instances = dict(profile.instances)
    instances[key] = instances[key].model_copy(update={"accept_s": timed})
    profile = profile.model_copy(update={"instances": instances})
    spec = ConstraintSpec("regex", "[a-z]+")
    requests = [Request(i, 10.0 * i, 50, out, spec, "corp/one" if i == 0 else "corp/one#copy1", t, instance_index=i)
                for i, t in enumerate(texts)]

    def process(seed: int) -> list[np.ndarray]:
        result = simulate(requests, policy("vllm", **dict.fromkeys(HOST_COST_FIELDS, 0.0), overlap=False),
                          ModelExecutor(ProfileGrammarCosts(profile, seed)), FixedGpuCosts(forward_base_s=0.01),
                          seed=seed, trace_steps=0)
        steps = result.steps[result.steps["grammar_rows"] > 0]
        owner = (steps["start_s"] // 10.0).astype(int)
        return [steps.loc[owner == i, "process_s"].to_numpy() for i in range(2)]

    first, second = process(0)
    assert len(first) == out
    expected = np.array([2e-6 if v is None else v for v in timed])
    np.testing.assert_allclose(first, expected, rtol=0.5)  # position 8 takes a draw of the spec's (2 µs)
    np.testing.assert_allclose(np.delete(first, 8), np.delete(expected, 8), rtol=1e-9)
    np.testing.assert_allclose(second, 2e-6, rtol=0.5)  # the spec's accepts, drawn
    assert second.max() < 1e-5
    for a, b in zip(process(0), (first, second), strict=True):  # the same profile and seed: the same prices
        np.testing.assert_array_equal(a, b)


def test_a_walk_with_a_gap_sleeps_between_each_steps_fills_and_accepts_and_is_stored_apart(vocab, monkeypatch):
    from cdbench.backends import measure_worker

    backend = create_backend("xgrammar", vocab)
    specs = (ConstraintSpec("regex", "[ab]+"),)
    walks = ((0, _text(vocab, "abab")), (0, _text(vocab, "a")))
    events = []
    monkeypatch.setattr(measure_worker.time, "sleep", lambda s: events.append(("sleep", s)))
    result = walk_in_batch("xgrammar", backend, BatchWalkTask("t", "w", specs, walks, width=2, gap_s=0.01))
    steps = max(len(t) for _, t in walks)  # both walks start together; the longer one sets the steps
    assert events == [("sleep", 0.01)] * steps
    assert len(result.tokens.accept_us) == len(result.tokens.fill_us) == sum(len(t) for _, t in walks)
    version = backend_version("xgrammar")
    key = ("xgrammar", version, VOCAB, {}, list(specs), list(walks), 2)
    assert batch_digest(*key) == batch_digest(*key, 0.0)  # walks without a gap keep their stored keys
    assert batch_digest(*key, 0.01) != batch_digest(*key)
