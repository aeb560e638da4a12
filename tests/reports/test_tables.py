from cdbench.reports.tables import format_value, summary_sections, to_markdown, to_rich


def test_latency_grid_orders_statistics_and_metrics():
    summary = {
        "p99_tpot_ms": 9.0, "mean_ttft_ms": 1.0, "median_ttft_ms": 0.5, "p90_ttft_ms": 2.0,
        "p99_ttft_ms": 3.0, "mean_tpot_ms": 4.0, "request_throughput": 2.0, "cache_hit_rate": 0.75,
        "abort_rate": 0.0, "rollback_rate": 0.1, "mystery": 7, "backend": "xgrammar",
    }
    sections = {s.title: s for s in summary_sections(summary)}
    latency = sections["Latency (ms)"]
    assert latency.header == ("metric", "mean", "median", "p90", "p99")
    assert latency.rows == (("TTFT", 1.0, 0.5, 2.0, 3.0), ("TPOT", 4.0, None, None, 9.0))
    assert sections["Throughput"].rows == (("request_throughput", 2.0),)
    assert sections["Grammar compile and wait"].rows == (("cache_hit_rate", 0.75),)
    assert sections["Aborts and failures"].rows == (("abort_rate", 0.0),)
    assert ("rollback_rate", 0.1) in sections["Speculative decoding, jump-forward, validity"].rows
    assert set(sections["Other"].rows) == {("mystery", 7), ("backend", "xgrammar")}
    markdown = to_markdown(latency)
    assert markdown.splitlines()[3] == "| TPOT | 4 | - | - | 9 |"
    assert to_rich(latency).row_count == 2


def test_format_value():
    assert format_value(None) == "-"
    assert format_value(float("nan")) == "-"
    assert format_value(3) == "3"
    assert format_value(1234.5678) == "1235"
    assert format_value(0.00012345) == "0.000123"
    assert format_value(True) == "true"


def test_nested_counts_are_flattened():
    sections = {s.title: s for s in summary_sections({"aborts_by_reason": {"grammar_timeout": 3}})}
    assert sections["Aborts and failures"].rows == (("aborts_by_reason.grammar_timeout", 3),)


def test_console_sections_are_the_latency_grid_and_headline_fields():
    from cdbench.reports.tables import console_sections

    sections = console_sections({"mean_ttft_ms": 1.0, "request_throughput": 2.0, "steps": 9, "failed": 0})
    assert [s.title for s in sections] == ["Latency (ms)", "Throughput and grammar"]
    assert sections[1].rows == (("failed", 0), ("request_throughput", 2.0))


def test_workload_issues_are_not_a_summary_section():
    sections = summary_sections({"completed": 3, "workload_issues": {"spec_failures": 1, "details": "x.json"}})
    assert [s.title for s in sections] == ["Throughput"]
