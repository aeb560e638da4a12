import pandas as pd

from cdbench.reports.sweep_report import sweep_rich, write_sweep_report


def test_sweep_report_draws_one_curve_per_other_parameter(tmp_path):
    table = pd.DataFrame({
        "rate": [1, 2, 4, 1, 2, 4, 8],
        "name": ["xgrammar"] * 3 + ["llguidance"] * 4,
        "point": [f"p{i}" for i in range(7)],
        "status": ["done"] * 6 + ["failed"],
        "request_throughput": [1.0, 2.0, 3.5, 1.0, 1.9, 3.0, None],
        "p99_ttft_ms": [10.0, 12.0, 30.0, 11.0, 15.0, 60.0, None],
        "output_throughput": [100.0, 200, 350, 100, 190, 300, None],
        "mean_tpot_ms": [5.0, 5.5, 7, 5, 6, 9, None],
        "error": [None] * 6 + ["ConfigError: boom"],
    })
    md = write_sweep_report("demo", ["rate", "name"], table, tmp_path)
    text = md.read_text()
    assert "| rate | name | status | request_throughput |" in text
    assert "- `p6` failed: ConfigError: boom" in text
    assert (tmp_path / "plots" / "p99_ttft_ms_vs_request_throughput.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "plots" / "mean_tpot_ms_vs_output_throughput.png").is_file()
    assert pd.read_csv(tmp_path / "sweep.csv").shape == (7, 9)
    assert sweep_rich(table, ["rate", "name"]).row_count == 7


def test_console_table_fits_140_columns_without_cutting_values():
    from rich.console import Console

    n = 8
    table = pd.DataFrame({
        "rate": [10, 20, 40, 80] * 2,
        "policy.name": ["sglang"] * 4 + ["vllm"] * 4,
        "backend.name": ["xgrammar"] * n,  # the same for every point: goes to the title
        "compile_threads": [1, 2] * 4,
        "corpus": ['["embedded", "regex_from_json_schemas", "jsonschemabench_github"]'] * 4 + ['["embedded"]'] * 4,
        "point": [f"p{i}" for i in range(n)],
        "status": ["done"] * n,
        **{m: [123456.7] * n for m in ("request_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                                       "p99_tpot_ms")},
        "failed": [0] * n,
    })
    console = Console(width=140, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(sweep_rich(table, ["rate", "policy.name", "backend.name", "compile_threads", "corpus"]))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 140
    assert "…" not in text
    assert "same for every point: backend.name=xgrammar" in text and "│ xgrammar" not in text
    assert "jsonschemabench_github" in text.replace("\n", "").replace("│", "").replace(" ", "")
    assert "request_" in text and "throughput" in text and text.count("1.235e+05") == 5 * n
