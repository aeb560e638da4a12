"""scripts/build_default_profiles.py: the request count that walks every corpus spec, the merge of the
drafts run's rollbacks and draft validity, the coverage check, and the shipped profiles it built."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from cdbench.harness.config import RunConfig
from cdbench.harness.costs.grammar_profile import (
    CompileMeasurement,
    GrammarProfile,
    WalkMeasurement,
)
from cdbench.results.config_files import (
    builtin_config_path,
    read_yaml_mapping,
    validate_config,
)
from cdbench.workloads.generator import kind_sequence

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "build_default_profiles.py"
_spec = importlib.util.spec_from_file_location("build_default_profiles", _SCRIPT)
build = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = build
_spec.loader.exec_module(build)

MIX = {"json_schema": 0.85, "regex": 0.06, "choice": 0.06, "ebnf": 0.03}


def _counts(n: int, weights: dict[str, float]) -> np.ndarray:
    p = np.array(list(weights.values()))
    return np.bincount(kind_sequence(p / p.sum(), n, np.random.default_rng(1)), minlength=len(p))


@pytest.mark.parametrize("specs", [{"json_schema": 160, "regex": 50, "choice": 50, "ebnf": 29},
                                   {"json_schema": 3, "regex": 1, "choice": 1, "ebnf": 1},
                                   {"json_schema": 500, "regex": 1, "choice": 1, "ebnf": 1}])
def test_covering_requests_is_the_fewest_that_give_every_kind_its_specs(specs) -> None:
    n = build.covering_requests(specs, MIX)
    need = np.array(list(specs.values()))
    assert np.all(_counts(n, MIX) >= need)
    assert np.any(_counts(n - 1, MIX) < need)


def test_covering_requests_without_weights_is_the_corpus_size() -> None:
    assert build.covering_requests({"": 37}, None) == 37


def _walk(spec: str, kind: str = "json_schema", drafts: bool = False) -> WalkMeasurement:
    n = 6
    return WalkMeasurement(spec, kind, fill_s=np.full(n, 1e-5), accept_s=np.full(n, 1e-6),
                           rollback_s=np.full(2, 3e-6) if drafts else np.zeros(0),
                           drafts_past=np.array([3, 3, 2]) if drafts else np.zeros(0, np.int64),
                           valid_past=np.array([3, 1, 0]) if drafts else np.zeros(0, np.int64))


def _ok(spec: str, kind: str = "json_schema") -> CompileMeasurement:
    return CompileMeasurement(spec, kind, "ok", 1e-3)


def test_with_drafts_takes_rollbacks_and_draft_validity_per_spec_and_kind() -> None:
    plain = GrammarProfile.from_measurements("b", "v", [_ok("a"), _ok("b"), _ok("r", "regex")],
                                             [_walk("a"), _walk("b"), _walk("r", "regex")])
    drafted = GrammarProfile.from_measurements("b", "v", [_ok("a")], [_walk("a", drafts=True)])
    merged = build.with_drafts(plain, drafted)
    by_id = {s.spec_id: s for s in merged.specs.values()}
    assert by_id["a"].draft_tried == [3, 2, 1] and by_id["a"].draft_valid == [2, 1, 1]
    assert by_id["a"].rollback_s == pytest.approx(3e-6)
    assert by_id["b"].draft_tried == [] and by_id["b"].rollback_s is None  # not in the drafts run: as measured
    assert merged.kinds["json_schema"].draft_tried == [3, 2, 1]
    assert merged.kinds["json_schema"].rollback_s.count == 2
    assert merged.overall.rollback_s.count == 2
    # the rest is the plain run's
    assert by_id["b"].fill_scale_s == pytest.approx(1e-5) and merged.kinds["json_schema"].fill_s.count == 12
    assert merged.kinds["regex"].draft_tried == []


def test_uncovered_lists_specs_neither_walked_nor_failed() -> None:
    profile = GrammarProfile.from_measurements(
        "b", "v", [_ok("a"), CompileMeasurement("bad", "json_schema", "unsupported"), _ok("compiled-only")],
        [_walk("a")])
    corpus = {"json_schema": ["a", "bad", "compiled-only", "never"], "regex": ["r"]}
    assert build.uncovered(profile, corpus) == {"json_schema": ["compiled-only", "never"], "regex": ["r"]}


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_shipped_profiles_walk_every_default_corpus_spec_and_keep_draft_validity(backend: str) -> None:
    default = validate_config(RunConfig, read_yaml_mapping(builtin_config_path("default")), "default.yaml")
    profile = GrammarProfile.builtin(backend)
    assert build.uncovered(profile, build.corpus_specs(default.workload)) == {}
    assert all(kp.draft_tried and kp.rollback_s.count for kp in profile.kinds.values())


@pytest.mark.slow  # builds the default corpus's instance pools (minutes on a fresh cache)
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_shipped_profiles_walk_every_text_of_the_default_pools(backend: str) -> None:
    from cdbench.backends.vocab import load_vocab
    from cdbench.harness.costs.spec_profile import instance_key, spec_key_text
    from cdbench.workloads.corpora import load_corpora
    from cdbench.workloads.generator import distinct_specs
    from cdbench.workloads.instances import InstanceFailure, PoolCache

    default = validate_config(RunConfig, read_yaml_mapping(builtin_config_path("default")), "default.yaml")
    wl = default.workload
    load = load_corpora(wl.corpus, kinds=wl.kinds, id_prefix=wl.id_prefix, sample=wl.corpus_sample, seed=wl.seed,
                        limit=wl.corpus_limit)
    profile = GrammarProfile.builtin(backend)
    failed = {s.spec_id for s in profile.specs.values() if s.status not in (None, "ok")} | set(profile.failed_specs)
    vocab, cache = load_vocab(default.vocab), PoolCache()
    walked = missing = 0
    for item in distinct_specs(load.items)[0]:
        if item.id in failed or item.kind not in wl.kind_weights:
            continue
        try:
            pool = cache.get(item.id, item.to_spec(), vocab, size=wl.instances_per_spec, seed=wl.instance_seed)
        except InstanceFailure:
            continue
        base = spec_key_text(item.kind, item.id)
        found = sum(instance_key(base, tokens) in profile.instances for tokens in pool.tokens)
        walked += found
        missing += len(pool.tokens) - found
    assert walked > 0 and missing == 0
