from __future__ import annotations

import json

import pytest

from cdbench.workloads.config import WorkloadConfig
from cdbench.workloads.generator import generate
from cdbench.workloads.trace import FORMAT_VERSION, TraceError, dumps_trace, loads_trace, read_trace, write_trace


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
    assert header["seed"] == 5 and header["config"]["spec_decode"] == {"k": 2, "alpha": 0.8}


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
