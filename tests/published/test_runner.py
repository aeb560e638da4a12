"""The runner: the verdict's rule, every shipped entry at small scale, arms' configurations and errors."""

from __future__ import annotations

import math

import pytest

from cdbench.published.registry import RegistryError, load_registry, parse_registry
from cdbench.published.runner import arm_config, match_entries, run_entry, sweep_registry, verdict

REGISTRY = load_registry()


@pytest.mark.parametrize(("published", "predicted", "reproducible", "expected"), [
    (0.30, 0.30, True, "reproduced"),
    (0.30, 0.385, True, "reproduced"),   # just inside +30 % of the effect
    (0.30, 0.40, True, "missed"),
    (0.30, 0.20, True, "missed"),
    (-0.33, -0.30, True, "reproduced"),
    (0.10, -0.10, True, "missed"),       # the sign is wrong
    (0.0, 0.04, True, "reproduced"),     # a published no-change
    (0.0, 0.06, True, "missed"),
    (0.30, 0.30, False, "not reproducible"),
])
def test_verdict(published, predicted, reproducible, expected):
    assert verdict(published, predicted, reproducible) == expected


@pytest.mark.parametrize("entry_id", [e.id for e in REGISTRY.entries])
def test_every_entry_runs_at_small_scale(entry_id):
    entry = REGISTRY.entry(entry_id)
    result = run_entry(REGISTRY, entry, "small")
    assert result.requests <= entry.small_requests
    assert result.predicted_base > 0 and math.isfinite(result.predicted_effect)
    assert result.published_effect == pytest.approx(entry.published.effect)
    assert result.verdict == verdict(entry.published.effect, result.predicted_effect, entry.reproducible)
    assert (result.reason == "") == (result.verdict == "reproduced")


def test_the_runs_are_deterministic():
    entry = REGISTRY.entry("vllm-26866-structured-cost")
    assert run_entry(REGISTRY, entry, "small") == run_entry(REGISTRY, entry, "small")


def test_arms_differ_by_their_overrides_and_the_registry_folder_is_substituted():
    entry = REGISTRY.entry("vllm-26866-bitmask-beside-forward")
    base, treatment = (arm_config(REGISTRY, entry, arm) for arm in ("base", "treatment"))
    assert base.scheduler_config().fill_beside_forward is False
    assert treatment.scheduler_config().fill_beside_forward is True
    assert base.costs.model == str(REGISTRY.folder / "models" / "qwen3-1.7b.yaml")
    assert base.workload.num_requests == 4000
    assert arm_config(REGISTRY, entry, "base", "small").workload.num_requests == entry.small_requests


def test_an_arm_that_does_not_validate_names_the_entry_and_the_arm():
    reg = parse_registry({"entries": [{
        "id": "x", "title": "t", "reproducible": True,
        "source": {"kind": "issue", "url": "https://github.com/o/r/issues/1", "title": "t", "date": "2025-01"},
        "setup": {"engine": "vllm", "version": "1", "workload": "w", "load": "l", "change": "c"},
        "published": {"metric": "request_throughput", "base": 1, "treatment": 2, "unit": "req/s"},
        "config": {"workload": {"num_requests": 4}},
        "arms": {"treatment": {"scheduler.overlapp": True}},
    }]})
    with pytest.raises(RegistryError, match=r"entry 'x', arm treatment: scheduler.overlapp: Extra inputs"):
        arm_config(reg, reg.entries[0], "treatment")


# one schema's grammar costs as constants, so that its fill time alone is swept (the other costs: any values)
FIXED_GRAMMAR = {"costs.fixed_grammar.accept_time_s": 4e-6, "costs.fixed_grammar.compile_time_s": 2e-3,
                 "costs.fixed_grammar.rollback_time_s": 0.0}


def test_a_sweep_sets_its_key_in_both_arms_of_every_matched_entry():
    points = sweep_registry(REGISTRY, ["vllm-26866-bitmask-*"], "costs.fixed_grammar.fill_time_s", [5e-6, 2e-4],
                            FIXED_GRAMMAR, "small")
    assert [p.value for p in points] == [5e-6, 2e-4]
    short, long = (p.results[0] for p in points)
    assert short.id == long.id == "vllm-26866-bitmask-beside-forward"
    # a longer fill hides more beside the forward, so moving it there gains more
    assert long.predicted_effect > short.predicted_effect + 0.05
    assert points[0].reproduced == (short.verdict == "reproduced")


def test_a_sweep_runs_an_arm_configured_as_one_already_run_once(monkeypatch):
    import cdbench.harness.run as harness_run

    calls = []
    real = harness_run.run
    monkeypatch.setattr(harness_run, "run", lambda config: calls.append(config) or real(config))
    # both entries' base arms are main without structured requests
    sweep_registry(REGISTRY, ["vllm-26866-structured-cost", "vllm-26866-mixed-main"], "workload.seed", [1],
                   scale="small")
    assert len(calls) == 3


def test_entries_are_matched_by_id_or_pattern_in_registry_order():
    ids = [e.id for e in match_entries(REGISTRY, ["vllm-26866-mixed-*", "vllm-24300"])]
    assert ids == ["vllm-24300", "vllm-26866-mixed-main", "vllm-26866-mixed-beside-forward",
                   "vllm-26866-mixed-async"]
    with pytest.raises(RegistryError, match="nope"):
        match_entries(REGISTRY, ["nope-*"])
