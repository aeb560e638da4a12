from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdbench.workloads.config import WorkloadConfig
from cdbench.workloads.generator import generate
from cdbench.workloads.trace import (
    FORMAT_VERSION,
    TraceError,
    dumps_trace,
    loads_trace,
    read_trace,
    write_trace,
)


@pytest.fixture
def workload(vocab, pool_cache):
    cfg = WorkloadConfig(num_requests=30, seed=5, structured_ratio=0.8,
                         reasoning={"fraction": 0.5, "thinking_budget": 100}, spec_decode={"k": 2, "alpha": 0.8})
    return generate(cfg, vocab, cache=pool_cache, progress=False)


def test_export_import_export_is_byte_identical(workload, tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(workload, path)
    load = read_trace(path)
    assert not load.skipped
    assert load.workload.requests == workload.requests
    assert load.workload.config == workload.config
    assert dumps_trace(load.workload) == path.read_text()


def test_header_line(workload):
    header = json.loads(dumps_trace(workload).splitlines()[0])
    assert header["type"] == "header" and header["format_version"] == FORMAT_VERSION
    assert header["seed"] == 5 and header["config"]["spec_decode"] == {"k": 2, "alpha": 0.8, "drafter": "external"}


def test_bad_lines_are_reported_and_the_rest_loads(workload):
    lines = dumps_trace(workload).splitlines()
    bad = json.loads(lines[3])
    bad["output_len"] = 0
    lines[3] = json.dumps(bad)
    lines[5] = "{not json"
    lines[7] = lines[7].replace('"prompt_len"', '"prompt_length"')
    load = loads_trace("\n".join(lines))
    assert [s.line for s in load.skipped] == [4, 6, 8]
    assert "greater than or equal to 1" in load.skipped[0].reason and "output_len" in load.skipped[0].reason
    assert len(load.workload.requests) == len(workload.requests) - 3


def test_bad_header_is_an_error(workload):
    lines = dumps_trace(workload).splitlines()
    with pytest.raises(TraceError, match="line 1"):
        loads_trace("\n".join(lines[1:]))
    with pytest.raises(TraceError, match="format_version 99"):
        loads_trace(lines[0].replace(f'"format_version":{FORMAT_VERSION}', '"format_version":99'))


def _request_line(**fields):
    line = {"type": "request", "request_id": 0, "arrival_s": 0.5, "prompt_len": 4, "output_len": 2,
            "spec_id": "r", "spec": {"kind": "regex", "spec": "a", "options": {}}, "output_tokens": [64, 100257],
            "instance_index": 0, "think_len": 0, "thinking_budget": None, "closed_loop": False, "random_walk": None}
    return json.dumps({**line, **fields})


@pytest.mark.parametrize("fields, reason", [
    ({"spec": {"kind": "regex", "spec": 3, "options": {}}}, "spec of a regex item must be str"),
    ({"spec": {"kind": "choice", "spec": ["a", 1], "options": {}}}, "choice spec must be a list of strings"),
    ({"spec": {"kind": "ebnf", "spec": 'root ::= "a"', "options": {}}}, "ebnf item needs dialect"),
    ({"spec": {"kind": "json_schema", "spec": "[1]", "options": {}}}, "json_schema item must be an object or bool"),
    ({"output_len": 3}, "output_len 3 != len(output_tokens) 2"),
    ({"arrival_s": float("nan")}, "finite number at arrival_s"),
    ({"arrival_s": float("inf")}, "finite number at arrival_s"),
    ({"arrival_s": -1.0}, "greater than or equal to 0 at arrival_s"),
    ({"output_tokens": [100277, 100257]}, "output token 100277 is outside vocabulary 'cl100k' (size 100277)"),
    ({"output_tokens": [-1, 100257]}, "greater than or equal to 0 at output_tokens.0"),
    ({"spec": None, "output_tokens": None, "instance_index": None}, "plain request (spec null) cannot have spec_id"),
    ({"spec_id": None}, "needs a non-empty spec_id"),
    ({"output_tokens": None}, "instance_index without output_tokens"),
    ({"instance_index": None, "random_walk": {"seed": 1, "eos_bias": 0.1, "max_tokens": None}},
     "random_walk and output_tokens exclude each other"),
])
def test_each_bad_request_line_is_reported_by_number_and_the_rest_loads(workload, fields, reason):
    lines = dumps_trace(workload).splitlines()
    lines.insert(2, _request_line(request_id=10_000, **fields))
    load = loads_trace("\n".join(lines) + "\n")
    assert load.bad_line_count == 1 and load.skipped[0].line == 3
    assert reason in load.skipped[0].reason
    assert load.workload.requests == workload.requests
    assert load.workload.bad_trace_lines == load.skipped


def test_duplicate_request_ids_and_invalid_utf8_lines_are_bad_lines(workload, tmp_path):
    lines = dumps_trace(workload).encode().split(b"\n")
    lines.insert(3, lines[1])  # request 0 again
    lines.insert(5, b'{"type":"request","request_id":77,"spec_id":"\xff"}')
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(lines))
    load = read_trace(path)
    first_id = json.loads(lines[1])["request_id"]
    assert [str(s) for s in load.skipped] == [
        f"line 4: duplicate request_id {first_id} (first on line 2)", "line 6: invalid UTF-8 at byte 45 of the line"]
    assert load.workload.requests == workload.requests


def test_header_vocabulary_must_be_known(workload):
    lines = dumps_trace(workload).splitlines()
    with pytest.raises(TraceError, match="unknown vocabulary"):
        loads_trace("\n".join([lines[0].replace('"vocab":"cl100k"', '"vocab":"nope"')] + lines[1:]))


def test_line_separators_inside_specs_survive_the_round_trip(vocab, pool_cache, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "c", "kind": "choice", "spec": ["a\u2028b", "c\x85d"], "source": "s",
                                  "license": "MIT"}, ensure_ascii=False) + "\n", encoding="utf-8")
    wl = generate(WorkloadConfig(num_requests=4, corpus=[str(corpus)], spec_reuse={"mode": "same"}), vocab,
                  cache=pool_cache, progress=False)
    text = dumps_trace(wl)
    load = loads_trace(text)
    assert not load.skipped and load.workload.requests == wl.requests and dumps_trace(load.workload) == text


def test_random_walk_settings_round_trip(vocab, pool_cache):
    wl = generate(WorkloadConfig(num_requests=6, token_source="random_walk", random_walk={"eos_bias": 0.3}), vocab,
                  cache=pool_cache, progress=False)
    text = dumps_trace(wl)
    assert loads_trace(text).workload.requests == wl.requests and dumps_trace(loads_trace(text).workload) == text
    assert json.loads(text.splitlines()[1])["random_walk"]["eos_bias"] == 0.3


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=60), st.builds(_request_line, request_id=st.integers(-2, 5),
                                                          arrival_s=st.floats(allow_nan=True, allow_infinity=True),
                                                          output_len=st.integers(-1, 3))), max_size=10))
def test_any_request_lines_load_or_are_reported(workload, lines):
    header = dumps_trace(workload).splitlines()[0]
    lines = [line.replace("\n", " ").replace("\r", " ") for line in lines]
    load = loads_trace("\n".join([header, *lines]) + "\n")
    blank = sum(not line.strip() for line in lines)
    assert len(load.workload.requests) + load.bad_line_count + blank == len(lines)
    assert len({r.request_id for r in load.workload.requests}) == len(load.workload.requests)


def test_a_run_config_replays_a_trace(workload, vocab, tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(workload, path)
    replayed = generate(WorkloadConfig(num_requests=999, trace=path, corpus=["no-such-corpus"]), vocab, progress=False)
    assert replayed.requests == workload.requests and replayed.trace_path == path
    assert replayed.config.spec_decode == WorkloadConfig(num_requests=1).spec_decode  # the run's, not the trace's
    assert replayed.config.model_copy(update={"spec_decode": workload.config.spec_decode}) == workload.config
    assert replayed.report().replayed_from == str(path)
    again = generate(WorkloadConfig(trace=path, spec_decode={"k": 3, "alpha": 0.5}), vocab, progress=False)
    assert (again.config.spec_decode.k, again.config.spec_decode.alpha) == (3, 0.5)


def test_replay_refuses_tokens_of_another_vocabulary_and_traces_with_no_request(workload, tmp_path):
    from cdbench.backends.vocab import load_vocab

    path = tmp_path / "t.jsonl"
    write_trace(workload, path)
    with pytest.raises(TraceError, match="token ids of vocabulary 'cl100k'; the run uses 'qwen3.6'"):
        generate(WorkloadConfig(trace=path), load_vocab("qwen3.6"), progress=False)
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + "{broken\n")
    with pytest.raises(TraceError, match="no loadable request line \\(1 bad; first: line 2"):
        generate(WorkloadConfig(trace=path), load_vocab("cl100k"), progress=False)


def test_a_lengths_trace_replays_on_any_vocabulary(vocab, pool_cache, tmp_path):
    from cdbench.backends.vocab import load_vocab

    wl = generate(WorkloadConfig(num_requests=5, token_source="lengths"), vocab, cache=pool_cache, progress=False)
    path = tmp_path / "t.jsonl"
    write_trace(wl, path)
    replayed = generate(WorkloadConfig(trace=path), load_vocab("qwen3.6"), progress=False)
    assert replayed.requests == wl.requests and replayed.vocab_name == "qwen3.6"


def test_a_replayed_trace_runs_in_hybrid_mode_with_the_traces_oracle_tokens(vocab, pool_cache, tmp_path):
    """``workload.trace`` is all a run config needs: the real backend decodes the trace's own tokens."""
    from cdbench.harness.config import RunConfig
    from cdbench.harness.run import run

    wl = generate(WorkloadConfig(num_requests=12, kinds=["regex", "choice"], structured_ratio=0.75), vocab,
                  cache=pool_cache, progress=False)
    path = tmp_path / "t.jsonl"
    write_trace(wl, path)
    config = RunConfig(mode="hybrid", vocab="cl100k", trace_steps=0,
                       workload={"trace": str(path), "spec_decode": {"k": 2, "alpha": 0.7}})
    frame = run(config).requests.sort_values("request_id")
    structured = frame[frame["structured"]]
    assert len(structured) == sum(r.structured for r in wl.requests) > 0
    assert (frame["abort_reason"] == "").all() and structured["valid"].all()
    assert frame["output_tokens"].tolist() == [len(r.output_tokens) if r.output_tokens else r.output_len
                                               for r in sorted(wl.requests, key=lambda r: r.request_id)]
    assert structured["drafted"].sum() > 0
