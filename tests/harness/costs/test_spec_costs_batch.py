"""Fills walked in batch: a run's texts walked together as its steps interleave them, and model mode
pricing each text's fills from that walk (``costs.measure_batch_rows``)."""

from __future__ import annotations

import pytest

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.measure_worker import BatchWalkTask, walk_in_batch
from cdbench.backends.registry import create_backend
from cdbench.backends.vocab import load_vocab
from cdbench.harness.costs.grammar_profile import GrammarProfile
from cdbench.harness.costs.host import BENCHMARK_VERSION, HostInfo, this_host
from cdbench.harness.costs.spec_costs import SpecCostSettings, price_specs
from cdbench.harness.costs.spec_profile import SpecProfile, instance_key, spec_key_text
from cdbench.harness.costs.spec_store import (
    BatchFillEntry,
    SpecCostEntry,
    SpecCostStore,
    backend_version,
    batch_digest,
    spec_digest,
)
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
    store.put_batch_fills(BatchFillEntry(
        digest=batch_digest("xgrammar", version, VOCAB, {}, [spec], walks, 8), backend="xgrammar",
        backend_version=version, vocab=VOCAB, host=faster, width=8, measured="test",
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
        fills = second.instances[instance_key(spec_key_text("regex", r.spec_id), r.output_tokens)].fill_s
        assert len(fills) == len(r.output_tokens) and all(f is not None and f > 0 for f in fills)
