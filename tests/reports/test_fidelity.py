import json
import math

import numpy as np
import pandas as pd
import pytest
from synthetic_run import synthetic_frames, write_synthetic_run

from cdbench.harness.metrics import LogHistogram, summarize
from cdbench.reports.fidelity import (
    ACCEPTANCE_TOLERANCES,
    FIDELITY_METRICS,
    FidelityError,
    FidelityVerdict,
    check_same_workload,
    evaluate_fidelity,
    fidelity_frame,
    fidelity_markdown,
    fidelity_rich,
    paired_intervals,
    relative_error_pct,
    verdict_line,
    workload_identity,
    write_fidelity,
)
from cdbench.reports.gate import GateError
from cdbench.results.resolution import (
    ITL_FIGURES,
    RESOLVED_FIGURES,
    ErrorInterval,
    ResolutionError,
    _weighted_figures,
    error_intervals,
    itl_error_intervals,
    token_gaps,
)
from cdbench.results.run_folder import SavedRun

REF = {"median_ttft_ms": 20.0, "p99_ttft_ms": 100.0, "request_throughput": 10.0, "mask_share": 0.1}


def test_relative_error_is_signed_against_the_reference():
    assert relative_error_pct(20.0, 21.0) == pytest.approx(5.0)
    assert relative_error_pct(20.0, 18.0) == pytest.approx(-10.0)
    assert relative_error_pct(-2.0, -1.0) == pytest.approx(50.0)
    assert relative_error_pct(0.0, 0.0) == 0.0
    assert relative_error_pct(0.0, 3.0) is None and relative_error_pct(None, 3.0) is None


def test_each_run_is_judged_by_absolute_error_against_the_first():
    result = evaluate_fidelity(
        {"hybrid": REF,
         "close": {**REF, "median_ttft_ms": 19.2, "request_throughput": 10.4},  # -4 %, +4 %: within 5 %
         "far": {**REF, "median_ttft_ms": 21.2, "p99_ttft_ms": 80.0}},  # +6 % beyond 5 %, -20 % beyond 10 %
        tolerances={"median_ttft_ms": 5, "p99_ttft_ms": 10, "request_throughput": 5})
    assert result.reference == "hybrid" and result.runs == ("close", "far")
    assert list(result.metrics) == list(FIDELITY_METRICS)
    assert result.cell("median_ttft_ms", "close").error_pct == pytest.approx(-4.0)
    assert result.cell("median_ttft_ms", "close").verdict is FidelityVerdict.WITHIN
    assert result.cell("request_throughput", "close").verdict is FidelityVerdict.WITHIN
    assert result.cell("median_ttft_ms", "far").verdict is FidelityVerdict.BEYOND
    assert result.cell("p99_ttft_ms", "far").verdict is FidelityVerdict.BEYOND
    assert result.cell("mask_share", "far").verdict is FidelityVerdict.INFO  # no tolerance: reported only
    assert not result.passed
    assert {(c.metric, c.run) for c in result.failures} == {("median_ttft_ms", "far"), ("p99_ttft_ms", "far")}


def test_a_checked_metric_missing_from_a_run_fails():
    result = evaluate_fidelity({"a": REF, "b": {"median_ttft_ms": 20.0}}, tolerances={"p99_ttft_ms": 10})
    assert result.cell("p99_ttft_ms", "b").verdict is FidelityVerdict.NO_DATA
    assert not result.passed
    unchecked = evaluate_fidelity({"a": REF, "b": {"median_ttft_ms": 20.0}}, tolerances={"median_ttft_ms": 1})
    assert unchecked.passed  # missing, but nobody asked for it


def test_the_noise_floor_widens_the_bar_only_where_it_is_larger():
    noise = ({**REF}, {**REF, "median_ttft_ms": 22.0, "p99_ttft_ms": 101.0})  # 10 % and 1 % apart
    run = {**REF, "median_ttft_ms": 21.6, "p99_ttft_ms": 108.0}  # +8 % and +8 %
    tol = {"median_ttft_ms": 5, "p99_ttft_ms": 5}
    without = evaluate_fidelity({"h": REF, "m": run}, tolerances=tol)
    assert without.cell("median_ttft_ms", "m").verdict is FidelityVerdict.BEYOND
    result = evaluate_fidelity({"h": REF, "m": run}, noise=noise, tolerances=tol, noise_labels=("h", "h2"))
    median, p99 = result.cell("median_ttft_ms", "m"), result.cell("p99_ttft_ms", "m")
    assert median.noise_pct == pytest.approx(10.0) and median.allowed_pct == pytest.approx(10.0)
    assert median.verdict is FidelityVerdict.WITHIN
    assert p99.noise_pct == pytest.approx(1.0) and p99.allowed_pct == 5
    assert p99.verdict is FidelityVerdict.BEYOND
    markdown = fidelity_markdown(result)
    assert markdown.splitlines()[0] == "| metric | h | m | m error | noise | bar |"
    assert "| median_ttft_ms | 20 | 21.6 | +8.0% | 10.0% | 10.0% (noise) |" in markdown
    assert "| p99_ttft_ms | 100 | 108 | **+8.0%** | 1.0% | 5% |" in markdown
    assert fidelity_rich(result).row_count == len(FIDELITY_METRICS)


def test_with_three_noise_runs_the_floor_is_the_largest_error_against_the_first():
    # against X: Y is +5 % / -2 %, Z is -10 % / +3 %; Y against Z (+16.7 %) is not a pair the floor looks at
    x, y, z = (REF, {**REF, "median_ttft_ms": 21.0, "p99_ttft_ms": 98.0},
               {**REF, "median_ttft_ms": 18.0, "p99_ttft_ms": 103.0})
    run = {**REF, "median_ttft_ms": 22.0, "p99_ttft_ms": 112.0}  # +10 % and +12 %
    tol = {"median_ttft_ms": 5, "p99_ttft_ms": 5}
    result = evaluate_fidelity({"h": REF, "m": run}, noise=(x, y, z), tolerances=tol, noise_labels=("h", "h2", "h3"))
    median, p99 = result.cell("median_ttft_ms", "m"), result.cell("p99_ttft_ms", "m")
    assert median.noise_pct == pytest.approx(10.0) and median.verdict is FidelityVerdict.WITHIN
    assert p99.noise_pct == pytest.approx(3.0) and p99.allowed_pct == 5 and p99.verdict is FidelityVerdict.BEYOND
    assert result.noise_runs == ("h", "h2", "h3")
    # the first two alone give the old two-run floor
    assert evaluate_fidelity({"h": REF, "m": run}, noise=(x, y)).cell("median_ttft_ms", "m").noise_pct == \
        pytest.approx(5.0)


def test_a_metric_one_noise_run_lacks_has_no_floor():
    noise = (REF, {**REF, "median_ttft_ms": 30.0}, {k: v for k, v in REF.items() if k != "median_ttft_ms"})
    result = evaluate_fidelity({"h": REF, "m": REF}, noise=noise)
    assert result.cell("median_ttft_ms", "m").noise_pct is None
    assert result.cell("p99_ttft_ms", "m").noise_pct == 0.0


def test_a_run_of_several_copies_is_judged_by_their_median_with_their_range():
    copies = [{**REF, "median_ttft_ms": v, "p99_ttft_ms": p} for v, p in ((18.0, 100.0), (23.0, 130.0), (21.0, 99.0))]
    result = evaluate_fidelity({"live": REF, "model": copies, "one": {**REF, "median_ttft_ms": 22.0}},
                               tolerances={"median_ttft_ms": 5, "p99_ttft_ms": 10})
    median = result.cell("median_ttft_ms", "model")
    assert median.value == 21.0 and median.error_pct == pytest.approx(5.0) and median.copies == 3
    assert median.spread_pct == pytest.approx((-10.0, 15.0)) and median.verdict is FidelityVerdict.WITHIN
    # one draw at +30 % does not fail the median (+0 %), and the range says it happened
    p99 = result.cell("p99_ttft_ms", "model")
    assert p99.error_pct == 0.0 and p99.spread_pct == pytest.approx((-1.0, 30.0))
    assert p99.verdict is FidelityVerdict.WITHIN
    assert result.cell("median_ttft_ms", "one").copies == 1 and result.cell("median_ttft_ms", "one").spread_pct is None
    assert "+5.0% [-10.0..+15.0]" in fidelity_markdown(result)
    # a metric one copy lacks has no range and no median: a checked one fails
    lacking = evaluate_fidelity({"live": REF, "model": [REF, {"median_ttft_ms": 20.0}]}, tolerances={"p99_ttft_ms": 10})
    assert lacking.cell("p99_ttft_ms", "model").verdict is FidelityVerdict.NO_DATA


def test_copies_are_refused_for_the_reference_and_when_empty():
    with pytest.raises(FidelityError, match="the reference 'live' is one run, not 2 copies"):
        evaluate_fidelity({"live": [REF, REF], "model": REF})
    with pytest.raises(FidelityError, match="'model' has no copies"):
        evaluate_fidelity({"live": REF, "model": []})


def test_a_bad_noise_set_is_refused():
    with pytest.raises(FidelityError, match="at least two same-seed runs, got 1"):
        evaluate_fidelity({"a": REF, "b": REF}, noise=(REF,))
    with pytest.raises(FidelityError, match="2 noise labels for 3 noise runs"):
        evaluate_fidelity({"a": REF, "b": REF}, noise=(REF, REF, REF), noise_labels=("a", "b"))


def test_tolerances_are_checked_and_extra_metrics_become_rows():
    with pytest.raises(GateError, match="did you mean p99_ttft_ms"):
        evaluate_fidelity({"a": REF, "b": REF}, tolerances={"p99_tft_ms": 5})
    result = evaluate_fidelity({"a": {**REF, "cache_hit_rate": 0.5}, "b": {**REF, "cache_hit_rate": 0.4}},
                               tolerances={"cache_hit_rate": 10})
    assert result.metrics[-1] == "cache_hit_rate"
    assert result.cell("cache_hit_rate", "b").verdict is FidelityVerdict.BEYOND
    with pytest.raises(FidelityError, match="at least two runs"):
        evaluate_fidelity({"a": REF})
    assert set(ACCEPTANCE_TOLERANCES) <= set(FIDELITY_METRICS)


def _with_trace(run, request_lines):
    header = json.dumps({"type": "header", "format_version": 2, "seed": run.config["seed"]}) + "\n"
    (run.folder / "workload.trace.jsonl").write_text(header + "".join(f"{line}\n" for line in request_lines))
    return run


def test_workloads_compare_by_their_requests_not_the_trace_header(tmp_path):
    a = _with_trace(write_synthetic_run(tmp_path / "a", seed=0), ['{"id":1}', '{"id":2}'])
    b = _with_trace(write_synthetic_run(tmp_path / "b", seed=1), ['{"id":1}', '{"id":2}'])  # other header
    c = _with_trace(write_synthetic_run(tmp_path / "c", seed=0), ['{"id":1}', '{"id":3}'])
    assert workload_identity(a) == workload_identity(b)
    check_same_workload({"a": a, "b": b})
    with pytest.raises(FidelityError, match=r"c has a different workload from .*a \(compared by the requests"):
        check_same_workload({"a": a, "b": b, "c": c})


def test_without_traces_workloads_compare_by_config_section(tmp_path):
    runs = {}
    for name, rate in (("a", 10.0), ("b", 10.0), ("c", 20.0)):
        run = write_synthetic_run(tmp_path / name)
        runs[name] = type(run)(run.folder, {"workload": {"num_requests": 60, "arrival": {"rate": rate}}},
                               run.summary, (run.requests, run.steps))
    check_same_workload({"a": runs["a"], "b": runs["b"]})
    with pytest.raises(FidelityError, match="workload section of config.yaml"):
        check_same_workload(runs)


def test_write_fidelity_has_markdown_csv_and_overlaid_cdfs(tmp_path):
    runs = {name: write_synthetic_run(tmp_path / name, seed=i) for i, name in enumerate(["hybrid", "model"])}
    noise = {"hybrid": runs["hybrid"], "hybrid-b": write_synthetic_run(tmp_path / "hybrid-b", seed=2)}
    result = evaluate_fidelity({k: r.summary for k, r in runs.items()}, (runs["hybrid"].summary,
                               noise["hybrid-b"].summary), ACCEPTANCE_TOLERANCES, ("hybrid", "hybrid-b"))
    md = write_fidelity(runs, result, tmp_path / "fid", noise)
    text = md.read_text()
    assert "| metric | hybrid | model | model error | noise | bar |" in text
    assert "`hybrid` and `hybrid-b` (same seed)" in text
    # synthetic summaries: request_throughput 20 / 21 / 22, so +5.0 % against a 10.0 % noise floor
    assert "| request_throughput | 20 | 21 | +5.0% | 10.0% | 10.0% (noise) |" in text
    frame = pd.read_csv(tmp_path / "fid" / "fidelity.csv")
    row = frame[frame["metric"] == "request_throughput"].iloc[0]
    assert row["run"] == "model" and row["error_pct"] == pytest.approx(5.0) and row["verdict"] == "within"
    assert math.isnan(frame[frame["metric"] == "mask_share"].iloc[0]["value"])
    for name in ("ttft", "tpot", "e2el"):
        assert (tmp_path / "fid" / "plots" / f"{name}_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_write_fidelity_names_every_noise_run_and_the_one_they_are_measured_against(tmp_path):
    runs = {name: write_synthetic_run(tmp_path / name, seed=i) for i, name in enumerate(["hybrid", "model"])}
    noise = {"hybrid": runs["hybrid"], **{name: write_synthetic_run(tmp_path / name, seed=i)
                                          for i, name in ((2, "hybrid-b"), (3, "hybrid-c"))}}
    result = evaluate_fidelity({k: r.summary for k, r in runs.items()}, [r.summary for r in noise.values()],
                               ACCEPTANCE_TOLERANCES, tuple(noise))
    text = write_fidelity(runs, result, tmp_path / "fid", noise).read_text()
    assert "the largest |relative error| of `hybrid-b`, `hybrid-c` against `hybrid` (same seed)" in text
    # request_throughput 20 / 22 / 23: the floor is the +15 % of hybrid-c, not hybrid-b's +10 %
    assert "| request_throughput | 20 | 21 | +5.0% | 15.0% | 15.0% (noise) |" in text


# ----------------------------------------------------------------------------- error intervals


def _latency_rows(ttft_s, output_tokens=None, aborted=None) -> pd.DataFrame:
    n = len(ttft_s)
    out = np.full(n, 11) if output_tokens is None else np.asarray(output_tokens)
    first = np.asarray(ttft_s, float)
    return pd.DataFrame({"request_id": np.arange(n), "issued_s": np.zeros(n), "first_token_s": first,
                         "finish_s": first + 0.02 * (out - 1), "output_tokens": out,
                         "abort_reason": aborted if aborted is not None else [""] * n})


def _summarized(seed: int, n: int = 200):
    requests, steps = synthetic_frames(seed, n=n)
    summary = summarize(requests, steps, LogHistogram(), LogHistogram())
    return requests, {k: getattr(summary, k) for k in RESOLVED_FIGURES}


def test_interval_errors_are_the_summaries_own_and_bracket_them():
    ref, ref_summary = _summarized(3)
    run, run_summary = _summarized(4)  # another draw of timings for the same request ids
    intervals = error_intervals(ref, [run])
    assert set(intervals) == set(RESOLVED_FIGURES)
    for name, interval in intervals.items():
        assert interval.error_pct == pytest.approx(relative_error_pct(ref_summary[name], run_summary[name])), name
        assert interval.low_pct <= interval.error_pct <= interval.high_pct and interval.samples == 200


def test_copies_are_judged_by_the_median_of_their_figures_in_every_draw_too():
    ref, ref_summary = _summarized(3)
    copies = [_summarized(seed) for seed in (4, 5, 6)]
    median = {k: float(np.median([summary[k] for _, summary in copies])) for k in RESOLVED_FIGURES}
    intervals = error_intervals(ref, [frame for frame, _ in copies])
    for name in RESOLVED_FIGURES:
        assert intervals[name].error_pct == pytest.approx(relative_error_pct(ref_summary[name], median[name]))


def test_a_run_identical_to_the_reference_has_no_spread_and_a_scaled_one_a_fixed_error():
    ref = _latency_rows(np.random.default_rng(0).lognormal(-3, 1, 150))
    same = error_intervals(ref, [ref])["p99_ttft_ms"]
    assert (same.error_pct, same.low_pct, same.high_pct) == (0.0, 0.0, 0.0)
    scaled = ref.assign(first_token_s=ref["first_token_s"] * 1.5, finish_s=ref["finish_s"] * 1.5)
    tail = error_intervals(ref, [scaled])["p99_ttft_ms"]
    assert tail.error_pct == pytest.approx(50.0) and tail.low_pct == pytest.approx(50.0)
    assert tail.high_pct == pytest.approx(50.0)


def test_pairing_leaves_out_requests_a_run_did_not_complete():
    ref = _latency_rows([0.1, 0.2, 0.3, 0.4, 5.0], output_tokens=[1, 5, 5, 5, 5])
    run = _latency_rows([0.1, 0.2, 0.3, 0.4, 5.0], output_tokens=[1, 5, 5, 5, 5],
                        aborted=["", "", "", "", "timeout"])
    intervals = error_intervals(ref, [run], resamples=100)
    # the run lost its longest TTFT: its p99 falls; TPOT of the single-token request is no value in either
    assert intervals["p99_ttft_ms"].error_pct < -50.0 and intervals["p99_ttft_ms"].samples == 5


def test_runs_of_other_requests_are_refused():
    ref = _latency_rows([0.1, 0.2, 0.3])
    with pytest.raises(ResolutionError, match="not the same workload"):
        error_intervals(ref, [ref.assign(request_id=[0, 1, 7])])


def test_intervals_are_reproducible_for_a_seed():
    rng = np.random.default_rng(0)
    ref, run = (_latency_rows(rng.lognormal(-3, 1, 300)) for _ in range(2))
    assert error_intervals(ref, [run], seed=4) == error_intervals(ref, [run], seed=4)
    assert error_intervals(ref, [run], seed=4)["p99_ttft_ms"] != error_intervals(ref, [run], seed=5)["p99_ttft_ms"]


def test_more_requests_resolve_a_tail_error_more_finely():
    rng = np.random.default_rng(1)

    def width(n: int) -> float:
        base = rng.lognormal(-3, 1, n)
        noisy = _latency_rows(base * rng.lognormal(0, 0.3, n))
        interval = error_intervals(_latency_rows(base), [noisy])["p99_ttft_ms"]
        return interval.high_pct - interval.low_pct

    assert width(5000) < 0.5 * width(150)


def test_the_interval_is_as_wide_as_the_error_varies_between_workloads():
    # a model that prices each request's TTFT 20 % low with lognormal noise: 200-request workloads drawn from
    # one population give errors of p90 TTFT that spread; each workload's own interval should cover the
    # population's error about 95 % of the time and be about as wide as that spread (the percentile bootstrap
    # of a quantile is a little conservative: measured, about 1.2 times)
    rng = np.random.default_rng(2)

    def workload(n: int) -> tuple[pd.DataFrame, list[pd.DataFrame]]:
        ttft = rng.exponential(0.1, n)
        return _latency_rows(ttft), [_latency_rows(ttft * 0.8 * rng.lognormal(0, 0.2, n))]

    truth = error_intervals(*workload(200_000), resamples=2)["p90_ttft_ms"].error_pct
    intervals = [error_intervals(*workload(200), resamples=300, seed=i)["p90_ttft_ms"] for i in range(120)]
    covered = np.mean([i.low_pct <= truth <= i.high_pct for i in intervals])
    spread = 3.92 * np.std([i.error_pct for i in intervals])  # a normal 95 % width of the errors themselves
    width = np.mean([i.high_pct - i.low_pct for i in intervals])
    assert covered >= 0.9 and 0.8 * spread <= width <= 1.5 * spread


def test_requests_to_resolve_scales_with_the_square_of_the_side_toward_the_bar():
    interval = ErrorInterval("p99_ttft_ms", 15.0, 6.0, 30.0, 150)
    assert interval.reaches(10.0) and not interval.reaches(5.0)
    assert interval.requests_to_resolve(10.0) == math.ceil(150 * (9.0 / 5.0) ** 2)
    assert interval.requests_to_resolve(5.0) is None  # clear of the bar already
    assert interval.requests_to_resolve(20.0) is None  # the error itself is within it
    low = ErrorInterval("p99_ttft_ms", -20.0, -45.0, -4.0, 200)
    assert low.requests_to_resolve(10.0) == math.ceil(200 * (16.0 / 10.0) ** 2)
    edge = ErrorInterval("p99_tpot_ms", -20.4, -50.3, 7.8, 600)  # 0.1 past a 20.3 bar: no run size settles it
    assert edge.reaches(20.3) and edge.requests_to_resolve(20.3) is None


def test_an_error_beyond_its_bar_whose_interval_reaches_the_bar_is_unresolved_and_still_fails():
    intervals = {"near": {"p99_ttft_ms": ErrorInterval("p99_ttft_ms", 15.0, 6.0, 30.0, 150)},
                 "far": {"p99_ttft_ms": ErrorInterval("p99_ttft_ms", 35.0, 20.0, 50.0, 150)},
                 "close": {"p99_ttft_ms": ErrorInterval("p99_ttft_ms", 5.0, -3.0, 12.0, 150)}}
    result = evaluate_fidelity({"hybrid": REF, "near": {**REF, "p99_ttft_ms": 115.0},
                                "far": {**REF, "p99_ttft_ms": 135.0}, "close": {**REF, "p99_ttft_ms": 105.0}},
                               tolerances=ACCEPTANCE_TOLERANCES, intervals=intervals)
    near, far, close = (result.cell("p99_ttft_ms", run) for run in ("near", "far", "close"))
    assert near.verdict is FidelityVerdict.BEYOND and near.unresolved and near.requests_to_resolve == 487
    assert far.verdict is FidelityVerdict.BEYOND and not far.unresolved and far.requests_to_resolve is None
    assert close.verdict is FidelityVerdict.WITHIN and not close.unresolved
    assert not result.passed and result.unresolved == (near,)
    assert result.cell("median_ttft_ms", "near").interval is None
    assert "1 of them unresolved" in verdict_line(result)
    assert "**+15.0%** (unresolved: +6.0..+30.0, ~487 requests)" in fidelity_markdown(result)
    row = fidelity_frame(result).set_index(["metric", "run"]).loc[("p99_ttft_ms", "near")]
    assert bool(row["unresolved"]) and row["requests_to_resolve"] == 487
    assert row["interval_low_pct"] == 6.0 and row["interval_high_pct"] == 30.0


def test_paired_intervals_need_both_runs_requests(tmp_path):
    runs = {name: write_synthetic_run(tmp_path / name, seed=i) for i, name in enumerate(["hybrid", "model", "other"])}
    intervals = paired_intervals(runs)
    assert set(intervals) == {"model", "other"} and set(intervals["model"]) == set(RESOLVED_FIGURES)
    (tmp_path / "model" / "requests.parquet").unlink()
    unsaved = SavedRun(tmp_path / "model", runs["model"].config, runs["model"].summary)
    assert set(paired_intervals({**runs, "model": unsaved})) == {"other"}
    copies = paired_intervals({"hybrid": runs["hybrid"], "model": [runs["other"], runs["hybrid"]]})
    assert set(copies["model"]) == set(RESOLVED_FIGURES)


def test_the_modules_examples_hold():
    import doctest

    from cdbench.reports import fidelity
    from cdbench.results import resolution

    assert doctest.testmod(fidelity).failed == 0 and doctest.testmod(resolution).failed == 0


# ----------------------------------------------------------------------------- ITL rebuilt from the steps


def _decoding_run(gap_s: float, n: int = 40, tokens: int = 12, slow_every: int = 0, slow_s: float = 0.0):
    """Requests decoding together from t = 0, one token a step: a step log of equal steps (every
    ``slow_every``-th one ``slow_s`` long), each request's first token at the first step's end."""
    durations = np.full(tokens, gap_s)
    if slow_every:
        durations[slow_every - 1::slow_every] = slow_s
    ends = np.cumsum(durations)
    steps = pd.DataFrame({"start_s": ends - durations, "duration_s": durations, "decode_rows": n})
    requests = pd.DataFrame({"request_id": np.arange(n), "issued_s": 0.0, "first_token_s": ends[0],
                             "finish_s": ends[-1], "output_tokens": tokens, "abort_reason": ""})
    gaps = np.repeat(durations[1:], n) * 1e3
    summary = {f: float(v) for f, v in zip(ITL_FIGURES, np.percentile(gaps, [50, 90, 99]))}
    return requests, steps, summary


def test_token_gaps_are_rebuilt_from_the_steps_each_request_its_own():
    requests, steps, _ = _decoding_run(0.01, n=3, tokens=5)
    requests.loc[2, "first_token_s"] = steps["start_s"][2] + 0.01  # joined two steps late
    gaps, owner = token_gaps(requests, steps, pd.Index(requests["request_id"]))
    assert list(np.bincount(owner)) == [4, 4, 2]
    assert gaps == pytest.approx(np.full(10, 10.0))


def test_itl_intervals_pair_the_rebuilt_gaps_and_judge_the_runs_own_error():
    ref = _decoding_run(0.010, slow_every=4, slow_s=0.05)
    run = _decoding_run(0.011, slow_every=4, slow_s=0.05)
    intervals = itl_error_intervals(ref, [run])
    assert set(intervals) == set(ITL_FIGURES)
    median = intervals["median_itl_ms"]
    assert median.error_pct == pytest.approx(10.0) and median.low_pct == pytest.approx(10.0)
    assert median.high_pct == pytest.approx(10.0)  # every request decodes in the same steps: no spread
    shifted = itl_error_intervals(ref, [(run[0], run[1], {**run[2], "median_itl_ms": run[2]["median_itl_ms"] * 1.01})])
    assert shifted["median_itl_ms"].error_pct == pytest.approx(11.1)  # the runs' own figures, not the rebuilt ones


def test_itl_intervals_need_gaps_that_give_the_runs_own_figures():
    ref, run = _decoding_run(0.010), _decoding_run(0.011)
    assert itl_error_intervals(ref, [(run[0], run[1], {**run[2], "p99_itl_ms": run[2]["p99_itl_ms"] * 1.05})]) == {}
    assert set(itl_error_intervals(ref, [(run[0], run[1], {**run[2], "p99_itl_ms": run[2]["p99_itl_ms"] * 1.01})]))


def test_weighted_figures_are_the_percentiles_of_the_repeated_gaps():
    rng = np.random.default_rng(3)
    gaps = np.sort(rng.lognormal(0, 1, 50))
    weights = rng.integers(0, 4, (5, 50))
    expected = [np.percentile(np.repeat(gaps, w), [50, 90, 99]) for w in weights]
    assert _weighted_figures(gaps, weights) == pytest.approx(np.array(expected))


def _one_at_a_time(slow: set[int], n: int = 200, tokens: int = 40):
    """``n`` requests decoding one after another, each alone: 10-ms steps, 80-ms ones for the ``slow`` requests."""
    frames, steps = [], []
    for i in range(n):
        durations = np.full(tokens, 0.08 if i in slow else 0.01)
        ends = i * 5.0 + np.cumsum(durations)
        steps.append(pd.DataFrame({"start_s": ends - durations, "duration_s": durations, "decode_rows": 1}))
        frames.append({"request_id": i, "issued_s": i * 5.0, "first_token_s": ends[0], "finish_s": ends[-1],
                       "output_tokens": tokens, "abort_reason": ""})
    requests, log = pd.DataFrame(frames), pd.concat(steps, ignore_index=True)
    gaps, _ = token_gaps(requests, log, pd.Index(requests["request_id"]))
    return requests, log, {f: float(v) for f, v in zip(ITL_FIGURES, np.percentile(gaps, [50, 90, 99]))}


def test_an_itl_tail_set_by_other_requests_in_each_run_is_not_resolved():
    # four slow requests of 200 in each run (2 % of the gaps: the p99 sits on them), the same ones or others
    ref = _one_at_a_time({0, 50, 100, 150})
    same, other = _one_at_a_time({0, 50, 100, 150}), _one_at_a_time({1, 51, 101, 151})
    assert ref[2] == other[2]  # the runs' own figures agree either way
    paired = itl_error_intervals(ref, [same])["p99_itl_ms"]
    assert (paired.error_pct, paired.low_pct, paired.high_pct) == (0.0, 0.0, 0.0)
    crossed = itl_error_intervals(ref, [other])["p99_itl_ms"]
    assert crossed.error_pct == 0.0 and crossed.low_pct < -50.0 and crossed.high_pct > 100.0


def test_the_draws_do_not_depend_on_how_they_are_chunked(monkeypatch):
    from cdbench.results import resolution

    rng = np.random.default_rng(5)
    ref, run = (_latency_rows(rng.lognormal(-3, 1, 120)) for _ in range(2))
    slow, other = _one_at_a_time({0, 50}, n=120), _one_at_a_time({1, 51}, n=120)
    whole = error_intervals(ref, [run], resamples=60), itl_error_intervals(slow, [other], resamples=60)
    monkeypatch.setattr(resolution, "_CHUNK_VALUES", 500)  # four draws of 120 requests a chunk
    assert (error_intervals(ref, [run], resamples=60), itl_error_intervals(slow, [other], resamples=60)) == whole


def test_no_requests_give_no_intervals_and_too_many_gaps_no_itl_interval(monkeypatch):
    from cdbench.results import resolution

    empty = _latency_rows([])
    assert error_intervals(empty, [empty]) == {} and itl_error_intervals((empty, pd.DataFrame(
        {"start_s": [], "duration_s": [], "decode_rows": []}), {}), []) == {}
    slow = _one_at_a_time({0}, n=20)
    assert itl_error_intervals(slow, [slow])
    monkeypatch.setattr(resolution, "MAX_GAPS", 100)  # 20 requests of 40 tokens
    assert itl_error_intervals(slow, [slow]) == {}
