import json

from cdbench.results.chrome_trace import TraceSpan, chrome_trace


def test_events_have_named_tracks_and_microsecond_times(tmp_path):
    spans = [
        TraceSpan("scheduler", "step 0", 0.0, 0.002, {"batch": 4}),
        TraceSpan("compile pool/worker 0", "compile s1", 0.0005, 0.01),
        TraceSpan("compile pool/worker 1", "compile s2", 0.001, 0.002),
        TraceSpan("scheduler", "step 1", 0.002, 0.002),
    ]
    trace = chrome_trace(spans)
    path = tmp_path / "trace.json"
    trace.write(path)
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    names = {(e["name"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] != "process_sort_index"}
    assert names == {
        ("process_name", "scheduler"),
        ("thread_name", "scheduler"),
        ("process_name", "compile pool"),
        ("thread_name", "worker 0"),
        ("thread_name", "worker 1"),
    }
    complete = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in complete] == ["step 0", "compile s1", "compile s2", "step 1"]
    assert complete[0]["ts"] == 0.0 and complete[0]["dur"] == 2000.0
    assert complete[0]["args"] == {"batch": 4}
    pool = [e for e in complete if e["name"].startswith("compile")]
    assert pool[0]["pid"] == pool[1]["pid"] and pool[0]["tid"] != pool[1]["tid"]
    assert data["otherData"]["spans_dropped"] == 0


def test_cap_keeps_the_earliest_spans_and_says_so():
    spans = [TraceSpan("gpu", f"forward {i}", i * 0.01, 0.005) for i in range(10)]
    trace = chrome_trace(reversed(spans), max_spans=3)
    assert [e["name"] for e in trace.events if e["ph"] == "X"] == ["forward 0", "forward 1", "forward 2"]
    assert trace.spans_dropped == 7
    assert "capped" in trace.to_json()["otherData"]["note"]


def test_recorder_note_is_kept():
    trace = chrome_trace([TraceSpan("gpu", "f", 0.0, 1.0)], recorded_note="only the first 10 of 50 iterations were recorded")
    assert trace.to_json()["otherData"]["note"] == "trace capped: only the first 10 of 50 iterations were recorded"
    assert "note" not in chrome_trace([TraceSpan("gpu", "f", 0.0, 1.0)]).to_json()["otherData"]
