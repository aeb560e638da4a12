"""A model run refuses a grammar profile measured with another backend, engine version or vocabulary,
unless ``costs.allow_mismatched_profile`` says to use it, and then its summary records how they differ."""

from __future__ import annotations

import re

import pytest

from cdbench.harness.config import CostConfig, RunConfig
from cdbench.harness.costs.grammar_profile import GrammarProfile, ProfileError
from cdbench.harness.costs.spec_store import backend_version

XGR, LLG = backend_version("xgrammar"), backend_version("llguidance")


def _costs(tmp_path, **fields) -> CostConfig:
    return CostConfig.model_validate({"spec_store": str(tmp_path / "store"), "spec_costs": "predict", **fields})


@pytest.mark.parametrize("backend, vocab, profile, ours, theirs", [
    ("xgrammar", "qwen3.6", "llguidance", f"llguidance {LLG} on qwen3.6", f"xgrammar {XGR} on qwen3.6"),
    ("xgrammar", "deepseek-v4", None, f"xgrammar {XGR} on qwen3.6", f"xgrammar {XGR} on deepseek-v4"),
    ("reasoner", "cl100k", None, f"xgrammar {XGR} on qwen3.6", f"xgrammar {XGR} on cl100k"),
])
def test_a_mismatched_profile_is_refused_in_one_line_naming_both(tmp_path, backend, vocab, profile, ours, theirs):
    costs = _costs(tmp_path, grammar_profile=profile)
    with pytest.raises(ProfileError) as info:
        costs.grammar_costs(backend, 0, requests=[], vocab=vocab)
    message = str(info.value)
    assert "\n" not in message
    assert f"measured with {ours}; the run uses {theirs}" in message
    assert "costs.allow_mismatched_profile=true" in message


def test_a_profile_of_another_engine_version_is_refused(tmp_path):
    path = tmp_path / "old.parquet"
    GrammarProfile.builtin("outlines").model_copy(update={"engine_version": "0.0.1"}).save(path)
    with pytest.raises(ProfileError, match=re.escape(f"outlines 0.0.1 on qwen3.6; the run uses outlines "
                                                     f"{backend_version('outlines')} on qwen3.6")):
        _costs(tmp_path, grammar_profile=str(path)).grammar_costs("outlines", 0, requests=[], vocab="qwen3.6")


def test_matching_profiles_and_the_none_backend_on_any_vocabulary_run(tmp_path):
    for backend in ("xgrammar", "llguidance"):
        costs = _costs(tmp_path).grammar_costs(backend, 0, requests=[], vocab="qwen3.6")
        assert costs.coverage.profile_mismatch is None
    assert _costs(tmp_path).grammar_costs("none", 0, requests=[], vocab="cl100k").profile.backend == "none"


def test_a_reasoner_runs_own_profile_fits_it(tmp_path):
    path = tmp_path / "reasoner.parquet"
    GrammarProfile.builtin("outlines").model_copy(update={"backend": "reasoner",
                                                          "engine_version": backend_version("reasoner")}).save(path)
    costs = _costs(tmp_path, grammar_profile=str(path)).grammar_costs("reasoner", 0, requests=[], vocab="qwen3.6")
    assert costs.coverage.profile_mismatch is None
    with pytest.raises(ProfileError, match="measured with reasoner unversioned on qwen3.6; the run uses xgrammar"):
        _costs(tmp_path, grammar_profile=str(path)).grammar_costs("xgrammar", 0, requests=[], vocab="qwen3.6")


def test_an_allowed_mismatch_runs_and_its_summary_records_it(tmp_path):
    from cdbench.harness.run import run
    from cdbench.results.run_folder import load_run, save_run

    tree = {"mode": "model", "vocab": "cl100k", "backend": {"name": "xgrammar"},
            "costs": {"grammar_profile": "llguidance", "allow_mismatched_profile": True,
                      "spec_store": str(tmp_path / "store"), "spec_costs": "predict",
                      "fixed_gpu": {"forward_base_s": 0.01}},
            "workload": {"num_requests": 8, "kinds": ["regex", "choice"], "structured_ratio": 1.0,
                         "output_len": {"dist": "fixed", "value": 8}}}
    config = RunConfig.model_validate(tree)
    result = run(config)
    mismatch = (f"the shipped llguidance grammar profile was measured with llguidance {LLG} on qwen3.6; "
                f"the run uses xgrammar {XGR} on cl100k")
    assert result.summary.spec_costs.profile_mismatch == mismatch
    assert f"warning: {mismatch} (costs.allow_mismatched_profile)" in result.summary.spec_costs.lines()
    save_run(result, config, tmp_path / "run")
    assert load_run(tmp_path / "run").spec_costs.profile_mismatch == mismatch
