"""benchmarks/compile_beside_forward.py on the CPU: a probe's specs compiled in a probe worker, in this process
idle and beside a tiny model's step loop, one CSV row a spec."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import compile_beside_forward  # noqa: E402

from cdbench.harness.costs.host import BENCHMARK_VERSION, HostInfo  # noqa: E402
from cdbench.harness.costs.spec_probe import ProbedSpec, ProbeScale, SpecProbe  # noqa: E402
from cdbench.harness.costs.spec_profile import SpecProfile  # noqa: E402
from cdbench.harness.costs.spec_store import SpecCostEntry, SpecCostStore  # noqa: E402

TINY = {"name": "tiny", "params_total": 1e5, "n_layers": 2, "hidden_size": 64, "n_heads": 8, "n_kv_heads": 2,
        "head_dim": 16, "vocab_size": 50, "intermediate_size": 96}


def test_a_probes_specs_timed_in_the_three_conditions(tmp_path, capsys):
    host = HostInfo(id="lent", name="cpu-lent", cpu_model="x", cores=4, arch="x86_64", score=1.0,
                    benchmark_version=BENCHMARK_VERSION, measured="2026-11-27")
    store = SpecCostStore(tmp_path / "store")
    probed = []
    for i, (pattern, stored_s) in enumerate([("[a-z]{3}", 0.004), ("(ab|cd)+x", 0.05), ("[0-9]{2,5}-[a-f]+", 0.5)]):
        digest = f"{i:064x}"
        text = json.dumps({"kind": "regex", "spec": pattern, "options": {}})
        costs = SpecProfile(kind="regex", status="ok", compile_s=stored_s, fills=4, fill_scale_s=1e-5,
                            fill_curve=[1.0] * 13, fill_residual=[1.0], accept_s=1e-6)
        store.put(SpecCostEntry(digest=digest, backend="xgrammar", backend_version="0.2.8", vocab="cl100k",
                                kind="regex", host=host, status="ok", costs=costs, measured="test", spec=text))
        probed.append(ProbedSpec(digest=digest, label=f"r/{i}", there_s=stored_s, here_s=stored_s))
    probe = SpecProbe(store=str(store.root), backend="xgrammar", backend_version="0.2.8", vocab="cl100k",
                      measured_on=host, host=host, specs=probed, compile=ProbeScale(scale=1.0, spread=0.0, count=3),
                      compile_total=1.0, measured="test")
    (tmp_path / "probe.json").write_text(probe.model_dump_json())
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    out = tmp_path / "compiles.csv"
    compile_beside_forward.main(["--probe", str(tmp_path / "probe.json"), "--store", str(store.root), "--model",
                                 str(tmp_path / "tiny.json"), "--device", "cpu", "--rows", "2", "--kv", "8",
                                 "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [r["spec"] for r in rows] == ["r/0", "r/1", "r/2"]
    for r in rows:
        assert all(float(r[k]) > 0 for k in ("worker_s", "idle_s", "busy_s")) and int(r["busy_steps"]) >= 0
    printed = capsys.readouterr().out
    assert "stored 0-0.02 s: 1 specs, idle / worker" in printed and "stored 0.2-1 s: 1 specs" in printed
