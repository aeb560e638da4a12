from __future__ import annotations

import json

import numpy as np
import pytest

from cdbench.workloads.config import WorkloadConfig
from cdbench.workloads.generator import generate


def gen(vocab, pool_cache, **kw):
    kw.setdefault("num_requests", 40)
    return generate(WorkloadConfig(**kw), vocab, cache=pool_cache, progress=False)


def test_same_seed_identical_workload_and_other_seed_differs(vocab, pool_cache):
    cfg = dict(num_requests=60, seed=11, structured_ratio=0.7, spec_reuse={"mode": "zipf", "zipf_s": 1.2},
               arrival={"process": "gamma", "rate": 20, "burstiness": 0.5},
               prompt_len={"dist": "lognormal", "median": 300, "sigma": 0.4},
               reasoning={"fraction": 0.5, "think_len": {"dist": "uniform", "low": 10, "high": 90}, "thinking_budget": 64})
    a = gen(vocab, pool_cache, **cfg)
    b = gen(vocab, pool_cache, **cfg)
    assert a.requests == b.requests
    assert gen(vocab, pool_cache, **{**cfg, "seed": 12}).requests != a.requests


def test_oracle_outputs_are_instance_tokens(vocab, pool_cache):
    wl = gen(vocab, pool_cache, kinds=["json_schema"])
    from cdbench.workloads.validate import check_instance

    for r in wl.requests:
        assert r.output_len == len(r.output_tokens) and r.output_tokens[-1] == vocab.eos_token_ids[0]
        assert wl.pools[r.spec_id].tokens[r.instance_index] == r.output_tokens
        check_instance(r.spec, vocab.decode(r.output_tokens[:-1]))
    assert [r.arrival_s for r in wl.requests] == sorted(r.arrival_s for r in wl.requests)


def test_instance_pools_come_from_instance_seed_not_the_workload_seed(vocab, pool_cache):
    """Pools are part of the dataset: every workload seed answers a spec with the same texts."""
    cfg = dict(num_requests=30, kinds=["regex"])
    a, b = gen(vocab, pool_cache, seed=1, **cfg), gen(vocab, pool_cache, seed=2, **cfg)
    shared = set(a.pools) & set(b.pools)
    assert shared and all(a.pools[s] == b.pools[s] for s in shared)
    other = gen(vocab, pool_cache, seed=1, instance_seed=5, **cfg)
    assert any(other.pools[s].texts != a.pools[s].texts for s in set(other.pools) & set(a.pools))


def test_a_specs_requests_take_its_instances_in_turn(vocab, pool_cache, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "r", "kind": "regex", "spec": "[a-d]{3}", "source": "s", "license": "MIT"}) + "\n")
    wl = gen(vocab, pool_cache, num_requests=10, spec_reuse={"mode": "same"}, corpus=[str(corpus)])
    size = len(wl.pools["r"].tokens)
    assert size == 4
    turns = [r.instance_index for r in wl.requests]
    assert turns == [(turns[0] + i) % size for i in range(len(turns))]


def test_unique_reuse_gives_distinct_specs_past_the_corpus(vocab, pool_cache, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps(x) for x in [
        {"id": "j", "kind": "json_schema", "spec": {"type": "integer"}, "source": "s", "license": "MIT"},
        {"id": "r", "kind": "regex", "spec": "[ab]", "source": "s", "license": "MIT"}]) + "\n")
    wl = gen(vocab, pool_cache, num_requests=6, corpus=[str(corpus)])
    assert len({r.spec.canonical() for r in wl.requests}) == 6
    assert len({r.spec_id for r in wl.requests}) == 6
    copies = [r.spec for r in wl.requests if r.spec_id.startswith("j#copy")]
    assert copies and all(s.spec["$comment"].startswith("cdbench copy") for s in copies)


def test_same_and_zipf_reuse(vocab, pool_cache):
    same = gen(vocab, pool_cache, spec_reuse={"mode": "same"}, kinds=["choice"])
    assert len({r.spec_id for r in same.requests}) == 1
    zipf = gen(vocab, pool_cache, num_requests=300, spec_reuse={"mode": "zipf", "zipf_s": 1.5}, kinds=["choice"],
               token_source="lengths")
    counts = sorted(np.unique([r.spec_id for r in zipf.requests], return_counts=True)[1], reverse=True)
    assert counts[0] > 300 * 0.25 and len(counts) > 5


def test_structured_ratio_and_plain_lengths(vocab, pool_cache):
    wl = gen(vocab, pool_cache, num_requests=400, structured_ratio=0.25, token_source="lengths",
             output_len={"dist": "uniform", "low": 5, "high": 9})
    structured = [r for r in wl.requests if r.structured]
    assert 0.18 < len(structured) / 400 < 0.32
    assert all(5 <= r.output_len <= 9 and r.output_tokens is None for r in wl.requests)


@pytest.mark.parametrize("arrival, check", [
    ({"process": "poisson", "rate": 50}, lambda t: 35 < len(t) / t[-1] < 70),
    ({"process": "constant", "rate": 4}, lambda t: np.allclose(np.diff(t), 0.25)),
    ({"process": "gamma", "rate": 50, "burstiness": 0.2}, lambda t: np.std(np.diff(t)) > 1.5 * np.mean(np.diff(t))),
    ({"process": "replay", "timestamps": [float(i) / 2 for i in range(500)]}, lambda t: t[3] == 1.5),
])
def test_arrival_processes(vocab, pool_cache, arrival, check):
    wl = gen(vocab, pool_cache, num_requests=500, structured_ratio=0, arrival=arrival)
    assert check(np.array([r.arrival_s for r in wl.requests]))


def test_closed_loop(vocab, pool_cache):
    wl = gen(vocab, pool_cache, structured_ratio=0, arrival={"process": "closed_loop", "max_concurrency": 8})
    assert wl.config.max_concurrency == 8 == wl.max_concurrency
    assert all(r.closed_loop and r.arrival_s == 0 for r in wl.requests)


def test_reasoning_and_spec_decode_fields(vocab, pool_cache):
    wl = gen(vocab, pool_cache, num_requests=300, structured_ratio=0,
             reasoning={"fraction": 0.4, "think_len": {"dist": "fixed", "value": 77}, "thinking_budget": 50},
             spec_decode={"k": 3, "alpha": 0.6})
    thinking = [r for r in wl.requests if r.think_len]
    assert 0.3 < len(thinking) / 300 < 0.5
    assert all(r.think_len == 77 and r.thinking_budget == 50 for r in thinking)
    assert all(r.thinking_budget is None for r in wl.requests if not r.think_len)
    assert (wl.config.spec_decode.k, wl.config.spec_decode.alpha) == (3, 0.6)


def test_lengths_distributions():
    from cdbench.workloads.lengths import LogNormalLengths, TraceLengths, UniformLengths

    rng = np.random.default_rng(0)
    assert abs(np.median(LogNormalLengths(median=100, sigma=0.5).sample(4000, rng)) - 100) < 5
    assert TraceLengths(values=[3, 4]).sample(5, rng).tolist() == [3, 4, 3, 4, 3]
    with pytest.raises(ValueError, match="low <= high"):
        UniformLengths(low=5, high=1)


def test_failed_specs_are_reported_and_not_used(vocab, pool_cache, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps(x) for x in [
        {"id": "bad", "kind": "json_schema", "spec": {"type": "integer", "minimum": 3, "maximum": 1},
         "source": "s", "license": "MIT"},
        "{oops",
        {"id": "ok", "kind": "choice", "spec": ["a", "b"], "source": "s", "license": "MIT"}]) + "\n")
    wl = gen(vocab, pool_cache, num_requests=10, corpus=[str(corpus)], spec_reuse={"mode": "zipf"})
    assert {r.spec_id for r in wl.requests} == {"ok"}
    assert [(f.spec_id, "empty numeric range" in f.reason) for f in wl.failures] == [("bad", True)]
    assert [s.line for s in wl.skipped_lines] == [2]


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="structured_ratio"):
        WorkloadConfig(num_requests=1, structured_ratio=2)
    with pytest.raises(ValueError, match="process"):
        WorkloadConfig(num_requests=1, arrival={"process": "bursty"})


def write_corpus(path, items):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in items) + "\n")
    return path


def test_one_id_one_spec_oracle_tokens_always_satisfy_their_own_spec(vocab, pool_cache, tmp_path):
    """Regression: two corpus items with one id used to share an instance pool, so requests of the
    second spec carried instances of the first."""
    from cdbench.workloads.validate import check_instance

    a = write_corpus(tmp_path / "a.jsonl", [
        {"id": "x", "kind": "regex", "spec": "[ab]{3}", "source": "s", "license": "MIT"},
        {"id": "x", "kind": "choice", "spec": ["zzz", "yyy"], "source": "s", "license": "MIT"}])
    b = write_corpus(tmp_path / "b.jsonl", [
        {"id": "x", "kind": "json_schema", "spec": {"type": "integer"}, "source": "s", "license": "MIT"},
        {"id": "y", "kind": "choice", "spec": ["on", "off"], "source": "s", "license": "MIT"}])
    wl = gen(vocab, pool_cache, num_requests=30, corpus=[str(a), str(b)], spec_reuse={"mode": "zipf"})
    assert [(s.path, s.line) for s in wl.skipped_lines] == [(str(a), 2), (str(b), 1)]
    by_id = {}
    for r in wl.requests:
        check_instance(r.spec, vocab.decode(r.output_tokens[:-1]))
        by_id.setdefault(r.spec_id, r.spec.canonical())
        assert by_id[r.spec_id] == r.spec.canonical()  # an id never names two specs
    assert set(by_id) == {"x", "y"}


def test_unique_reuse_never_repeats_a_spec_held_under_two_ids(vocab, pool_cache, tmp_path):
    same = {"type": "object", "properties": {"a": {"type": "integer"}}}
    corpus = write_corpus(tmp_path / "c.jsonl", [
        {"id": "first", "kind": "json_schema", "spec": same, "source": "s", "license": "MIT"},
        {"id": "again", "kind": "json_schema", "spec": same, "source": "s", "license": "MIT"},
        {"id": "r", "kind": "regex", "spec": "[ab]", "source": "s", "license": "MIT"}])
    wl = gen(vocab, pool_cache, num_requests=9, corpus=[str(corpus)])
    assert len({r.spec.canonical() for r in wl.requests}) == 9
    assert wl.duplicate_specs == {"again": "first"}
    assert not any(r.spec_id.startswith("again") for r in wl.requests)


def test_random_walk_requests_carry_seeded_walk_settings_from_the_config(vocab, pool_cache):
    import torch

    from cdbench.workloads.token_sources import RandomWalk

    cfg = dict(num_requests=50, structured_ratio=0.5, token_source="random_walk",
               random_walk={"eos_bias": 0.25, "max_tokens": 7}, output_len={"dist": "fixed", "value": 40})
    wl = gen(vocab, pool_cache, **cfg)
    walks = {r.random_walk for r in wl.requests if r.structured}
    assert len(walks) == 1
    (walk,) = walks
    assert (walk.eos_bias, walk.max_tokens) == (0.25, 7)
    assert all(r.random_walk is None for r in wl.requests if not r.structured)
    assert all(r.output_tokens is None and r.output_len == 40 for r in wl.requests)
    assert gen(vocab, pool_cache, **cfg).requests == wl.requests
    assert {r.random_walk.seed for r in gen(vocab, pool_cache, **cfg, seed=1).requests if r.structured} != {walk.seed}
    lengths = gen(vocab, pool_cache, **{**cfg, "token_source": "lengths"})
    assert all(r.random_walk is None for r in lengths.requests)
    assert [r.spec for r in lengths.requests] == [r.spec for r in wl.requests]  # only the token source differs

    # the carried settings steer the walk: past max_tokens EOS is taken as soon as it is allowed
    eos = vocab.eos_token_ids[0]
    row = torch.zeros(vocab.size, dtype=torch.bool)
    row[[11, 12, eos]] = True
    request = next(r for r in wl.requests if r.structured)
    walker = RandomWalk(vocab.eos_token_ids, vocab.size, seed=0, eos_bias=0.0)
    assert walker.next_token(row, request_id=request.request_id, position=7, params=request.random_walk) == eos
    draws = [walker.next_token(row, request_id=rid, position=p, params=request.random_walk)
             for rid in range(50) for p in range(6)]
    assert set(draws) == {11, 12, eos} and 0.15 < draws.count(eos) / len(draws) < 0.35  # the config's bias
    assert eos not in [walker.next_token(row, request_id=rid, position=0) for rid in range(50)]  # walker's own: 0


def test_workload_report_counts_failures_skipped_lines_and_duplicates(vocab, pool_cache, tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", [
        {"id": "bad", "kind": "json_schema", "spec": {"type": "integer", "minimum": 3, "maximum": 1},
         "source": "s", "license": "MIT"},
        "{oops",
        {"id": "ok", "kind": "choice", "spec": ["a", "b"], "source": "s", "license": "MIT"},
        {"id": "ok2", "kind": "choice", "spec": ["a", "b"], "source": "s", "license": "MIT"}])
    wl = gen(vocab, pool_cache, num_requests=10, corpus=[str(corpus)], spec_reuse={"mode": "zipf"})
    report = wl.report()
    assert (report.requests, report.structured_requests, report.distinct_specs) == (10, 10, 1)
    assert (report.spec_failure_count, report.skipped_line_count, report.duplicate_spec_count) == (1, 1, 1)
    assert (wl.failure_count, wl.skipped_line_count, wl.bad_trace_line_count) == (1, 1, 0)
    assert report.spec_failures[0].spec_id == "bad" and "empty numeric range" in report.spec_failures[0].reason
    assert (report.skipped_lines[0].path, report.skipped_lines[0].line) == (str(corpus), 2)
    assert report.duplicate_specs == {"ok2": "ok"} and report.replayed_from is None
    assert json.loads(report.model_dump_json())["spec_failure_count"] == 1


@pytest.mark.parametrize("overrides, field", [
    ({"prompt_len": {"dist": "trace", "values": [5, -1]}}, "prompt_len.trace.values.1"),
    ({"reasoning": {"think_len": {"dist": "trace", "values": [-3]}}}, "reasoning.think_len.trace.values.0"),
    ({"reasoning": {"think_len": {"dist": "uniform", "low": -1, "high": 4}}}, "reasoning.think_len.uniform.low"),
    ({"arrival": {"process": "replay", "timestamps": [0.0, float("nan")]}}, "arrival.replay.timestamps.1"),
    ({"arrival": {"process": "replay", "timestamps": [float("inf")]}}, "arrival.replay.timestamps.0"),
    ({"arrival": {"process": "replay", "timestamps": [-0.5]}}, "arrival.replay.timestamps.0"),
    ({"output_len": {"dist": "lognormal", "median": 9, "sigma": 1, "min": 50, "max": 10}}, "output_len.lognormal"),
    ({"random_walk": {"eos_bias": 1.5}}, "random_walk.eos_bias"),
])
def test_bad_lengths_timestamps_and_walks_are_config_errors_naming_the_field(overrides, field):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        WorkloadConfig(num_requests=1, **overrides)
    assert field in str(info.value)


def test_num_requests_is_required_unless_a_trace_is_replayed():
    with pytest.raises(ValueError, match="num_requests is required"):
        WorkloadConfig()
    assert WorkloadConfig(trace="t.jsonl").num_requests is None


def test_a_schema_copy_reads_hashes_and_pickles_as_the_plain_spec_it_stands_for():
    import pickle

    from cdbench.backends.base import ConstraintSpec
    from cdbench.workloads.corpora import CorpusItem
    from cdbench.workloads.generator import original_of_copy, unique_copy

    item = CorpusItem("c/a", "json_schema", {"type": "object", "$comment": "item's", "title": "t"}, "s", "l")
    spec_id, copy = unique_copy(item, 3)
    plain = ConstraintSpec("json_schema", {"type": "object", "$comment": "cdbench copy 3", "title": "t"}, {})
    assert spec_id == "c/a#copy3"
    assert copy.spec == plain.spec and list(copy.spec) == list(plain.spec)  # the key keeps the item's place
    assert copy.canonical() == plain.canonical() and copy == plain and hash(copy) == hash(plain)
    assert repr(copy) == repr(plain)
    back = pickle.loads(pickle.dumps(copy))
    assert type(back) is ConstraintSpec and back.canonical() == plain.canonical()
    assert original_of_copy(copy) == original_of_copy(plain)
    assert item.spec == {"type": "object", "$comment": "item's", "title": "t"}  # the item's schema untouched
