"""Requests built lazily, a chunk at a time, are the requests built at once (the eager path: one chunk)."""

from __future__ import annotations

import numpy as np
import pytest

from cdbench.workloads.arrivals import ConstantArrivals, GammaArrivals, PoissonArrivals
from cdbench.workloads.config import WorkloadConfig
from cdbench.workloads.generator import RequestStream, generate

CONFIGS = {
    "kind weights, lognormal prompts": dict(
        num_requests=600, kind_weights={"json_schema": 0.85, "regex": 0.06, "choice": 0.06, "ebnf": 0.03},
        prompt_len={"dist": "lognormal", "median": 512, "sigma": 0.6, "min": 32, "max": 4096}),
    "zipf, gamma, uniform, reasoning": dict(
        num_requests=500, seed=3, structured_ratio=0.5, spec_reuse={"mode": "zipf"},
        arrival={"process": "gamma", "rate": 5, "burstiness": 0.5}, token_source="lengths",
        output_len={"dist": "uniform", "low": 4, "high": 300},
        reasoning={"fraction": 0.3, "think_len": {"dist": "lognormal", "median": 100, "sigma": 1.0},
                   "thinking_budget": 80}),
    "constant, random walk, shuffled trace lengths": dict(
        num_requests=300, seed=7, arrival={"process": "constant", "rate": 20}, token_source="random_walk",
        prompt_len={"dist": "trace", "values": [5, 9, 200], "shuffle": True}),
    "closed loop, one spec": dict(
        num_requests=200, arrival={"process": "closed_loop", "max_concurrency": 8}, spec_reuse={"mode": "same"},
        structured_ratio=0.3),
}


def _fields(requests) -> list[tuple]:
    return [(r.request_id, r.arrival_s, r.prompt_len, r.output_len, r.spec_id,
             r.spec.canonical() if r.spec is not None else None, r.output_tokens, r.think_len, r.thinking_budget,
             r.closed_loop, r.instance_index, r.random_walk) for r in requests]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("chunk", [1, 7, 128])
def test_lazy_requests_are_the_eager_requests_for_a_seed(name, chunk, vocab):
    config = WorkloadConfig(**CONFIGS[name])
    eager = generate(config, vocab, progress=False)  # every stream drawn for all requests at once
    stream = RequestStream(config, vocab, chunk=chunk)
    assert _fields(stream) == _fields(eager.requests)
    assert sorted(stream.pools) == sorted(eager.pools) and len(stream.failures) == len(eager.failures)


@pytest.mark.parametrize("process", [PoissonArrivals(rate=3.0), GammaArrivals(rate=3.0, burstiness=0.3),
                                     ConstantArrivals(rate=7.0)])
def test_arrival_times_in_chunks_are_the_times_drawn_at_once(process):
    whole = process.times(10_001, np.random.default_rng(1))
    pieces = list(process.chunks(10_001, np.random.default_rng(1), 333))
    assert [len(p) for p in pieces[:-1]] == [333] * (len(pieces) - 1)
    assert np.array_equal(np.concatenate(pieces), whole)


@pytest.mark.parametrize("name", ["kind weights, lognormal prompts", "constant, random walk, shuffled trace lengths"])
def test_a_workload_not_held_builds_the_same_requests_trace_and_report(name, vocab):
    from cdbench.workloads.trace import dumps_trace

    config = WorkloadConfig(**CONFIGS[name])
    held = generate(config, vocab, progress=False)
    streamed = generate(config, vocab, progress=False, held=False)
    assert streamed.streamed and not streamed.requests and not streamed.pools
    with pytest.raises(ValueError, match="read to the end"):
        streamed.report()  # its counts come from a first reading to the end
    assert _fields(streamed.iter_requests()) == _fields(held.requests)
    assert _fields(streamed.iter_requests()) == _fields(held.requests)  # as often as read
    assert dumps_trace(streamed) == dumps_trace(held) and streamed.report() == held.report()


def test_a_replayed_workload_is_held(tmp_path, vocab):
    from cdbench.workloads.trace import write_trace

    write_trace(generate(WorkloadConfig(num_requests=20), vocab, progress=False), tmp_path / "t.jsonl")
    replayed = generate(WorkloadConfig(num_requests=20, trace=str(tmp_path / "t.jsonl")), vocab, held=False)
    assert not replayed.streamed and len(replayed.requests) == 20
