"""The engines' measured host costs: presets pinned to the committed fit, and where the loop pays them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest
from scheduler_helpers import FORWARD_S, req, sim

from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.model import FixedGrammarCosts
from cdbench.harness.policies import HOST_COST_FIELDS, policy

ROOT = Path(__file__).resolve().parents[2]
FITTED = ROOT / "reports" / "engine_costs" / "fitted.json"
LAUNCH = ROOT / "reports" / "live" / "launch_h100.csv"

#: preset field -> its entry in fitted.json (engine, key); None: the preset has no fitted entry for it (0)
SOURCES = {
    "vllm": {"schedule_s": ("vllm", "xgrammar.schedule_s"), "schedule_row_s": ("vllm", "xgrammar.schedule_row_s"),
             "process_step_s": ("vllm", "xgrammar.process_step_s"),
             "process_row_s": ("vllm", "xgrammar.process_row_s"),
             # update_from_output's accept path less the grammar's own accept, which model mode charges from the profile
             "accept_row_s": ("vllm", "xgrammar.accept_wrapper_row_s"),
             "fill_step_s": ("vllm", "xgrammar.fill_step_s"), "fill_row_s": ("vllm", "xgrammar.fill_row_s"),
             "mask_alloc_byte_s": None, "ipc_s": ("vllm", "ipc_s"), "ipc_byte_s": ("vllm", "ipc_byte_s"),
             "sample_prep_s": None, "sample_prep_row_s": None},
    # batch forming and result processing from the scheduler's decode steps (torchvision stubbed); accept_row_s is
    # the processor's extra per structured row less the grammar's own accept (as vLLM's)
    "sglang": {"schedule_s": ("sglang", "xgrammar.schedule_s"), "schedule_row_s": ("sglang", "xgrammar.schedule_row_s"),
               "process_step_s": ("sglang", "xgrammar.process_step_s"),
               "process_row_s": ("sglang", "xgrammar.process_row_s"),
               "accept_row_s": ("sglang", "xgrammar.accept_wrapper_row_s"),
               "fill_step_s": ("sglang", "xgrammar.fill_step_s"),
               "fill_row_s": ("sglang", "xgrammar.fill_row_s"),
               "mask_alloc_byte_s": ("sglang", "xgrammar.mask_alloc_byte_s"),
               "ipc_s": ("vllm", "ipc_s"), "ipc_byte_s": ("vllm", "ipc_byte_s"),
               "sample_prep_s": None, "sample_prep_row_s": None},
    # an engine-version preset: every host cost from its own version's measurement
    "vllm-0.10": {field: ("vllm-0.10", f"xgrammar.{field}") for field in (
        "schedule_s", "schedule_row_s", "process_step_s", "process_row_s", "fill_step_s", "fill_row_s")}
    | {"accept_row_s": ("vllm-0.10", "xgrammar.accept_wrapper_row_s"), "mask_alloc_byte_s": None,
       "ipc_s": ("vllm-0.10", "ipc_s"), "ipc_byte_s": ("vllm-0.10", "ipc_byte_s"),
       "sample_prep_s": None, "sample_prep_row_s": None},
}
#: the model runner's bitmask build before its copy (measure_vllm_bitmask_build.py): vLLM 0.10.1's alone
BUILD = ("mask_build_byte_s", "mask_scatter_byte_s")
for _preset in ("vllm", "sglang"):
    SOURCES[_preset] |= dict.fromkeys(BUILD)
SOURCES["vllm-0.10"] |= {field: ("vllm-0.10", field) for field in BUILD}
#: what V0's sampler and per-row path launch on a GPU (benchmarks/gpu_launch_costs.py): V0's preset alone
LAUNCHES = ("sample_launch_s", "sample_launch_row_s", "row_launch_s")
for _preset in ("vllm", "sglang", "vllm-0.10"):
    SOURCES[_preset] |= dict.fromkeys(LAUNCHES)
# V0: its logits-processor path and its sampler's host work per step and row measured, their GPU launches too
# (benchmarks/gpu_launch_costs.py); no V1 accept path; its scheduler unmeasured (V1's costs)
SOURCES["vllm-0.6"] = SOURCES["vllm"] | {"fill_step_s": ("vllm-0.6", "xgrammar.fill_step_s"),
                                         "fill_row_s": ("vllm-0.6", "xgrammar.fill_row_s"), "accept_row_s": None} | {
    field: ("vllm-0.6", field) for field in ("sample_prep_s", "sample_prep_row_s", *LAUNCHES)}
#: fitted.json key -> the engine and the version its entries must name
ENGINES = {"vllm": ("vllm", "vllm 0.32"), "sglang": ("sglang", "sglang 0.5"), "vllm-0.10": ("vllm", "vllm 0.10.1"),
           "vllm-0.6": ("vllm", "vllm 0.6.6")}


@pytest.mark.parametrize("preset", sorted(SOURCES))
def test_preset_host_costs_are_the_committed_fit(preset):
    fitted = json.loads(FITTED.read_text())
    cfg = policy(preset)
    assert set(SOURCES[preset]) | {"launch_s", "launch_prefill_s", "launch_row_s"} == set(HOST_COST_FIELDS)
    assert cfg.launch_row_s == 0.0  # fitted only from a live run's own steps (costs.host_costs=live-run:...)
    for field, source in SOURCES[preset].items():
        expected = 0.0 if source is None else fitted[source[0]][source[1]]["value"]
        assert getattr(cfg, field) == expected, field
    # the launch comes from live mode's steps (the engines' worker side did not run): decode, and with prefill
    launch = pd.read_csv(LAUNCH).set_index("kind")["median_us"]
    assert cfg.launch_s == pytest.approx(launch["decode"] * 1e-6, rel=1e-9)
    assert cfg.launch_prefill_s == pytest.approx(launch["prefill"] * 1e-6, rel=1e-9)


def _fit_module():
    spec = importlib.util.spec_from_file_location("engine_cost_fit", ROOT / "scripts" / "engine_costs" / "fit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_fit_reproduces_from_the_committed_measurements():
    fit = _fit_module()
    assert fit.fit_all(FITTED.parent) == json.loads(FITTED.read_text())


def test_measurements_name_engine_version_and_function():
    fitted = json.loads(FITTED.read_text())
    assert set(fitted) == set(ENGINES)
    for key, (engine, version) in ENGINES.items():
        for p in fitted[key].values():
            assert p["engine"] == engine and p["version"].startswith(version) and p["function"] and p["fit"]


@pytest.mark.parametrize("key, path", [("vllm", "accept_row_s"), ("vllm-0.10", "accept_row_s"),
                                       ("sglang", "process_accept_row_s")])
def test_the_engines_accept_path_is_priced_without_the_grammars_own_accept(key, path):
    # the engine's accept path (vLLM's update_from_output, SGLang's process_batch_result_decode) holds xgrammar's
    # accept_token, which model mode charges from the grammar profile: the preset takes the engine's path less the
    # grammar's own accept, measured in the same environment
    fitted = json.loads(FITTED.read_text())[key]
    own, whole = fitted["xgrammar.grammar_accept_row_s"], fitted[f"xgrammar.{path}"]
    wrapper = fitted["xgrammar.accept_wrapper_row_s"]
    assert 0 < own["value"] < whole["value"] and own["cases"] >= 48 and "accept_token" in own["function"]
    assert wrapper["value"] == pytest.approx(whole["value"] - own["value"], rel=1e-3)
    assert policy(key).accept_row_s == wrapper["value"]


def test_sglang_batch_forming_and_result_processing_are_measured():
    # SGLang's scheduler did not import here until torchvision was stubbed: its batch forming and result
    # processing now have entries of their own, fitted from the scheduler's steps (a 0 there is a fitted 0)
    sglang = json.loads(FITTED.read_text())["sglang"]
    for field in ("schedule_s", "schedule_row_s", "process_step_s", "process_row_s", "process_accept_row_s"):
        entry = sglang[f"xgrammar.{field}"]
        assert entry["value"] >= 0 and entry["cases"] >= 9 and "decode" in entry["fit"]
    assert sglang["xgrammar.schedule_row_s"]["value"] > 0 and sglang["xgrammar.process_row_s"]["value"] > 0
    assert "prepare_for_decode" in sglang["xgrammar.schedule_s"]["function"]
    assert sglang["xgrammar.process_row_s"]["function"] == "SchedulerBatchResultProcessor.process_batch_result_decode"


def test_the_version_preset_prices_its_fill_before_the_forward():
    # vLLM 0.10 fills the bitmask inside schedule(), before the step launches, with no async scheduling: the
    # same step costs the fill on top of the forward, where today's preset runs it beside the forward
    reqs = [req(0, 0.0, out=4)]
    grammar = FixedGrammarCosts(compile_time_s=0.0, fill_time_s=0.004, accept_time_s=0.0, rollback_time_s=0.0)
    old = sim(reqs, "vllm-0.10", grammar=grammar, fill_row_s=0.001)
    new = sim(reqs, "vllm", grammar=grammar, fill_row_s=0.001, overlap=False)
    decode = [r.steps[(r.steps["kind"] == "decode") & (r.steps["grammar_rows"] == 1)] for r in (old, new)]
    assert len(decode[0]) and len(decode[1])
    assert decode[0]["duration_s"].iloc[0] == pytest.approx(decode[1]["duration_s"].iloc[0] + 0.005)
    assert policy("vllm-0.10").name == "vllm-0.10" and not policy("vllm-0.10").overlap


# ---------------------------------------------------------------- where the loop pays them

ROW_BYTES = 1000
COSTS = {"schedule_s": 1e-4, "schedule_row_s": 1e-5, "process_step_s": 2e-5, "process_row_s": 3e-6, "accept_row_s": 4e-6,
             "fill_step_s": 5e-5, "fill_row_s": 6e-6, "mask_alloc_byte_s": 1e-9, "ipc_s": 3e-4, "ipc_byte_s": 1e-8}
GRAMMAR = FixedGrammarCosts(compile_time_s=0.0, fill_time_s=1e-4, accept_time_s=0.0, rollback_time_s=0.0)


def _decode_steps(transfer: str = "none", overlap: bool = False, **kw):
    reqs = [req(0, 0.0, out=4), req(1, 0.0, out=4, spec=None)]  # one structured row, one free row
    result = sim(reqs, "vllm", gpu=FixedGpuCosts(forward_base_s=FORWARD_S, row_bytes=ROW_BYTES), grammar=GRAMMAR,
                 overlap=overlap, mask_transfer=transfer, **{**COSTS, **kw})
    steps = result.steps
    return result, steps[(steps["kind"] == "decode") & (steps["rows"] == 2)]


def test_each_host_cost_lands_in_its_step_column():
    _, steps = _decode_steps()
    assert len(steps)
    s = steps.iloc[0]
    assert s["schedule_s"] == pytest.approx(1e-4 + 2 * 1e-5)
    # the grammar's own fill + the wrapper per iteration and per structured row + the mask of both rows
    assert s["fill_s"] == pytest.approx(1e-4 + 5e-5 + 6e-6 + 1e-9 * ROW_BYTES * 2)
    assert s["process_s"] == pytest.approx(2e-5 + 2 * 3e-6 + 4e-6)
    assert s["transfer_s"] == 0.0


def test_ipc_transfer_is_priced_per_byte_and_sits_on_the_mask_path():
    _, local = _decode_steps()
    _, ipc = _decode_steps("ipc")
    assert ipc.iloc[0]["transfer_s"] == pytest.approx(3e-4 + 1e-8 * ROW_BYTES)
    # without overlap the mask path (fill + copy + transfer) runs beside the forward: hidden while shorter
    assert ipc["duration_s"].to_numpy() == pytest.approx(local["duration_s"].to_numpy())
    _, long_ipc = _decode_steps("ipc", ipc_s=0.02)
    extra = long_ipc.iloc[0]["duration_s"] - local.iloc[0]["duration_s"]
    assert extra == pytest.approx(long_ipc.iloc[0]["fill_s"] + 0.02 + 1e-8 * ROW_BYTES - FORWARD_S)


def test_overlap_hides_host_costs_that_serial_steps_pay():
    serial, _ = _decode_steps(overlap=False)
    hidden, _ = _decode_steps(overlap=True)
    serial_off, _ = _decode_steps(overlap=False, **dict.fromkeys(HOST_COST_FIELDS, 0.0))
    assert serial.summary.duration > serial_off.summary.duration
    assert hidden.summary.duration < serial.summary.duration
    assert serial.summary.host_schedule_share > 0 and serial.summary.host_process_share > 0
    assert serial.summary.gpu_share > 0


def test_host_transfer_share_appears_only_with_ipc():
    local, _ = _decode_steps()
    ipc, _ = _decode_steps("ipc")
    assert local.summary.host_transfer_share == 0.0
    assert ipc.summary.host_transfer_share > 0.0


def test_the_wrapper_stays_serial_when_the_fill_pool_spreads_the_fills():
    # 4 structured rows above a parallel threshold of 2: the grammar's fills spread over 4 threads, the
    # wrapper's per-row cost (under the GIL) does not
    reqs = [req(i, 0.0, out=3) for i in range(4)]
    result = sim(reqs, "vllm", gpu=FixedGpuCosts(forward_base_s=FORWARD_S), grammar=GRAMMAR, overlap=False,
                 fill_parallel_threshold=2, fill_chunk=1, fill_threads=4, fill_step_s=0.0, fill_row_s=6e-6)
    decode = result.steps[(result.steps["kind"] == "decode") & (result.steps["grammar_rows"] == 4)]
    assert decode.iloc[0]["fill_s"] == pytest.approx(1e-4 + 4 * 6e-6)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_launch_is_paid_on_every_step_with_or_without_overlap(overlap):
    base = sim([req(0, 0.0, out=4, spec=None)], "sglang", overlap=overlap)
    launched = sim([req(0, 0.0, out=4, spec=None)], "sglang", overlap=overlap, launch_s=0.002, launch_prefill_s=None)
    steps = launched.steps[launched.steps["kind"] != "idle"]
    assert len(steps) == 4 and (steps["launch_s"] == 0.002).all()
    assert (base.steps["launch_s"] == 0.0).all()
    # nothing hides it: each step is 2 ms longer, the GPU waiting, and the CPU on the critical path grows by it
    assert steps["duration_s"].to_numpy() == pytest.approx(
        base.steps.loc[base.steps["kind"] != "idle", "duration_s"].to_numpy() + 0.002, abs=1e-12)
    assert steps["exposed_cpu_s"].sum() == pytest.approx(
        base.steps["exposed_cpu_s"].sum() + 4 * 0.002, abs=1e-12)
    assert launched.requests["finish_s"].iloc[0] == pytest.approx(base.requests["finish_s"].iloc[0] + 4 * 0.002,
                                                                  abs=1e-12)


def test_a_step_with_prefill_chunks_pays_its_own_launch():
    reqs = [req(0, 0.0, out=4, spec=None), req(1, 0.0005, out=4, spec=None)]
    both = sim(reqs, "vllm", overlap=False, launch_s=0.002, launch_prefill_s=0.0005).steps
    both = both[both["kind"] != "idle"]
    has_prefill = both["prefill_tokens"] > 0
    assert has_prefill.any() and (~has_prefill).any()
    assert (both.loc[has_prefill, "launch_s"] == 0.0005).all() and (both.loc[~has_prefill, "launch_s"] == 0.002).all()
    # unset, a prefill step pays launch_s
    alone = sim(reqs, "vllm", overlap=False, launch_s=0.002, launch_prefill_s=None).steps
    assert (alone.loc[alone["kind"] != "idle", "launch_s"] == 0.002).all()


def test_a_launch_per_row_grows_with_the_sampled_rows():
    reqs = [req(i, 0.0, out=2 + 2 * i, spec=None) for i in range(3)]  # rows leave one by one
    steps = sim(reqs, "vllm", overlap=False, launch_s=0.002, launch_prefill_s=None, launch_row_s=1e-4).steps
    steps = steps[steps["kind"] != "idle"]
    assert (steps["launch_s"].to_numpy() == pytest.approx(0.002 + 1e-4 * steps["rows"].to_numpy(), abs=1e-12))
    assert steps["rows"].nunique() > 1


def test_v0s_launches_are_a_gpu_measurement_of_its_calls():
    # the sampler's 16 calls that launch GPU work and its 7 pinned stagings, the row's apply and write-back, timed on
    # a GPU with vLLM 0.6.6's xgrammar (benchmarks/gpu_launch_costs.py); the fit reads the idle GPU's rows
    path = FITTED.parent / "vllm-0.6.6_v0_gpu_launch.csv.gz"
    head = pd.read_csv(path, nrows=0).columns[0]
    assert "NVIDIA" in head and "xgrammar=0.1.6" in head
    calls = pd.read_csv(path, comment="#")
    idle = calls[(calls["part"] == "sampler") & (calls["mode"] == "idle")]
    for _, step in idle.groupby("rows"):
        assert len(step[~step["name"].str.contains("stage_")]) == 16 and step["n"].min() >= 100
    rows = calls[(calls["part"] == "processor") & (calls["mode"] == "idle")].pivot(index="rows", columns="name",
                                                                                    values="host_us")
    assert policy("vllm-0.6").row_launch_s == pytest.approx(1e-6 * (rows.apply_bitmask + rows.write_back).mean(),
                                                            rel=1e-3)
