import math

import pytest

from cdbench.reports.gate import (
    Baseline,
    Direction,
    GateError,
    Verdict,
    evaluate_gate,
    metric_direction,
    numeric_metrics,
    parse_tolerances,
)


@pytest.mark.parametrize(
    ("name", "direction"),
    [
        ("mean_ttft_ms", Direction.LOWER_IS_BETTER),
        ("p99_tpot_ms", Direction.LOWER_IS_BETTER),
        ("median_e2el_ms", Direction.LOWER_IS_BETTER),
        ("request_throughput", Direction.HIGHER_IS_BETTER),
        ("output_throughput", Direction.HIGHER_IS_BETTER),
        ("request_goodput", Direction.HIGHER_IS_BETTER),
        ("cache_hit_rate", Direction.HIGHER_IS_BETTER),
        ("validity_rate", Direction.HIGHER_IS_BETTER),
        ("rollback_rate", Direction.LOWER_IS_BETTER),
        ("abort_rate", Direction.LOWER_IS_BETTER),
        ("mean_grammar_wait_ms", Direction.LOWER_IS_BETTER),
        ("completed", Direction.HIGHER_IS_BETTER),
        ("num_prompts", Direction.INFORMATIONAL),
        ("workload_issues.skipped_corpus_lines", Direction.LOWER_IS_BETTER),
        ("workload_issues.bad_trace_lines", Direction.LOWER_IS_BETTER),
        ("workload_issues.duplicate_specs", Direction.LOWER_IS_BETTER),
    ],
)
def test_direction_is_inferred_from_the_name(name, direction):
    assert metric_direction(name) is direction


def _verdicts(result):
    return {c.metric: c.verdict for c in result.checks}


def test_latency_up_and_throughput_down_are_regressions_in_either_direction_only():
    baseline = Baseline(metrics={"mean_ttft_ms": 100.0, "request_throughput": 10.0}, default_tolerance_pct=5.0)
    worse = evaluate_gate({"mean_ttft_ms": 106.0, "request_throughput": 9.0}, baseline)
    assert _verdicts(worse) == {"mean_ttft_ms": Verdict.REGRESSED, "request_throughput": Verdict.REGRESSED}
    assert not worse.passed
    better = evaluate_gate({"mean_ttft_ms": 80.0, "request_throughput": 12.0}, baseline)
    assert _verdicts(better) == {"mean_ttft_ms": Verdict.IMPROVED, "request_throughput": Verdict.IMPROVED}
    assert better.passed
    within = evaluate_gate({"mean_ttft_ms": 104.0, "request_throughput": 9.6}, baseline)
    assert _verdicts(within) == {"mean_ttft_ms": Verdict.OK, "request_throughput": Verdict.OK}


def test_command_line_tolerance_overrides_the_baseline():
    baseline = Baseline(metrics={"p99_tpot_ms": 10.0}, tolerances_pct={"p99_tpot_ms": 1.0})
    assert not evaluate_gate({"p99_tpot_ms": 10.5}, baseline).passed
    assert evaluate_gate({"p99_tpot_ms": 10.5}, baseline, tolerances={"p99_tpot_ms": 10.0}).passed


def test_missing_metric_fails_new_and_informational_do_not():
    baseline = Baseline(metrics={"mean_ttft_ms": 1.0, "num_prompts": 10.0})
    result = evaluate_gate({"num_prompts": 99.0, "output_throughput": 5.0}, baseline)
    assert _verdicts(result) == {
        "mean_ttft_ms": Verdict.MISSING,
        "num_prompts": Verdict.INFO,
        "output_throughput": Verdict.NEW,
    }
    assert [c.metric for c in result.regressions] == ["mean_ttft_ms"]


def test_zero_baseline_any_bad_increase_regresses():
    baseline = Baseline(metrics={"abort_rate": 0.0})
    result = evaluate_gate({"abort_rate": 0.01}, baseline)
    assert result.checks[0].change_pct == math.inf
    assert not result.passed
    assert evaluate_gate({"abort_rate": 0.0}, baseline).passed


def test_parse_tolerances_and_errors():
    assert parse_tolerances(["a=1", "b=2.5%"]) == {"a": 1.0, "b": 2.5}
    for bad in ["a", "=3", "a=x", "a=-1"]:
        with pytest.raises(GateError, match="tolerance"):
            parse_tolerances([bad])


def test_numeric_metrics_drops_non_numbers():
    assert numeric_metrics({"a": 1, "b": 2.5, "c": "x", "d": True, "e": float("nan"), "f": None}) == {"a": 1.0, "b": 2.5}


def test_baseline_round_trip_and_bad_files(tmp_path):
    baseline = Baseline(metrics={"mean_ttft_ms": 1.5}, tolerances_pct={"mean_ttft_ms": 0.5}, source="x")
    path = tmp_path / "b.json"
    baseline.save(path)
    assert Baseline.load(path) == baseline
    with pytest.raises(GateError, match="does not exist"):
        Baseline.load(tmp_path / "nope.json")
    path.write_text('{"metrics": {"a": "fast"}}')
    with pytest.raises(GateError, match="metrics.a"):
        Baseline.load(path)


def test_a_tolerance_for_a_metric_that_does_not_exist_is_an_error_naming_close_matches():
    baseline = Baseline(metrics={"p99_ttft_ms": 10.0, "p99_tpot_ms": 2.0})
    current = {"p99_ttft_ms": 10.0, "p99_tpot_ms": 2.0, "mean_ttft_ms": 4.0}
    with pytest.raises(GateError, match=r"--tolerance names a metric neither the run nor the baseline has: "
                                        r"'p99_tft_ms' \(did you mean p99_ttft_ms"):
        evaluate_gate(current, baseline, tolerances={"p99_tft_ms": 5.0})
    assert evaluate_gate(current, baseline, tolerances={"mean_ttft_ms": 5.0}).passed  # a run-only metric is known
    stale = Baseline(metrics=baseline.metrics, tolerances_pct={"p99_tpot_ms": 1.0, "zzz": 2.0, "p99_ttft": 3.0})
    with pytest.raises(GateError, match=r"the baseline's tolerances_pct names metrics .*: 'p99_ttft' \(did you mean "
                                        r"p99_ttft_ms.*\); 'zzz'$"):
        evaluate_gate(current, stale)
