"""The host's forward speed (costs.forward_speed): the fit's rule, and a model run priced at it."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from cdbench.harness.config import RunConfig
from cdbench.harness.costs.forward import (
    ForwardConfig,
    ForwardCostModel,
    attention_pairs,
)
from cdbench.harness.costs.forward_speed import (
    RUN_SPEED_SIGMA,
    ForwardSpeed,
    ForwardSpeedError,
    fit_speed,
)
from cdbench.harness.run import run
from cdbench.results.config_files import ConfigError
from cdbench.results.live_forward_speed import priced_steps, step_ratios
from cdbench.results.run_config import validate_run_config


def _ratios(centre: float, n: int, scatter: float = 0.005, seed: int = 0) -> np.ndarray:
    return centre * (1.0 + np.random.default_rng(seed).normal(0.0, scatter, n))


def test_ratios_of_one_speed_give_it_back_as_one():
    speed = fit_speed(_ratios(1.05, 400), _ratios(1.05, 40, seed=1), "live-run:x")
    assert speed.decode == speed.prefill == pytest.approx(1.05, abs=2e-3)
    assert (speed.decode_steps, speed.prefill_steps) == (400, 40)
    assert speed.decode_spread == pytest.approx(0.674 * 0.005 * 1.05, rel=0.2)  # a normal's half IQR


def test_kinds_apart_by_more_than_their_spread_get_a_speed_each():
    split = fit_speed(_ratios(1.03, 400), _ratios(0.98, 40, seed=1), "live-run:x")
    assert split.decode == pytest.approx(1.03, abs=2e-3) and split.prefill == pytest.approx(0.98, abs=3e-3)
    # 0.6 points apart with 2 points of scatter: one speed, the median of all steps
    close = fit_speed(_ratios(1.030, 400, 0.03), _ratios(1.024, 40, 0.03, seed=1), "live-run:x")
    assert close.decode == close.prefill
    assert close.decode == pytest.approx(np.median(np.concatenate([_ratios(1.030, 400, 0.03),
                                                                    _ratios(1.024, 40, 0.03, seed=1)])))


def test_a_fit_of_a_few_steps_is_refused_naming_its_source():
    with pytest.raises(ForwardSpeedError, match=r"live-run:x: 9 priced forward steps; a fit needs 10"):
        fit_speed([1.0] * 9, [], "live-run:x")


def test_the_speed_multiplies_the_whole_step_by_its_kind():
    base = ForwardCostModel("qwen3-8b", "h100-sxm")
    fast = ForwardCostModel("qwen3-8b", "h100-sxm", speed=ForwardSpeed(decode=1.05, prefill=0.97))
    decode = dict(decode_rows=8, decode_kv_tokens=8000)
    prefill = dict(prefill_tokens=512, prefill_context_tokens=attention_pairs(512, 0), prefill_chunks=1,
                   decode_rows=8, decode_kv_tokens=8000)
    assert fast.step_s(**decode) == pytest.approx(1.05 * base.step_s(**decode), rel=1e-14)
    assert fast.step_s(**prefill) == pytest.approx(0.97 * base.step_s(**prefill), rel=1e-14)
    both = fast.step_s_array([0, 512], [0, attention_pairs(512, 0)], [8, 8], [8000, 8000], [0, 1])
    assert both == pytest.approx([1.05 * base.step_s(**decode), 0.97 * base.step_s(**prefill)], rel=1e-14)
    assert ForwardCostModel("qwen3-8b", "h100-sxm", speed=1.0).step_s(**decode) == base.step_s(**decode)


def test_calibration_is_the_earlier_name_of_forward_speed():
    assert ForwardConfig.model_validate({"calibration": 1.04}).forward_speed == 1.04
    # a config written before forward_speed carries calibration 1.0 beside a new forward_speed
    assert ForwardConfig.model_validate({"calibration": 1.0, "forward_speed": 1.02}).forward_speed == 1.02
    with pytest.raises(ValidationError, match="calibration is forward_speed's earlier name"):
        ForwardConfig.model_validate({"calibration": 1.04, "forward_speed": 1.02})


@pytest.mark.parametrize(("value", "message"), [
    ("fast", "expected a number, 'live-run:<run folder or PACK::RUN>' or 'probe:<file>'"),
    ("live-run:", "expected a number"),
    (0.0, "a forward speed is > 0"),
])
def test_a_bad_speed_is_refused(value, message):
    with pytest.raises(ValidationError, match=message):
        ForwardConfig.model_validate({"forward_speed": value})


def test_an_unresolved_source_is_not_priced():
    with pytest.raises(ValueError, match="is fitted when the run's configuration is checked"):
        ForwardConfig(forward_speed="live-run:runs/x").build()


def _model_run(speed):
    tree = {"mode": "model", "vocab": "cl100k", "seed": 3, "policy": {"name": "sglang"},
            "costs": {"model": "qwen3-8b", "gpu": "h100-sxm", "fixed_grammar": {}, "forward_speed": speed},
            "workload": {"num_requests": 30, "kinds": ["regex"], "arrival": {"process": "poisson", "rate": 40.0},
                         "prompt_len": {"dist": "uniform", "low": 64, "high": 900},
                         "output_len": {"dist": "uniform", "low": 8, "high": 60}}}
    config = RunConfig.model_validate(tree)
    return config, run(config)


def test_a_model_run_prices_each_steps_forward_at_exactly_its_speed():
    speed = ForwardSpeed(decode=1.05, prefill=0.97)
    config, result = _model_run(speed.model_dump())
    steps, requests = result.steps, result.requests
    at_one = config.costs.model_copy(update={"forward_speed": 1.0}).build()
    decode, prefill, left_out = step_ratios(steps, requests, at_one, config.scheduler_config().cuda_graph_sizes)
    assert len(decode) > 50 and len(prefill) > 5
    assert decode == pytest.approx(np.full(len(decode), 1.05), rel=1e-12)
    assert prefill == pytest.approx(np.full(len(prefill), 0.97), rel=1e-12)
    assert result.summary.forward_speed == speed


def test_a_model_run_at_a_speed_is_deterministic():
    first, second = _model_run(1.04)[1], _model_run(1.04)[1]
    assert first.steps.equals(second.steps)
    assert first.summary == second.summary
    # a slower forward lengthens the tokens' gaps (a request's mean TPOT over 30 short answers need not follow:
    # the schedule changes with the step times)
    assert first.summary.mean_itl_ms > _model_run(1.0)[1].summary.mean_itl_ms


def test_the_mtp_heads_passes_are_part_of_the_step_a_speed_is_read_from():
    """A run drafting with the model's MTP head: its steps' forwards hold the head's passes, so the ratios add
    them to the price (without them a host at the calibration's speed would read as slower); decode steps of
    any row count, padded to a graph or not, come back at exactly the speed they ran at."""
    tree = {"mode": "model", "vocab": "cl100k", "seed": 5, "policy": {"name": "sglang"},
            "costs": {"model": "qwen3.5-35b-a3b", "gpu": "h200", "fixed_grammar": {}, "forward_speed": 1.05},
            "workload": {"num_requests": 30, "kinds": ["regex"], "arrival": {"process": "poisson", "rate": 40.0},
                         "prompt_len": {"dist": "uniform", "low": 64, "high": 600},
                         "output_len": {"dist": "uniform", "low": 8, "high": 60},
                         "spec_decode": {"k": 2, "alpha": 0.7, "drafter": "mtp"}}}
    config = RunConfig.model_validate(tree)
    result = run(config)
    at_one = config.costs.model_copy(update={"forward_speed": 1.0}).build()
    sizes = config.scheduler_config().cuda_graph_sizes
    decode, prefill, _ = step_ratios(result.steps, result.requests, at_one, sizes, mtp_drafts=2)
    assert len(decode) > 20 and len(set(result.steps["decode_tokens"])) > 5
    assert decode == pytest.approx(np.full(len(decode), 1.05), rel=1e-12)
    assert prefill == pytest.approx(np.full(len(prefill), 1.05), rel=1e-12)
    without_head, _, _ = step_ratios(result.steps, result.requests, at_one, sizes)
    assert np.median(without_head) > 1.1


BY_TOKENS = ForwardSpeed(decode=1.02, prefill=1.02, prefill_by_tokens=((300.0, 1.08), (1500.0, 0.95)))


def _prefill_run(speed):
    tree = {"mode": "model", "vocab": "cl100k", "seed": 4, "policy": {"name": "sglang"},
            "costs": {"model": "qwen3-8b", "gpu": "h100-sxm", "fixed_grammar": {}, "forward_speed": speed},
            "workload": {"num_requests": 160, "kinds": ["regex"], "arrival": {"process": "poisson", "rate": 8.0},
                         "prompt_len": {"dist": "lognormal", "median": 600, "sigma": 0.8, "min": 64, "max": 4000},
                         "output_len": {"dist": "uniform", "low": 4, "high": 12}}}
    config = RunConfig.model_validate(tree)
    return config, run(config)


def test_a_step_with_prefill_chunks_runs_at_the_speed_of_its_tokens():
    config, result = _prefill_run(BY_TOKENS.model_dump())
    at_one = config.costs.model_copy(update={"forward_speed": 1.0}).build()
    decode, prefill, tokens, _ = priced_steps(result.steps, result.requests, at_one,
                                              config.scheduler_config().cuda_graph_sizes)
    assert len(prefill) > 100 and tokens.min() < 300 and tokens.max() > 1500
    assert prefill == pytest.approx(BY_TOKENS.prefill_at(tokens), rel=1e-12)
    assert decode == pytest.approx(np.full(len(decode), 1.02), rel=1e-12)
    # flat beyond the points, interpolated in log tokens between them
    assert BY_TOKENS.prefill_at([100, 300, 670.8, 1500, 9000]) == pytest.approx([1.08, 1.08, 1.015, 0.95, 0.95],
                                                                                  abs=1e-3)


def test_a_speed_by_tokens_is_fitted_back_from_the_steps_it_priced():
    config, result = _prefill_run(BY_TOKENS.model_dump())
    at_one = config.costs.model_copy(update={"forward_speed": 1.0}).build()
    decode, prefill, tokens, _ = priced_steps(result.steps, result.requests, at_one,
                                              config.scheduler_config().cuda_graph_sizes)
    fitted = fit_speed(decode, prefill, "live-run:x", prefill_tokens=tokens)
    points = np.array(fitted.prefill_by_tokens)
    assert len(points) >= 3
    assert points[:, 1] == pytest.approx(BY_TOKENS.prefill_at(points[:, 0]), abs=0.01)
    assert "prefill by tokens" in fitted.describe()
    # one speed at every size: no curve
    _, plain = _prefill_run(1.03)
    d, p, t, _ = priced_steps(plain.steps, plain.requests, at_one, config.scheduler_config().cuda_graph_sizes)
    assert fit_speed(d, p, "live-run:x", prefill_tokens=t).prefill_by_tokens is None
    with pytest.raises(ValueError, match="prefill token counts"):
        fit_speed(d, p, "live-run:x", prefill_tokens=t[:-1])


def test_the_modules_examples_run():
    import doctest

    import cdbench.harness.costs.forward_speed as forward_speed_module
    import cdbench.results.run_config as run_config_module

    assert doctest.testmod(forward_speed_module).failed == 0
    assert doctest.testmod(run_config_module).failed == 0


def _drawn(seed, sigma=0.01, speed=1.02, mode="model"):
    tree = {"mode": mode, "seed": seed, "costs": {"forward_speed": speed, "forward_speed_sigma": sigma}}
    return validate_run_config(tree, "t").costs


def test_a_run_draws_its_forward_speed_from_its_seed():
    first, again, other = _drawn(3), _drawn(3), _drawn(4)
    assert first.speed() == again.speed() and first.speed().decode != other.speed().decode
    assert first.forward_speed_sigma == 0.0 and "sigma 0.01, seed 3" in first.speed().source
    logs = np.log([_drawn(seed).speed().decode / 1.02 for seed in range(400)])
    assert np.std(logs) == pytest.approx(0.01, rel=0.15) and abs(np.mean(logs)) < 0.002
    # a fitted speed is scaled whole: both kinds and its points by tokens
    fitted = ForwardSpeed(decode=1.0, prefill=0.98, prefill_by_tokens=((300.0, 1.05), (1500.0, 0.95)))
    drawn = _drawn(3, speed=fitted.model_dump()).speed()
    factor = drawn.decode
    assert drawn.prefill == pytest.approx(0.98 * factor) and drawn.prefill_by_tokens[1][1] == pytest.approx(
        0.95 * factor)
    assert _drawn(3, sigma="measured").speed().decode != _drawn(3, sigma=0.0).speed().decode == 1.02
    assert RUN_SPEED_SIGMA == 0.0045


def test_a_drawn_speed_reruns_as_drawn_and_a_live_run_refuses_it(tmp_path):
    drawn = validate_run_config({"mode": "model", "seed": 5, "costs": {"forward_speed_sigma": "measured"}}, "t")
    again = validate_run_config(drawn.model_dump(mode="json"), "dumped")
    assert again.costs.speed() == drawn.costs.speed()  # the dumped config holds the speed, its sigma 0
    with pytest.raises(ConfigError, match="forward_speed_sigma draws a model or hybrid run's forward speed"):
        _drawn(1, mode="live")
    with pytest.raises(ValidationError, match="run-to-run speed sigma"):
        ForwardConfig.model_validate({"forward_speed_sigma": 0.7})
