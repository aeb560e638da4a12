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
