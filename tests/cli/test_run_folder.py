"""What a real run leaves in its folder beyond the metrics: workload issues, the replayable workload trace,
and the Chrome trace's tracks."""

import json

import pandas as pd
from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.results.config_files import builtin_config_path

runner = CliRunner()


def _corpus(path):
    lines = [
        json.dumps({"id": "ok", "kind": "choice", "spec": ["yes", "no"], "source": "s", "license": "MIT"}),
        "{not json",
        json.dumps({"id": "impossible", "kind": "json_schema", "spec": {"type": "integer", "minimum": 3, "maximum": 1},
                    "source": "s", "license": "MIT"}),
        json.dumps({"id": "nokind", "spec": "a+", "source": "s", "license": "MIT"}),
        json.dumps({"id": "digits", "kind": "regex", "spec": "[0-9]{3}", "source": "s", "license": "MIT"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(out, *extra):
    return runner.invoke(app, ["run", str(builtin_config_path("ci")), "--requests", "12", "--out", str(out), *extra])


def test_skipped_corpus_lines_and_impossible_specs_reach_the_console_summary_and_report(tmp_path):
    corpus = _corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "run"
    result = _run(out, "--corpus", str(corpus), "--set", "workload.token_source=oracle")
    assert result.exit_code == 0, result.output
    details = out / "workload_issues.json"
    assert (f"workload: 2 corpus lines skipped, 1 spec without a valid instance (each with its reason in {details})"
            in " ".join(result.output.split()))

    summary = json.loads((out / "summary.json").read_text())
    assert summary["workload_issues"] == {"skipped_corpus_lines": 2, "spec_failures": 1, "bad_trace_lines": 0,
                                          "duplicate_specs": 0, "details": "workload_issues.json"}
    assert summary["completed"] + summary["failed"] == 12  # the rest of the run went on
    report = json.loads(details.read_text())
    assert [(s["path"], s["line"]) for s in report["skipped_lines"]] == [(str(corpus), 2), (str(corpus), 4)]
    assert "missing field(s) kind" in report["skipped_lines"][1]["reason"]
    assert [f["spec_id"] for f in report["spec_failures"]] == ["impossible"]

    text = (out / "report.md").read_text()
    assert f"--set workload.trace={out / 'workload.trace.jsonl'}" in text
    assert "## Workload issues" in text and "all of them, with reasons, in `workload_issues.json`" in text
    assert f"- `{corpus}:2`: " in text and "- `impossible`: " in text
    assert "workload_issues.skipped_corpus_lines" not in text  # a section of its own, not a metric row


def test_a_run_folder_replays_its_own_workload(tmp_path):
    first, again = tmp_path / "first", tmp_path / "again"
    assert _run(first, "--seed", "3").exit_code == 0
    trace = first / "workload.trace.jsonl"
    assert trace.is_file()
    replay = _run(again, "--seed", "3", "--set", f"workload.trace={trace}")
    assert replay.exit_code == 0, replay.output
    requests = [pd.read_parquet(folder / "requests.parquet") for folder in (first, again)]
    pd.testing.assert_frame_equal(requests[0], requests[1])
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in (first, again)]
    for summary in summaries:
        summary.pop("workload_issues")
    assert summaries[0] == summaries[1]


def test_two_ranks_give_scheduler_gpu_and_per_rank_compile_tracks(tmp_path):
    out = tmp_path / "ranks"
    result = _run(out, "--set", "scheduler.ranks=2")
    assert result.exit_code == 0, result.output
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(processes[e["pid"]], e["args"]["name"]) for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"scheduler", "gpu", "rank0", "rank1"} <= set(processes.values())
    for rank in ("rank0", "rank1"):
        assert any(process == rank and thread.startswith("compile") for process, thread in threads), threads
    spans = {processes[e["pid"]] for e in events if e["ph"] == "X"}
    assert {"scheduler", "gpu", "rank0", "rank1"} <= spans  # every track holds spans, not only a name


def test_report_rebuilds_the_workload_issues_section_and_prints_the_count(tmp_path):
    out = tmp_path / "run"
    corpus = _corpus(tmp_path / "corpus.jsonl")
    assert _run(out, "--corpus", str(corpus), "--set", "workload.token_source=oracle").exit_code == 0
    (out / "report.md").unlink()
    result = runner.invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
    assert "workload: 2 corpus lines skipped, 1 spec without a valid instance" in " ".join(result.output.split())
    assert "- `impossible`: " in (out / "report.md").read_text()
