"""A real (small, hand-built) simulation saved to a folder, read back, reported and traced."""

import json

import pandas as pd
import pytest

from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.model import FixedGrammarCosts, ModelExecutor
from cdbench.harness.policies import policy
from cdbench.harness.run import simulate
from cdbench.reports.run_report import build_report
from cdbench.results.run_folder import load_run, save_run
from cdbench.workloads.request import Request


def _result():
    requests = [Request(i, i * 0.01, 64, 8) for i in range(6)]
    return simulate(requests, policy("vllm", overlap=False), ModelExecutor(FixedGrammarCosts()),
                    FixedGpuCosts(forward_base_s=0.01), seed=3)


def test_saved_folder_round_trips_and_marks_completion_last(tmp_path):
    result = _result()
    config = policy("vllm", overlap=False)  # any pydantic model stands for the resolved config here
    finished = []
    saved = save_run(result, config, tmp_path / "run",
                     finish=lambda run: finished.append((run.folder / "summary.json").exists()))
    assert finished == [False]  # what finish adds comes before the summary that marks the folder complete
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["config.yaml", "requests.parquet", "steps.parquet", "summary.json", "trace.json"]
    loaded = load_run(tmp_path / "run")
    pd.testing.assert_frame_equal(loaded.requests, result.requests, check_categorical=False, check_dtype=False)
    assert loaded.summary == json.loads(result.summary.model_dump_json())
    assert loaded.summary["completed"] == 6
    assert loaded.config["name"] == "vllm"
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "gpu" in tracks  # zero-cost CPU work makes no scheduler spans here
    assert any(e["ph"] == "X" for e in trace["traceEvents"])
    report = build_report(saved).read_text()
    assert "| TTFT |" in report and "plots/ttft_cdf.png" in report


def test_a_measured_grammar_profile_is_saved_and_loads_back(tmp_path):
    import numpy as np

    from cdbench.harness.costs.grammar_profile import CompileMeasurement, GrammarProfile, WalkMeasurement

    result = _result()
    result.grammar_profile = GrammarProfile.from_measurements(
        "xgrammar", "qwen3.6", [CompileMeasurement("s", "regex", "ok", 0.01)],
        [WalkMeasurement("s", "regex", fill_s=np.full(4, 1e-5), accept_s=np.full(4, 1e-6))], source="in situ")
    save_run(result, policy("vllm", overlap=False), tmp_path / "run")
    assert GrammarProfile.load(tmp_path / "run" / "grammar_profile.json") == result.grammar_profile


def test_a_simulation_of_requests_not_held_is_the_same_run():
    requests = (Request(i, i * 0.01, 64, 8) for i in range(6))  # read once, in order
    result = simulate(requests, policy("vllm", overlap=False), ModelExecutor(FixedGrammarCosts()),
                      FixedGpuCosts(forward_base_s=0.01), seed=3, count=6)
    assert result.summary.completed == 6
    pd.testing.assert_frame_equal(result.requests, _result().requests)  # the same run as with them held
    with pytest.raises(ValueError, match="before the request issued before it"):
        simulate(iter([Request(0, 1.0, 64, 8), Request(1, 0.5, 64, 8)]), policy("vllm", overlap=False),
                 ModelExecutor(FixedGrammarCosts()), FixedGpuCosts(forward_base_s=0.01), count=2)
    with pytest.raises(ValueError, match="gave 1 requests, not the 2"):
        simulate(iter([Request(0, 1.0, 64, 8)]), policy("vllm", overlap=False),
                 ModelExecutor(FixedGrammarCosts()), FixedGpuCosts(forward_base_s=0.01), count=2)


def test_a_recorded_model_run_writes_the_trace_of_its_released_workload(tmp_path):
    from pathlib import Path

    from cdbench.backends.vocab import load_vocab
    from cdbench.cli.support import load_run_tree
    from cdbench.results.run_config import validate_run_config
    from cdbench.results.run_folder import record_run
    from cdbench.workloads.generator import generate
    from cdbench.workloads.trace import dumps_trace

    tree, source = load_run_tree(Path("cdbench/configs/ci.yaml"), {"requests": 40}, [])
    config = validate_run_config(tree, source)
    saved = record_run(config, tmp_path / "run")
    eager = generate(config.workload, load_vocab(config.vocab), progress=False)
    assert (tmp_path / "run" / "workload.trace.jsonl").read_text() == dumps_trace(eager)
    assert saved.summary["workload_issues"]["spec_failures"] == eager.report().spec_failure_count
