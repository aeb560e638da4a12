import pytest
from synthetic_run import write_synthetic_run

from cdbench.reports.run_report import build_report, request_latencies_ms
from cdbench.results.run_folder import ResultsError, load_run


def test_report_has_tables_every_plot_and_the_config(synthetic_run):
    path = build_report(synthetic_run)
    text = path.read_text()
    assert "| TTFT | 30 | 25 | 90 |" in text
    assert "```yaml\nmode: model" in text
    for name in ("ttft_cdf", "tpot_cdf", "step_breakdown", "overlap", "compile_time", "mask_time", "rollback", "rank_skew"):
        png = synthetic_run.folder / "plots" / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG", name
        assert f"](plots/{name}.png)" in text


def test_plots_without_data_are_explained_not_drawn(tmp_path):
    run = write_synthetic_run(tmp_path / "plain", ranks_skew=False, drafts=False)
    text = build_report(run).read_text()
    assert "no speculative decoding" in text and "a single rank" in text
    assert not (run.folder / "plots" / "rollback.png").exists()


def test_latencies_follow_vllm_definitions(synthetic_run):
    lat = request_latencies_ms(synthetic_run.requests)
    r = synthetic_run.requests.iloc[0]
    ttft = (r.first_token_s - r.issued_s) * 1e3
    e2el = (r.finish_s - r.issued_s) * 1e3
    assert lat["ttft_ms"].iloc[0] == pytest.approx(ttft)
    if r.output_tokens > 1:
        assert lat["tpot_ms"].iloc[0] == pytest.approx((e2el - ttft) / (r.output_tokens - 1))


def test_load_run_round_trip_and_errors(synthetic_run, tmp_path):
    loaded = load_run(synthetic_run.folder)
    assert loaded.summary == synthetic_run.summary
    assert loaded.requests.shape == synthetic_run.requests.shape
    with pytest.raises(ResultsError, match="not a cdbench run folder"):
        load_run(tmp_path / "nothing")
    (synthetic_run.folder / "steps.parquet").unlink()
    with pytest.raises(ResultsError, match="steps.parquet is missing"):
        load_run(synthetic_run.folder)
