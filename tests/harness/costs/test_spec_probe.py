"""The spec-cost probe: which stored specs it compiles again, what it measures, how a run prices with it.

The measuring tests compile a few small JSON schemas with xgrammar in worker processes (seconds); the
host benchmark is replaced by a constant.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import load_vocab
from cdbench.cli.app import app
from cdbench.harness.config import RunConfig
from cdbench.harness.costs import host as host_module
from cdbench.harness.costs.grammar_profile import GrammarProfile
from cdbench.harness.costs.host import BENCHMARK_VERSION, HostInfo
from cdbench.harness.costs.spec_costs import (
    SpecCostsError,
    SpecCostSettings,
    price_specs,
    run_order,
)
from cdbench.harness.costs.spec_probe import (
    ProbedSpec,
    ProbeScale,
    SpecHostScale,
    SpecProbe,
    choose_specs,
    compile_curve,
    host_entries,
    read_probe,
)
from cdbench.harness.costs.spec_profile import SpecProfile, spec_key_hash
from cdbench.harness.costs.spec_store import (
    SequenceEntry,
    SpecCostEntry,
    SpecCostStore,
    backend_version,
    sequence_digest,
    spec_digest,
)
from cdbench.harness.run import run
from cdbench.results.config_files import ConfigError
from cdbench.results.run_config import validate_run_config
from cdbench.results.run_folder import WORKLOAD_TRACE_FILE
from cdbench.workloads.generator import generate
from cdbench.workloads.request import Request
from cdbench.workloads.trace import read_trace

runner = CliRunner()
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]},
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}}, "required": ["city"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "number"}}, "required": ["ok", "n"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{8}$"},
                                      "when": {"type": "string", "format": "date"}}, "required": ["id", "when"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer", "minimum": 0}},
                                            "required": ["b"]}, "c": {"enum": [1, 2, 3]}}, "required": ["a", "c"]},
]


@pytest.fixture(autouse=True)
def quick_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_module, "run_benchmark", lambda: 1.0)


def _config(corpus: Path, store: Path, **costs) -> dict:
    return {"mode": "model", "vocab": "cl100k",
            # one compile sequence and no batch walk: the probe reads the specs' own entries
            "costs": {"spec_store": str(store), "measure_workers": 1, "allow_mismatched_profile": True,
                      "measure_repeats": 1, "measure_batch_rows": None, **costs},
            "workload": {"num_requests": 24, "corpus": [str(corpus)], "structured_ratio": 1.0,
                         "arrival": {"process": "poisson", "rate": 20.0}}}


def _schema_corpus(root: Path) -> Path:
    corpus = root / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"t/{i}", "kind": "json_schema", "spec": s, "source": "test",
                                          "license": "CC0"}) + "\n" for i, s in enumerate(SCHEMAS)))
    return corpus


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """A tiny store measured here by a model run, then probed here through the CLI with the run's requests."""
    mp = pytest.MonkeyPatch()
    mp.setattr(host_module, "run_benchmark", lambda: 1.0)
    root = tmp_path_factory.mktemp("probe")
    corpus = _schema_corpus(root)
    config = RunConfig.model_validate(_config(corpus, root / "store"))
    first = run(config)
    workload = generate(config.workload, load_vocab("cl100k"), progress=False)
    trace = root / "trace.jsonl"
    from cdbench.workloads.trace import write_trace

    write_trace(workload, trace)
    host_id = next((root / "store" / "hosts").glob("*.json")).stem
    out = root / "probe.json"
    result = runner.invoke(app, ["host", "--store", str(root / "store"), "--probe-specs", host_id, "--trace", str(trace),
                                 "--backend", "xgrammar", "--vocab", "cl100k", "--specs", "6", "--workers", "1",
                                 "--out", str(out)])
    yield root, corpus, first, result, out
    mp.undo()


def test_the_probe_of_a_store_measured_here_keeps_its_times_and_their_median_ratio(probed):
    root, _, _, result, out = probed
    host_id = next((root / "store" / "hosts").glob("*.json")).stem
    assert result.exit_code == 0, result.output
    assert "compile × " in result.output and f"costs.spec_host_scale=probe:{out}" in result.output
    probe = SpecProbe.model_validate_json(out.read_text())
    assert probe.measured_on.id == probe.host.id and probe.backend == "xgrammar" and probe.vocab == "cl100k"
    assert len(probe.specs) == 6 and all(s.here_s for s in probe.specs)
    assert probe.compile.count == 6
    # each spec's time there is the store's own entry for it, and the scale is the median of here over there with
    # half their interquartile range (how close to 1 a probe of this host comes is a timing: benchmarks, not tests)
    store = SpecCostStore(root / "store")
    assert [s.there_s for s in probe.specs] == [
        next(e.costs.compile_s for e in store.entries(s.digest) if e.host.id == host_id) for s in probe.specs]
    assert probe.compile == ProbeScale.of([s.here_s / s.there_s for s in probe.specs])
    # the run's texts were found in the trace and walked again
    assert probe.fill is not None and len(probe.walks) >= 4
    assert probe.fill == ProbeScale.of([w.here_s / w.there_s for w in probe.walks])
    assert probe.compile.scale == pytest.approx(np.median([s.here_s / s.there_s for s in probe.specs]))
    assert probe.compile_total == pytest.approx(sum(s.here_s for s in probe.specs) / sum(s.there_s for s in probe.specs))


def test_the_chosen_specs_are_the_same_however_the_store_lists_them(probed):
    root = probed[0]
    store = SpecCostStore(root / "store")
    host_id = next((root / "store" / "hosts").glob("*.json")).stem
    entries = host_entries(store, host_id, "xgrammar", "cl100k")
    assert len(entries) == len(SCHEMAS)
    assert [e.digest for e in choose_specs(entries, 4)] == [e.digest for e in choose_specs(entries[::-1], 4)]


def _host(host_id: str, score: float = 1.0, cores: int = 2) -> HostInfo:
    return HostInfo(id=host_id, name=f"cpu-{host_id}", cpu_model="x", cores=cores, arch="x86_64", score=score,
                    benchmark_version=BENCHMARK_VERSION, measured="2026-11-27")


def _entry(digest: str, host: HostInfo, compile_s: float) -> SpecCostEntry:
    costs = SpecProfile(kind="regex", status="ok", compile_s=compile_s, fills=4, fill_scale_s=1e-5,
                        fill_curve=[1.0] * 13, fill_residual=[1.0], accept_s=1e-6)
    return SpecCostEntry(digest=digest, backend="xgrammar", backend_version="0.2.8", vocab="cl100k", kind="regex",
                         host=host, status="ok", costs=costs, measured="test", spec="x")


def test_choose_specs_spans_the_compile_times_at_slice_middles():
    entries = [_entry(f"{i:032x}", _host("h"), (i + 1) * 1e-3) for i in range(40)]
    chosen = choose_specs(entries, 8)
    assert [round(e.costs.compile_s * 1e3) for e in chosen] == [3, 8, 13, 18, 23, 28, 33, 38]
    assert choose_specs(entries[:5], 8) == entries[:5]  # fewer entries than asked: every one


def _regex_requests() -> list[Request]:
    return [Request(i, i * 0.1, 16, 8, ConstraintSpec("regex", f"[a-z]{{{i + 1}}}"), f"r/{i}") for i in range(3)]


def _scale(there: HostInfo, here: HostInfo, digests: dict[str, float], fill: float | None = 1.2) -> SpecHostScale:
    return SpecHostScale(source="probe:p.json", backend="xgrammar", backend_version="0.2.8", vocab="cl100k",
                         measured_on=there, host=here, compile=ProbeScale(scale=1.5, spread=0.1, count=8),
                         fill=None if fill is None else ProbeScale(scale=fill, spread=0.05, count=8), there=digests)


@pytest.fixture
def stored(tmp_path, monkeypatch):
    """Three regex specs stored for host 'lent' (4 ms compiles, 10 µs fills), the engine version pinned."""
    from cdbench.harness.costs import spec_costs, spec_store

    monkeypatch.setattr(spec_store, "backend_version", lambda backend: "0.2.8")
    monkeypatch.setattr(spec_costs, "backend_version", lambda backend: "0.2.8")
    there = _host("lent", 0.6, cores=4)
    requests = _regex_requests()
    store = SpecCostStore(tmp_path)
    digests = {}
    for r in requests:
        digest = spec_digest("xgrammar", "0.2.8", "cl100k", {}, r.spec)
        store.put(_entry(digest, there, 0.004))
        digests[digest] = 0.004
    return store, there, requests, digests


def _price(store: SpecCostStore, requests, **settings):
    return price_specs(GrammarProfile.builtin("xgrammar"), "xgrammar", {}, "cl100k", requests,
                       SpecCostSettings(spec_store=str(store.root), spec_costs="strict", **settings))


def test_the_probes_scales_price_the_probed_hosts_specs_in_place_of_the_score_ratio(stored):
    store, there, requests, digests = stored
    # lent hosts of one CPU model and core count share an id: the probe scales them all the same
    for here in (_host("other", 0.9, cores=4), there.model_copy(update={"score": 0.9})):
        profile, coverage = _price(store, requests, spec_host_scale=_scale(there, here, digests))
        priced = profile.specs[spec_key_hash("regex:r/0")]
        assert priced.compile_s == pytest.approx(0.004 * 1.5)
        assert priced.fill_scale_s == pytest.approx(1e-5 * 1.2) and priced.accept_s == pytest.approx(1e-6 * 1.2)
        assert coverage.specs["measured_elsewhere"] == 3 and coverage.host_scales == {}
        assert coverage.target_host == here.name
        assert "compile × 1.500 (±0.100, 8 specs), fill × 1.200 (±0.050, 8 texts)" in coverage.host_probe
        assert coverage.host_probe in coverage.lines()
    # a probe that walked no text: fills by the score ratio, and it says so
    profile, coverage = _price(store, requests, spec_host_scale=_scale(there, _host("other", 0.9), digests, None))
    assert profile.specs[spec_key_hash("regex:r/0")].fill_scale_s == pytest.approx(1e-5 * 0.6 / 0.9)
    assert "the score ratio" in coverage.host_probe


def test_a_run_order_sequence_of_the_probed_host_takes_the_compile_scale(stored):
    store, there, requests, digests = stored
    store.put_sequence(SequenceEntry(
        digest=sequence_digest("xgrammar", "0.2.8", "cl100k", {}, [r.spec for r in requests]), backend="xgrammar",
        backend_version="0.2.8", vocab="cl100k", host=there, compile_s=[0.010, 0.002, None], measured="test"))
    profile, coverage = _price(store, requests, spec_host_scale=_scale(there, _host("other", 0.9), digests))
    assert coverage.compile_order == "run order"
    compiles = [profile.specs[spec_key_hash(f"regex:r/{i}")].compile_s for i in range(3)]
    assert compiles == pytest.approx([0.015, 0.003, 0.006])


def test_compiles_in_run_order_take_the_probed_sequences_scale_and_alone_ones_the_specs(stored):
    store, there, requests, digests = stored
    sequence = sequence_digest("xgrammar", "0.2.8", "cl100k", {}, [r.spec for r in requests])
    store.put_sequence(SequenceEntry(digest=sequence, backend="xgrammar", backend_version="0.2.8", vocab="cl100k",
                                     host=there, compile_s=[0.010, 0.002, None], measured="test"))
    scale = _scale(there, _host("other", 0.9), digests).model_copy(update={
        "compile_order": ProbeScale(scale=0.8, spread=0.1, count=5), "sequences": [sequence]})
    profile, coverage = _price(store, requests, spec_host_scale=scale)
    compiles = [profile.specs[spec_key_hash(f"regex:r/{i}")].compile_s for i in range(3)]
    assert compiles == pytest.approx([0.010 * 0.8, 0.002 * 0.8, 0.004 * 1.5])  # the failed one: alone, x 1.5
    assert "in run order × 0.800 (±0.100, 5 sequenced specs)" in coverage.host_probe
    by_size = scale.model_copy(update={"order_by_size": [(0.001, 1.0), (0.002, 1.0), (0.010, 0.5), (0.02, 0.5)]})
    profile, _ = _price(store, requests, spec_host_scale=by_size)
    compiles = [profile.specs[spec_key_hash(f"regex:r/{i}")].compile_s for i in range(3)]
    assert compiles == pytest.approx([0.010 * 0.5, 0.002 * 1.0, 0.004 * 1.5])
    with pytest.raises(SpecCostsError, match=r"probed another store: .* holds no run-order sequence 0+ of host lent"):
        _price(store, requests, spec_host_scale=scale.model_copy(update={"sequences": ["0" * 32]}))


def test_a_probe_in_run_order_compiles_the_traces_stored_sequence_here(probed):
    root, _, _, _, _ = probed
    store = SpecCostStore(root / "store")
    host_id = next((root / "store" / "hosts").glob("*.json")).stem
    out = root / "probe_order.json"
    args = ["host", "--store", str(root / "store"), "--probe-specs", host_id, "--backend", "xgrammar", "--vocab",
            "cl100k", "--specs", "6", "--workers", "1", "--out", str(out)]
    refused = runner.invoke(app, [*args, "--order"])
    assert refused.exit_code != 0 and "--order compiles each --trace's specs in run order" in refused.output
    result = runner.invoke(app, [*args, "--trace", str(root / "trace.jsonl"), "--order"])
    assert result.exit_code == 0, result.output
    probe = SpecProbe.model_validate_json(out.read_text())
    [sequence] = probe.sequences
    [stored] = store.sequences(sequence.digest)  # the model run's sequence, compiled again here
    assert [s.there_s for s in sequence.specs] == [t for t in stored.compile_s if t is not None]
    assert all(s.here_s is not None for s in sequence.specs) and len(sequence.specs) == len(stored.compile_s) == 24
    assert probe.compile_order == ProbeScale.of([s.here_s / s.there_s for s in sequence.specs])
    assert "in run order (1 sequences)" in result.output
    scale = read_probe(out, by_size=True)
    assert scale.sequences == [sequence.digest] and scale.order_by_size == compile_curve(sequence.specs)
    assert read_probe(out, by_size=False).order_by_size == [] and read_probe(out) == scale  # auto: by size
    assert read_probe(root / "probe.json").compile_by_size == []  # a probe of specs alone: auto takes the median


def _probed(there_s: float, ratio: float) -> ProbedSpec:
    return ProbedSpec(digest=f"d{there_s}", label="", there_s=there_s, here_s=there_s * ratio)


def test_the_compile_curve_smooths_each_ratio_with_its_neighbours_and_is_flat_beyond_the_probed_range():
    specs = [_probed(t, r) for t, r in [(1.0, 0.7), (0.001, 1.2), (0.01, 1.25), (0.1, 3.0), (10.0, 0.6)]]
    specs.append(ProbedSpec(digest="failed", label="", there_s=0.05, here_s=None))  # failed here: no point
    curve = compile_curve(specs)
    assert [t for t, _ in curve] == [0.001, 0.01, 0.1, 1.0, 10.0]  # ordered by stored seconds
    assert [r for _, r in curve] == pytest.approx([1.225, 1.25, 1.25, 0.7, 0.65])  # the 3.0 does not bend it
    scale = _scale(_host("lent"), _host("other"), {}).model_copy(update={"compile_by_size": curve})
    assert scale.compile_factor(0.0001) == pytest.approx(1.225) and scale.compile_factor(100.0) == pytest.approx(0.65)
    assert scale.compile_factor(0.1) == pytest.approx(1.25)
    assert scale.compile_factor(math.sqrt(0.1 * 1.0)) == pytest.approx((1.25 + 0.7) / 2)  # linear in log seconds
    assert scale.compile_factor(None) == scale.compile.scale == 1.5  # no stored time: the median
    assert compile_curve(specs[:3]) == []  # too few points: every compile takes the median


def test_a_curve_prices_each_compile_by_its_own_stored_seconds(stored):
    store, there, requests, digests = stored
    big = requests[2]
    digest = spec_digest("xgrammar", "0.2.8", "cl100k", {}, big.spec)
    store.put(_entry(digest, there, 2.0))  # one large compile beside the 4 ms ones
    digests = {**digests, digest: 2.0}
    curve = [(0.001, 1.3), (0.01, 1.3), (1.0, 0.5), (4.0, 0.5)]
    scale = _scale(there, _host("other", 0.9), digests).model_copy(update={"compile_by_size": curve})
    profile, coverage = _price(store, requests, spec_host_scale=scale)
    compiles = [profile.specs[spec_key_hash(f"regex:r/{i}")].compile_s for i in range(3)]
    assert compiles == pytest.approx([0.004 * 1.3, 0.004 * 1.3, 2.0 * 0.5])
    assert "compile by size, × 1.300 at 1 ms to × 0.500 at 4 s" in coverage.host_probe


def test_a_probe_of_another_store_backend_or_host_is_refused(stored):
    store, there, requests, digests = stored
    here = _host("other", 0.9)
    other_store = {**digests, next(iter(digests)): 0.005}
    with pytest.raises(SpecCostsError, match=r"probe:p\.json probed another store: .* holds 0\.004 s, not 0\.005 s"):
        _price(store, requests, spec_host_scale=_scale(there, here, other_store))
    with pytest.raises(SpecCostsError, match=r"probe:p\.json probed another store: .* holds no entry"):
        _price(store, requests, spec_host_scale=_scale(_host("third"), here, digests))
    llg = _scale(there, here, digests).model_copy(update={"backend": "llguidance"})
    with pytest.raises(SpecCostsError, match=r"probe:p\.json probed llguidance 0\.2\.8 on cl100k; this run prices "
                                             r"xgrammar 0\.2\.8 on cl100k"):
        _price(store, requests, spec_host_scale=llg)
    with pytest.raises(SpecCostsError, match=r"prices for host other; costs\.host names lent"):
        _price(store, requests, spec_host_scale=_scale(there, here, digests), host="lent")


def test_bad_probe_files_are_refused_with_one_line_naming_the_file(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "t/0", "kind": "regex", "spec": "[ab]", "source": "t", "license": "CC0"}))
    cases = {"missing.json": None, "junk.json": "{not json", "forward.json": json.dumps({"model": "qwen3-8b"})}
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(ConfigError) as err:
            validate_run_config(_config(corpus, tmp_path / "s", spec_host_scale=f"probe:{path}"))
        message = str(err.value)
        assert f"costs.spec_host_scale: probe:{path}: " in message and "\n" not in message
        assert ("cannot read the probe" if text is None else "not a spec-cost probe") in message
    with pytest.raises(ConfigError, match="expected 'probe:<file>'"):
        validate_run_config(_config(corpus, tmp_path / "s", spec_host_scale="1.2"))
    tree = {**_config(corpus, tmp_path / "s", spec_host_scale=f"probe:{tmp_path / 'x.json'}"), "mode": "hybrid"}
    with pytest.raises(ConfigError, match="prices a model run's specs; a hybrid run times its grammar work"):
        validate_run_config(tree)


def test_a_run_priced_by_a_probe_records_it_in_its_config_and_summary(probed):
    root, corpus, first, _, out = probed
    config = validate_run_config(_config(corpus, root / "store", spec_costs="strict", spec_host_scale=f"probe:{out}",
                                         spec_probe_compile="by_size"))
    scale = config.costs.spec_host_scale
    assert isinstance(scale, SpecHostScale) and scale.source == f"probe:{out}"
    assert scale == read_probe(out, by_size=True)
    # the resolved scale is what the run's config.yaml holds: it reruns without the file
    assert RunConfig.model_validate(config.model_dump(mode="json")).costs.spec_host_scale == scale
    result = run(config)
    coverage = result.summary.spec_costs
    assert coverage.host_probe == scale.describe() and f"by probe:{out}: compile by size, × " in coverage.host_probe
    assert coverage.specs["measured_elsewhere"] == first.summary.spec_costs.specs["measured_here"]
    assert scale.compile_by_size == compile_curve(SpecProbe.model_validate_json(out.read_text()).specs)
    # by the median (the default): no curve, and the description says the one ratio
    median = validate_run_config(_config(corpus, root / "store", spec_costs="strict",
                                         spec_host_scale=f"probe:{out}")).costs.spec_host_scale
    assert median.compile_by_size == [] and f"by probe:{out}: compile × {median.compile.scale:.3f}" in median.describe()


def test_the_probe_command_needs_an_out_file_and_a_probed_host(tmp_path):
    result = runner.invoke(app, ["host", "--store", str(tmp_path), "--probe-specs", "abc"])
    assert result.exit_code == 2 and "give it with --out" in result.output
    result = runner.invoke(app, ["host", "--store", str(tmp_path), "--probe-specs", "abc", "--out",
                                 str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "0 compiled specs of host abc" in result.output
    assert not (tmp_path / "p.json").exists()


TINY_MODEL = {"name": "tiny", "params_total": 1e5, "n_layers": 2, "hidden_size": 64, "n_heads": 8, "n_kv_heads": 2,
        "head_dim": 16, "vocab_size": 50, "intermediate_size": 96}


def test_the_compile_beside_forward_benchmark_times_a_probes_specs_in_three_conditions(tmp_path, capsys):
    # benchmarks/compile_beside_forward.py on the CPU: a probe worker, this process idle and beside a tiny model's
    # step loop, one CSV row a spec
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    import compile_beside_forward

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
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_MODEL))
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


@pytest.fixture(scope="module")
def compiled_in_process(tmp_path_factory):
    """A hybrid run of six JSON schemas (its compiles timed in its process, as a live run's are), then a model
    run of the same workload that measured the store's run-order sequence; both saved."""
    mp = pytest.MonkeyPatch()
    mp.setattr(host_module, "run_benchmark", lambda: 1.0)
    root = tmp_path_factory.mktemp("live_speed")
    corpus = _schema_corpus(root)
    for mode in ("hybrid", "model"):
        (root / f"{mode}.yaml").write_text(yaml.safe_dump({**_config(corpus, root / "store"), "mode": mode}))
        result = runner.invoke(app, ["run", str(root / f"{mode}.yaml"), "--out", str(root / mode)])
        assert result.exit_code == 0, result.output
    yield root, corpus
    mp.undo()


def test_a_hybrid_or_live_run_prices_the_stores_compiles_at_the_speed_it_compiled_them(compiled_in_process):
    root, corpus = compiled_in_process
    source = f"live-run:{root / 'hybrid'}"
    scale = validate_run_config(_config(corpus, root / "store", spec_costs="strict", spec_host_scale=source,
                                        spec_probe_compile="median")).costs.spec_host_scale
    # by hand: each spec's compile in the hybrid run over the store's sequence, in the run's order
    requests = read_trace(root / "hybrid" / WORKLOAD_TRACE_FILE).workload.requests
    ordered = run_order(requests, "xgrammar", "cl100k")
    (sequence,) = SpecCostStore(root / "store").sequences(sequence_digest(
        "xgrammar", backend_version("xgrammar"), "cl100k", {}, [o.spec for o in ordered]))
    compiled = GrammarProfile.load(root / "hybrid" / "grammar_profile.json").compile_by_spec
    ratios = [compiled[o.label] / there for o, there in zip(ordered, sequence.compile_s, strict=True)]
    assert len(ratios) == len(requests)  # each request its own copy of a schema: 24 specs
    assert scale.source == source and scale.measured_on == scale.host == sequence.host
    assert scale.compile_order == scale.compile == ProbeScale.of(ratios)
    assert scale.compile_by_size == scale.order_by_size == [] and scale.fill is None and scale.fill_scale() == 1.0
    profile, coverage = _price(SpecCostStore(root / "store"), requests, spec_host_scale=scale)
    for o, there in zip(ordered, sequence.compile_s, strict=True):
        assert profile.specs[spec_key_hash(f"json_schema:{o.label}")].compile_s == \
            pytest.approx(there * scale.compile.scale)
    assert f"by {source}: compile × {scale.compile.scale:.3f}" in coverage.host_probe
    # auto: by size, the curve through the run's specs
    by_size = validate_run_config(_config(corpus, root / "store", spec_costs="strict",
                                          spec_host_scale=source)).costs.spec_host_scale
    specs = [ProbedSpec(digest=o.digest, label=o.label, there_s=t, here_s=compiled[o.label])
             for o, t in zip(ordered, sequence.compile_s, strict=True)]
    assert by_size.order_by_size == by_size.compile_by_size == compile_curve(specs)


def test_a_compile_speed_needs_a_run_that_compiled_and_the_stores_sequence_of_its_workload(compiled_in_process,
                                                                                          tmp_path):
    root, corpus = compiled_in_process
    with pytest.raises(ConfigError, match=r"costs\.spec_host_scale: .*model is a model run: it compiled no spec"):
        validate_run_config(_config(corpus, root / "store", spec_host_scale=f"live-run:{root / 'model'}"))
    with pytest.raises(ConfigError, match=r"holds no run-order sequence of .*hybrid's 24 specs .*costs\.spec_costs="
                                          r"measure"):
        validate_run_config(_config(corpus, tmp_path / "empty", spec_host_scale=f"live-run:{root / 'hybrid'}"))
    with pytest.raises(ConfigError, match=r"no such|not a cdbench run"):
        validate_run_config(_config(corpus, root / "store", spec_host_scale=f"live-run:{tmp_path / 'none'}"))
    with pytest.raises(ConfigError, match="or 'live-run:<run folder or PACK::RUN>'"):
        validate_run_config(_config(corpus, root / "store", spec_host_scale="live-run:"))
    # a store holding the sequence from two other hosts: one must be named
    import shutil

    store = shutil.copytree(root / "store", tmp_path / "two_hosts")
    (path,) = (store / "sequences").glob("*/*/*.json")
    for host in ("hostx", "hosty"):
        entry = json.loads(path.read_text())
        entry["host"]["id"] = host
        (path.parent / f"{host}.json").write_text(json.dumps(entry))
    path.unlink()
    source = f"live-run:{root / 'hybrid'}"
    with pytest.raises(ConfigError, match=r"sequence from hosts hostx, hosty, none this machine's: name one"):
        validate_run_config(_config(corpus, store, spec_host_scale=source))
    named = validate_run_config(_config(corpus, store, spec_host_scale=source, host="hosty")).costs.spec_host_scale
    assert named.measured_on.id == named.host.id == "hosty"


def test_the_compile_order_benchmark_times_a_traces_run_order_in_five_conditions(compiled_in_process, tmp_path,
                                                                                 capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    import compile_order_beside_forward

    root, _ = compiled_in_process
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_MODEL))
    out = tmp_path / "order.csv"
    compile_order_beside_forward.main([str(root / "hybrid" / WORKLOAD_TRACE_FILE), "--model",
                                       str(tmp_path / "tiny.json"), "--device", "cpu", "--rows", "2", "--kv", "8",
                                       "--queued", "1", "--rounds", "1", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert {r["condition"] for r in rows} == set(compile_order_beside_forward.CONDITIONS)
    assert len(rows) == 24 * len(compile_order_beside_forward.CONDITIONS)  # each request its own copy
    assert all(float(r["compile_s"]) > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "24 specs in run order (xgrammar, cl100k)" in printed and "sums over worker: process" in printed
