import json
import math
from pathlib import Path

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
    reference_resolution,
    relative_error_pct,
    verdict_line,
    workload_identity,
    write_fidelity,
)
from cdbench.reports.gate import GateError
from cdbench.results.resolution import RESOLVED_FIGURES, Resolution, request_resolution
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


# ----------------------------------------------------------------------------- request resolution


def _latency_rows(ttft_s, output_tokens=None, aborted=None) -> pd.DataFrame:
    n = len(ttft_s)
    out = np.full(n, 11) if output_tokens is None else np.asarray(output_tokens)
    first = np.asarray(ttft_s, float)
    return pd.DataFrame({"issued_s": np.zeros(n), "first_token_s": first, "finish_s": first + 0.01 * (out - 1) * 2,
                         "output_tokens": out, "abort_reason": aborted if aborted is not None else [""] * n})


def test_resolution_figures_are_the_summarys_own():
    run = write_synthetic_run_with_summary()
    bands = request_resolution(run.requests)
    assert set(bands) == set(RESOLVED_FIGURES)
    for name, band in bands.items():
        assert band.value == pytest.approx(run.summary[name], rel=1e-12), name
        assert band.low_pct <= 0.0 <= band.high_pct


def write_synthetic_run_with_summary() -> SavedRun:
    """A synthetic run's frames with the summary :func:`summarize` computes from them."""
    requests, steps = synthetic_frames(3, n=200)
    summary = summarize(requests, steps, LogHistogram(), LogHistogram())
    return SavedRun(Path("unsaved"), {}, {k: getattr(summary, k) for k in RESOLVED_FIGURES}, (requests, steps))


def test_resolution_leaves_out_aborted_requests_and_single_token_tpots():
    rows = _latency_rows([0.1, 0.2, 0.3, 0.4, 5.0], output_tokens=[1, 5, 5, 5, 5], aborted=["", "", "", "", "timeout"])
    bands = request_resolution(rows, resamples=50)
    assert bands["p99_ttft_ms"].samples == 4 and bands["p99_ttft_ms"].value < 400.0
    assert bands["median_tpot_ms"].samples == 3  # the first has one output token


def test_resolution_is_reproducible_for_a_seed():
    rows = _latency_rows(np.random.default_rng(0).lognormal(-3, 1, 300))
    assert request_resolution(rows, seed=4) == request_resolution(rows, seed=4)
    assert request_resolution(rows, seed=4)["p99_ttft_ms"] != request_resolution(rows, seed=5)["p99_ttft_ms"]


def test_a_longer_run_resolves_its_tail_more_finely():
    rng = np.random.default_rng(1)
    short, long = (request_resolution(_latency_rows(rng.lognormal(-3, 1, n)))["p99_ttft_ms"] for n in (150, 5000))
    assert long.high_pct - long.low_pct < 0.5 * (short.high_pct - short.low_pct)


def test_the_interval_covers_the_workloads_own_quantile_about_as_often_as_its_level():
    # exponential TTFTs of mean 0.1 s: the population's p90 is 0.1 * ln 10 s
    rng = np.random.default_rng(2)
    truth_ms = 100.0 * math.log(10.0)
    trials = 150
    covered = 0
    for i in range(trials):
        band = request_resolution(_latency_rows(rng.exponential(0.1, 200)), resamples=300, seed=i)["p90_ttft_ms"]
        covered += band.holds((truth_ms - band.value) / band.value * 100.0)
    assert 0.85 <= covered / trials <= 0.99


def test_requests_to_resolve_scales_with_the_square_of_the_sides_width():
    band = Resolution("p99_ttft_ms", 100.0, -12.0, 30.0, 150)
    assert band.requests_to_resolve(+15.0, 10.0) == math.ceil(150 * 3.0 ** 2)
    assert band.requests_to_resolve(-11.0, 10.0) == math.ceil(150 * 1.2 ** 2)
    assert band.requests_to_resolve(-11.0, 12.0) is None  # that side is already within the bar


def test_an_error_beyond_its_bar_inside_the_references_band_is_unresolved_and_still_fails():
    bands = {"p99_ttft_ms": Resolution("p99_ttft_ms", 100.0, -12.0, 30.0, 150)}
    result = evaluate_fidelity({"hybrid": REF, "inside": {**REF, "p99_ttft_ms": 115.0},
                                "outside": {**REF, "p99_ttft_ms": 135.0}, "close": {**REF, "p99_ttft_ms": 105.0}},
                               tolerances=ACCEPTANCE_TOLERANCES, resolution=bands)
    inside, outside, close = (result.cell("p99_ttft_ms", run) for run in ("inside", "outside", "close"))
    assert inside.verdict is FidelityVerdict.BEYOND and inside.unresolved and inside.requests_to_resolve == 1350
    assert outside.verdict is FidelityVerdict.BEYOND and not outside.unresolved and outside.requests_to_resolve is None
    assert close.verdict is FidelityVerdict.WITHIN and not close.unresolved
    assert not result.passed and result.unresolved == (inside,)
    assert result.cell("median_ttft_ms", "inside").resolution is None
    assert "1 of them inside the reference's own 95 % band" in verdict_line(result)
    text = fidelity_markdown(result)
    assert "**+15.0%** (unresolved: ~1,350 requests)" in text and "| -12.0..+30.0 |" in text
    frame_row = fidelity_frame(result).set_index(["metric", "run"]).loc[("p99_ttft_ms", "inside")]
    assert bool(frame_row["unresolved"]) and frame_row["requests_to_resolve"] == 1350
    assert frame_row["resolution_low_pct"] == -12.0 and frame_row["resolution_high_pct"] == 30.0


def test_reference_resolution_reads_the_runs_requests_or_gives_none(tmp_path):
    run = write_synthetic_run(tmp_path / "a")
    assert set(reference_resolution(run)) == set(RESOLVED_FIGURES)
    (tmp_path / "a" / "requests.parquet").unlink()
    assert reference_resolution(SavedRun(tmp_path / "a", run.config, run.summary)) is None
