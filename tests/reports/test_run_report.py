import pandas as pd
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


def test_report_of_tables_on_disk_reads_them_a_slice_at_a_time(synthetic_run, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cdbench.results import run_folder
    from cdbench.results.run_folder import SavedRun

    monkeypatch.setattr(run_folder, "READ_ROWS", 10)
    for name in ("requests", "steps"):  # several row groups, as a streamed run's joined tables have
        pq.write_table(pa.Table.from_pandas(getattr(synthetic_run, name), preserve_index=False),
                       synthetic_run.folder / f"{name}.parquet", row_group_size=7)
    on_disk = SavedRun(synthetic_run.folder, synthetic_run.config, synthetic_run.summary)
    chunks = list(on_disk.chunks("steps", ("start_s",)))
    assert len(chunks) > 1 and sum(map(len, chunks)) == len(synthetic_run.steps)
    assert "steps" not in on_disk.__dict__  # never read whole
    text = build_report(on_disk).read_text()
    assert "steps" not in on_disk.__dict__ and "requests" not in on_disk.__dict__
    for name in ("ttft_cdf", "tpot_cdf", "step_breakdown", "compile_time", "mask_time", "rank_skew"):
        assert f"](plots/{name}.png)" in text
    assert on_disk.has_tables and on_disk.requests.shape == synthetic_run.requests.shape  # read when asked


def test_a_row_group_is_read_in_slices_no_longer_than_read_rows(synthetic_run, monkeypatch):
    """The report holds at most READ_ROWS rows of a table at a time, whatever the row groups' size, and the
    slices give the table's rows in order, their values and dtypes (categories too) as read whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cdbench.results import run_folder
    from cdbench.results.run_folder import SavedRun

    monkeypatch.setattr(run_folder, "READ_ROWS", 5)
    steps = synthetic_run.steps
    pq.write_table(pa.Table.from_pandas(steps, preserve_index=False), synthetic_run.folder / "steps.parquet",
                   row_group_size=12)
    assert len(steps) > 12
    on_disk = SavedRun(synthetic_run.folder, synthetic_run.config, synthetic_run.summary)
    columns = ["kind", "start_s", "duration_s"]
    chunks = list(on_disk.chunks("steps", columns))
    assert max(map(len, chunks)) == 5
    pd.testing.assert_frame_equal(pd.concat(chunks, ignore_index=True), steps[columns].reset_index(drop=True))
