"""RunConfig: one model for the whole run; wrong keys are errors; sections build the cost sources."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from cdbench.harness.config import RunConfig
from cdbench.harness.costs.gpu import FixedGpuCosts, RooflineGpuCosts
from cdbench.harness.costs.grammar_profile import (
    CompileMeasurement,
    GrammarProfile,
    ProfileError,
    WalkMeasurement,
)
from cdbench.harness.executors.model import FixedGrammarCosts, ProfileGrammarCosts


def test_policy_preset_with_overrides():
    cfg = RunConfig.model_validate({"policy": {"name": "vllm", "host_cpus": 8},
                                    "scheduler": {"overlap": False, "ranks": 2}})
    sched = cfg.scheduler_config(spec_tokens=3)
    assert (sched.name, sched.compile_threads, sched.fill_threads) == ("vllm", 4, 4)
    assert (sched.overlap, sched.ranks, sched.spec_tokens) == (False, 2, 3)
    explicit = RunConfig.model_validate({"scheduler": {"spec_tokens": 1, "max_poll_iterations": None}})
    assert explicit.scheduler_config(spec_tokens=3).spec_tokens == 1  # an explicit override wins
    assert explicit.scheduler_config().max_poll_iterations is None  # null turns the timeout off


def test_dumped_config_reloads_to_the_same_run():
    cfg = RunConfig.model_validate({"policy": {"name": "vllm"}, "scheduler": {"ranks": 2},
                                    "workload": {"num_requests": 5, "spec_decode": {"k": 2, "alpha": 0.5}}})
    dumped = cfg.model_dump(mode="json")
    assert dumped["scheduler"]["ranks"] == 2 and dumped["scheduler"]["max_poll_iterations"] is None
    assert dumped["scheduler"]["spec_tokens"] == 2
    again = RunConfig.model_validate(dumped)
    assert again.scheduler_config(spec_tokens=2) == cfg.scheduler_config(spec_tokens=2)
    assert again.model_dump(mode="json") == dumped


@pytest.mark.parametrize("tree, where", [
    ({"scheduler": {"poll_intervall": 1}}, "scheduler.poll_intervall"),
    ({"policy": {"name": "tgi"}}, "policy.name"),
    ({"mode": "replay"}, "mode"),
    ({"costs": {"fixed_gpu": {"forward_s": 1}}}, "costs.fixed_gpu.forward_s"),
    ({"backend": {"nme": "xgrammar"}}, "backend.nme"),
])
def test_wrong_keys_and_values_name_the_path(tree, where):
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate(tree)
    assert where in str(info.value)


@pytest.mark.parametrize("model", ["qwen3-8b", "llama-3.1-8b", "qwen3.5-35b-a3b"])
def test_the_gpu_bitmask_is_as_wide_as_the_models_logits_whatever_the_tokenizer(model):
    """Engines size the bitmask to the model config's vocabulary (vLLM: allocate_token_bitmask(max_num_seqs,
    model_config.get_vocab_size())), so its copy, apply and sampling are priced at the model's width, not at
    the run's tokenizer's (Qwen3.6's 248,077 here, whatever the model)."""
    from cdbench.harness.costs.hardware import resolve_model
    from cdbench.harness.costs.mask import MaskCost, bitmask_bytes

    width = resolve_model(model).vocab_size
    gpus = [RunConfig.model_validate({"vocab": vocab, "costs": {"model": model, "gpu": "h100-sxm"}}).costs.gpu_costs()
            for vocab in ("qwen3.6", "cl100k")]
    tokenizer_wide = MaskCost.for_gpu("h100-sxm", 248_077)
    model_wide = MaskCost.for_gpu("h100-sxm", width)
    for gpu in gpus:
        assert gpu.mask.vocab_size == width and gpu.mask_row_bytes == bitmask_bytes(1, width)
        assert gpu.copy_s(800, False) == pytest.approx(float(model_wide.copy_s(800, pinned=False)))
        assert gpu.sample_s(800) == pytest.approx(float(model_wide.sample_s(800)))
    if width != 248_077:
        assert gpus[0].copy_s(800, False) != pytest.approx(float(tokenizer_wide.copy_s(800, pinned=False)))


def test_cost_sections_build_the_cost_sources(tmp_path):
    fixed = RunConfig.model_validate({"costs": {"fixed_gpu": {"forward_base_s": 0.02},
                                                "fixed_grammar": {"fill_time_s": 1e-5}}})
    assert isinstance(fixed.costs.gpu_costs(), FixedGpuCosts)
    assert isinstance(fixed.costs.grammar_costs("xgrammar", 0), FixedGrammarCosts)
    roofline = RunConfig.model_validate({"costs": {"model": "llama-3.1-8b", "gpu": "h200"}})
    gpu = roofline.costs.gpu_costs()
    assert isinstance(gpu, RooflineGpuCosts) and gpu.forward_s(np.zeros(0), np.zeros(0), 8, 8000) > 0
    profile = GrammarProfile.from_measurements(
        "mine", "cl100k", [CompileMeasurement("s", "regex", "ok", 0.01)],
        [WalkMeasurement("s", "regex", fill_s=np.full(4, 1e-5), accept_s=np.full(4, 1e-6),
                         rollback_s=np.full(2, 1e-6))])
    path = tmp_path / "mine.json"
    profile.save(path)
    from_file = RunConfig.model_validate({"costs": {"grammar_profile": str(path)}})
    assert isinstance(from_file.costs.grammar_costs("xgrammar", 0), ProfileGrammarCosts)
    assert from_file.costs.grammar_costs("xgrammar", 0).fill_scale == 1.0
    release = RunConfig.model_validate({"costs": {"grammar_profile": str(path), "grammar_fill_scale": 1.9}})
    assert release.costs.grammar_costs("xgrammar", 0).fill_scale == 1.9
    with pytest.raises(ValidationError, match="grammar_fill_scale"):
        RunConfig.model_validate({"costs": {"grammar_fill_scale": 0}})
    with pytest.raises(ProfileError, match="no default grammar profile for backend 'nonesuch'"):
        RunConfig().costs.grammar_costs("nonesuch", 0)


def test_model_mode_with_the_reasoner_draws_from_its_inner_backends_profile():
    costs = RunConfig.model_validate({"mode": "model", "backend": {"name": "reasoner"}}).costs
    assert costs.grammar_costs("reasoner", 0).profile.backend == "xgrammar"  # the reasoner's default inner
    assert costs.grammar_costs("reasoner", 0, {"inner": "llguidance"}).profile.backend == "llguidance"
    with pytest.raises(ValueError, match="inner backend's name"):
        costs.grammar_costs("reasoner", 0, {"inner": 3})


def _embedded(tmp_path, mode: str, progress=None, **workload):
    from cdbench.harness.run import run

    tree = {"mode": mode, "vocab": "cl100k", "seed": 1,
            "workload": {"num_requests": 12, "kinds": ["regex", "choice"], "structured_ratio": 0.75,
                         "arrival": {"process": "poisson", "rate": 50.0}, "prompt_len": {"dist": "fixed", "value": 64},
                         "output_len": {"dist": "fixed", "value": 8}, **workload},
            "costs": {"fixed_grammar": {}, "fixed_gpu": {"forward_base_s": 0.01}}}
    return run(RunConfig.model_validate(tree), progress=progress)


def test_run_from_config_in_hybrid_mode_validates_real_outputs(tmp_path):
    result = _embedded(tmp_path, "hybrid", spec_decode={"k": 2, "alpha": 0.7})
    frame = result.requests
    assert len(frame) == 12 and (frame["abort_reason"] == "").all()
    assert frame.loc[frame["structured"], "valid"].all()
    assert frame["drafted"].sum() > 0
    assert result.backend_call_s > 0


def test_run_reports_each_stage_in_order_with_rising_fractions(tmp_path):
    seen: list[tuple[str, float]] = []
    _embedded(tmp_path, "hybrid", progress=lambda stage, fraction: seen.append((stage, fraction)))
    stages = list(dict.fromkeys(stage for stage, _ in seen))
    assert stages == ["loading the cl100k vocabulary", "generating the workload", "loading xgrammar", "simulating"]
    for stage in stages:
        fractions = [f for s, f in seen if s == stage]
        assert fractions == sorted(fractions) and all(0.0 <= f <= 1.0 for f in fractions)
    assert seen[-1] == ("simulating", 1.0)


def test_run_names_each_stage_before_its_slow_start(tmp_path, monkeypatch):
    """The display moves from the start: a stage is reported before the vocabulary and the corpora load."""
    import cdbench.backends.vocab as vocab_module
    import cdbench.workloads.generator as generator_module

    events: list[str] = []
    load_vocab, load_corpora = vocab_module.load_vocab, generator_module.load_corpora

    def loading_vocab(*args, **kwargs):
        events.append("vocabulary loads")
        return load_vocab(*args, **kwargs)

    def loading_corpora(*args, **kwargs):
        events.append("corpora load")
        return load_corpora(*args, **kwargs)

    monkeypatch.setattr(vocab_module, "load_vocab", loading_vocab)
    monkeypatch.setattr(generator_module, "load_corpora", loading_corpora)
    _embedded(tmp_path, "model", progress=lambda stage, fraction: events.append(f"{stage} {fraction:g}"))
    assert events[:4] == ["loading the cl100k vocabulary 0", "vocabulary loads", "generating the workload 0",
                          "corpora load"]


def _profiled_model_config(seed: int, store: Path) -> RunConfig:
    """A model-mode run through the cost sources a default run builds: the shipped grammar profile (its
    per-request tables and draft draws), specs priced from the spec-cost store ``store``, the roofline
    forward and the measured mask tables."""
    return RunConfig.model_validate({
        "mode": "model", "vocab": "cl100k", "seed": seed,
        "costs": {"spec_store": str(store), "allow_mismatched_profile": True},  # the profile is qwen3.6's
        "workload": {"num_requests": 12, "seed": seed, "kinds": ["regex", "choice"], "structured_ratio": 0.75,
                     "arrival": {"process": "poisson", "rate": 50.0}, "prompt_len": {"dist": "fixed", "value": 64},
                     "spec_decode": {"k": 2, "alpha": 0.7}}})


_FRESH_RUN = """
import sys
import pandas as pd
from cdbench.harness.config import RunConfig
from cdbench.harness.run import run
result = run(RunConfig.model_validate_json(sys.argv[1]))
pd.to_pickle((result.requests, result.steps), sys.argv[2])
"""


def test_a_model_mode_run_does_not_depend_on_the_runs_before_it_in_its_process(tmp_path):
    """Nothing a run builds (profile, cost tables, cost models, pooled draws) carries into the next run: a
    seed's run after another seed's gives what it gives in a fresh process (a cache the first run filled
    would show there), and a seed run again gives its first results (state a run adds to would show here)."""
    from cdbench.harness.run import run

    store, fresh = tmp_path / "spec_costs", tmp_path / "fresh.pkl"
    # the store is meant to carry between runs: filled for both seeds in fresh processes first, every run
    # below finds it in the same state (its specs measured), so its summary's spec_costs is the same too
    for seed, out in ((1, tmp_path / "warm.pkl"), (2, fresh)):
        subprocess.run([sys.executable, "-c", _FRESH_RUN, _profiled_model_config(seed, store).model_dump_json(),
                        str(out)], check=True)
    first, other, again = (run(_profiled_model_config(seed, store)) for seed in (1, 2, 1))
    assert first.summary.completed == 12 and first.requests["drafted"].sum() > 0
    fresh_requests, fresh_steps = pd.read_pickle(fresh)
    pd.testing.assert_frame_equal(other.requests, fresh_requests)
    pd.testing.assert_frame_equal(other.steps, fresh_steps)
    pd.testing.assert_frame_equal(first.requests, again.requests)
    pd.testing.assert_frame_equal(first.steps, again.steps)
    assert first.summary == again.summary
    assert not first.requests["finish_s"].equals(other.requests["finish_s"])


def test_a_model_mode_run_passes_the_reasoners_inner_backend_to_its_costs(monkeypatch):
    from cdbench.harness import config as config_module
    from cdbench.harness.run import run

    seen = []
    original = config_module.CostConfig.grammar_costs

    def recording(self, backend, seed, options=None, **run):
        seen.append((backend, dict(options or {})))
        return original(self, backend, seed, options, **run)

    monkeypatch.setattr(config_module.CostConfig, "grammar_costs", recording)
    config = RunConfig.model_validate({
        "mode": "model", "backend": {"name": "reasoner", "options": {"inner": "llguidance"}},
        "workload": {"num_requests": 5, "corpus": ["embedded"], "token_source": "lengths"},
    })
    result = run(config)
    assert seen == [("reasoner", {"inner": "llguidance"})]
    # the inner backend's shipped profile priced the embedded specs: nothing guessed, nothing measured
    coverage = result.summary.spec_costs
    assert coverage.specs["profile"] == sum(coverage.specs.values()) and coverage.measured_now == 0


def test_cuda_graph_sizes_come_with_the_preset_and_are_checked():
    from cdbench.harness.policies import graph_size, policy

    sglang, vllm = policy("sglang").cuda_graph_sizes, policy("vllm").cuda_graph_sizes
    assert (graph_size(sglang, 9), graph_size(sglang, 256), graph_size(sglang, 257)) == (12, 256, None)
    assert (graph_size(vllm, 9), graph_size(vllm, 250), graph_size(vllm, 512)) == (16, 256, 512)
    cfg = RunConfig.model_validate({"scheduler": {"cuda_graph_sizes": [1, 8, 64]}})
    assert cfg.scheduler_config().cuda_graph_sizes == (1, 8, 64)
    for bad in ([8, 4], [0, 1], [2, 2]):
        with pytest.raises(ValidationError, match="cuda_graph_sizes"):
            RunConfig.model_validate({"scheduler": {"cuda_graph_sizes": bad}}).scheduler_config()


@pytest.mark.parametrize(("costs", "named"), [
    ({"model": "qwen3-8b", "gpu": "h100-sxm"}, "qwen3-8b__h100-sxm.json"),  # the shipped calibration, by default
    ({"model": "qwen3-8b", "gpu": "h100-sxm", "forward_calibration": "none"}, "none"),
    ({"fixed_gpu": {"forward_base_s": 0.01}}, None),  # no forward model priced the steps
])
def test_the_summary_names_what_priced_the_forward(costs, named):
    from cdbench.harness.run import run

    tree = {"mode": "model", "vocab": "cl100k", "seed": 1,
            "workload": {"num_requests": 4, "kinds": ["regex"], "arrival": {"process": "poisson", "rate": 50.0},
                         "prompt_len": {"dist": "fixed", "value": 64}, "output_len": {"dist": "fixed", "value": 4}},
            "costs": {"fixed_grammar": {}, **costs}}
    assert run(RunConfig.model_validate(tree)).summary.forward_calibration == named
