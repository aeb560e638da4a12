import math

from cdbench.reports.compare import (
    comparison_markdown,
    comparison_rich,
    comparison_table,
)


def test_columns_per_run_and_ratios_to_the_first():
    table = comparison_table({
        "a": {"mean_ttft_ms": 10.0, "request_throughput": 4.0, "abort_rate": 0.0, "backend": "x"},
        "b": {"mean_ttft_ms": 20.0, "request_throughput": 2.0, "abort_rate": 0.1},
        "c": {"mean_ttft_ms": 5.0},
    })
    assert list(table.columns) == ["a", "b", "c", "b / a", "c / a"]
    assert list(table.index) == ["request_throughput", "mean_ttft_ms", "abort_rate"]
    assert table.loc["mean_ttft_ms", "b / a"] == 2.0
    assert table.loc["mean_ttft_ms", "c / a"] == 0.5
    assert math.isnan(table.loc["abort_rate", "b / a"])  # first run 0: no ratio
    assert math.isnan(table.loc["request_throughput", "c"])
    markdown = comparison_markdown(table, 3)
    assert "| mean_ttft_ms | 10 | 20 | 5 | 2.000x | 0.500x |" in markdown
    assert comparison_rich(table, 3).row_count == 3



def test_write_comparison_has_table_and_overlaid_cdfs(tmp_path):
    from synthetic_run import write_synthetic_run

    from cdbench.reports.compare import write_comparison

    runs = {name: write_synthetic_run(tmp_path / name, seed=i) for i, name in enumerate(["xgrammar", "llguidance"])}
    md = write_comparison(runs, tmp_path / "cmp")
    text = md.read_text()
    assert "| metric | xgrammar | llguidance | llguidance / xgrammar |" in text
    assert "| request_throughput | 20 | 21 | 1.050x |" in text
    for name in ("ttft", "tpot", "e2el"):
        assert (tmp_path / "cmp" / "plots" / f"{name}_cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "cmp" / "comparison.csv").is_file()
