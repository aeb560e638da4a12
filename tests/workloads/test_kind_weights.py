"""WorkloadConfig.kind_weights: the constraint-kind mix of structured requests, and the default config's mix."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from pydantic import ValidationError

from cdbench.harness.config import RunConfig
from cdbench.results.config_files import builtin_config_path, read_yaml_mapping
from cdbench.workloads.config import WorkloadConfig
from cdbench.workloads.generator import _PackedKinds, generate, kind_sequence


def kind_counts(wl) -> Counter:
    return Counter(r.spec.kind for r in wl.requests if r.spec is not None)


def test_default_config_mix_is_mostly_json_schema_with_a_little_ebnf(vocab, pool_cache):
    workload = read_yaml_mapping(builtin_config_path("default"))["workload"]
    # Token source "lengths": the kind mix does not depend on instance pools, so the test needs no oracle.
    wl = generate(WorkloadConfig(**{**workload, "token_source": "lengths"}), vocab, cache=pool_cache, progress=False)
    counts = kind_counts(wl)
    n = sum(counts.values())
    assert n == workload["num_requests"]
    assert counts["json_schema"] / n >= 0.8
    assert 0 < counts["ebnf"] / n <= 0.05
    assert counts["regex"] > 0 and counts["choice"] > 0
    # The tool calls (BFCL) are among the JSON schemas.
    assert any(r.spec_id.startswith("bfcl/") for r in wl.requests)
    # Without the weights, the sample's own mix has several times as much EBNF.
    plain = generate(WorkloadConfig(**{**workload, "token_source": "lengths", "kind_weights": None}), vocab,
                     cache=pool_cache, progress=False)
    assert kind_counts(plain)["ebnf"] > 2 * counts["ebnf"]


def test_each_kind_gets_exactly_its_share_in_a_seeded_order(vocab, pool_cache):
    cfg = {"num_requests": 200, "kind_weights": {"regex": 1, "choice": 3}, "token_source": "lengths", "seed": 4}
    wl = generate(WorkloadConfig(**cfg), vocab, cache=pool_cache, progress=False)
    assert kind_counts(wl) == {"regex": 50, "choice": 150}
    kinds = [r.spec.kind for r in wl.requests]
    assert kinds[:50] != ["choice"] * 50 and kinds != sorted(kinds)  # interleaved, not in blocks
    assert [r.spec_id for r in generate(WorkloadConfig(**cfg), vocab, cache=pool_cache, progress=False).requests] \
        == [r.spec_id for r in wl.requests]
    other = generate(WorkloadConfig(**{**cfg, "seed": 5}), vocab, cache=pool_cache, progress=False)
    assert [r.spec.kind for r in other.requests] != kinds


def test_shares_apply_to_structured_requests_only(vocab, pool_cache):
    wl = generate(WorkloadConfig(num_requests=300, structured_ratio=0.5, kind_weights={"regex": 1, "choice": 1},
                                 token_source="lengths"), vocab, cache=pool_cache, progress=False)
    counts = kind_counts(wl)
    assert abs(counts["regex"] - counts["choice"]) <= 1


def test_unique_reuse_runs_through_each_kinds_items_before_copying(vocab, pool_cache, tmp_path):
    corpus = tmp_path / "c.jsonl"
    lines = [{"id": f"r{i}", "kind": "regex", "spec": f"a{{{i + 1}}}", "source": "s", "license": "MIT"} for i in range(3)]
    lines += [{"id": f"c{i}", "kind": "choice", "spec": [f"x{i}", "y"], "source": "s", "license": "MIT"} for i in range(20)]
    corpus.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    wl = generate(WorkloadConfig(num_requests=12, corpus=[str(corpus)], kind_weights={"regex": 0.5, "choice": 0.5}),
                  vocab, cache=pool_cache, progress=False)
    regex_ids = [r.spec_id for r in wl.requests if r.spec.kind == "regex"]
    assert len(regex_ids) == 6 and len(set(regex_ids)) == 6
    assert sorted(i for i in regex_ids if "#" not in i) == ["r0", "r1", "r2"]  # every item once, then copies
    assert len({r.spec.canonical() for r in wl.requests}) == 12


def test_weighted_kinds_the_corpus_lacks_are_left_out(vocab, pool_cache, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "j", "kind": "json_schema", "spec": {"type": "integer"}, "source": "s",
                                  "license": "MIT"}) + "\n")
    wl = generate(WorkloadConfig(num_requests=5, corpus=[str(corpus)], kind_weights={"json_schema": 0.1, "ebnf": 0.9}),
                  vocab, cache=pool_cache, progress=False)
    assert kind_counts(wl) == {"json_schema": 5}
    with pytest.raises(ValueError, match="kind_weights gives no weight to a kind the corpus has .*json_schema"):
        generate(WorkloadConfig(num_requests=5, corpus=[str(corpus)], kind_weights={"ebnf": 1}), vocab,
                 cache=pool_cache, progress=False)


@pytest.mark.parametrize("weights, message", [
    ({"regex": -1}, "kind_weights.regex must be a finite number >= 0"),
    ({"regex": float("inf")}, "kind_weights.regex must be a finite number >= 0"),
    ({"regex": 0, "choice": 0}, "at least one weight above 0"),
    ({"yaml": 1}, "kind_weights.yaml"),
])
def test_bad_weights_are_config_errors(weights, message):
    with pytest.raises(ValidationError, match=message):
        WorkloadConfig(num_requests=1, kind_weights=weights)


@pytest.mark.parametrize("count", [0, 1, 7, 200, 1001])
def test_kind_sequence_rounds_to_the_count(count):
    p = np.array([0.85, 0.06, 0.06, 0.03])
    seq = kind_sequence(p, count, np.random.default_rng(0))
    counts = np.bincount(seq, minlength=4)
    assert counts.sum() == count and np.all(np.abs(counts - p * count) < 1)


@pytest.mark.parametrize("kinds, bits", [(2, 1), (4, 2), (5, 4), (17, 8)])
def test_a_packed_kind_sequence_reads_as_the_sequence_at_a_few_bits_a_request(kinds, bits):
    """The sequence is held for a whole run (a value a structured request): the default's four kinds take
    2 bits each, not a byte, and any slice reads as the sequence's."""
    p = np.random.default_rng(kinds).random(kinds)
    seq = kind_sequence(p / p.sum(), 10_001, np.random.default_rng(1))
    packed = _PackedKinds(seq, kinds)
    assert packed.packed.nbytes == -(-len(seq) * bits // 8)
    for start, count in ((0, len(seq)), (3, 65), (9_990, 11), (5_000, 0)):
        assert np.array_equal(packed.slice(start, count), seq[start:start + count])


def test_slow_grammars_scenario_is_the_default_with_the_samples_own_mix():
    default = read_yaml_mapping(builtin_config_path("default"))
    slow = read_yaml_mapping(builtin_config_path("slow_grammars"))
    assert default["workload"].pop("kind_weights")
    assert slow == default
    assert RunConfig.model_validate(slow).workload.kind_weights is None
