"""Campaign files: what parses, and the one-line error each mistake gets."""

from pathlib import Path

import pytest

from cdbench.campaigns.plan import (
    Cell,
    evaluate,
    folder_lookup,
    plan_runs,
    resolve,
    run_config,
    run_id,
)
from cdbench.campaigns.spec import load_campaign
from cdbench.harness.config import RunConfig
from cdbench.results.config_files import ConfigError, validate_config
from cdbench.results.sweep import base_config

GOOD = """
name: t
set: {workload.num_requests: 20, workload.arrival.rate: "= ${load} * 10"}
seeds: [1, 2]
cells: {policy.name: [sglang, vllm], load: [0.5, 1]}
arms:
  capacity: {mode: hybrid, over: [policy.name], set: {workload.arrival.rate: 1000}}
  hybrid: {mode: hybrid, copies: 2}
  model:
    mode: model
    seed_offset: 1000
    set: {costs.grammar_profile: "${hybrid.folder}/grammar_profile.json", workload.arrival.rate: "= ${load} * ${capacity.request_throughput}"}
comparisons:
  - {name: own, reference: hybrid, runs: [model], noise: hybrid, bar: shipped}
  - {name: custom, reference: hybrid, runs: [model], bar: {median_ttft_ms: 3}}
"""


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_good_file_plans_every_run_with_its_dependencies(tmp_path):
    spec = load_campaign(write(tmp_path, GOOD))
    runs = plan_runs(spec)
    # capacity once per policy and seed; hybrid 2 copies and model once per cell and seed
    assert sum(r.arm == "capacity" for r in runs) == 2 * 2
    assert sum(r.arm == "hybrid" for r in runs) == 4 * 2 * 2
    assert sum(r.arm == "model" for r in runs) == 4 * 2
    model = next(r for r in runs if r.arm == "model")
    assert model.run_id == "policy=sglang,load=0.5/seed1/model-1"
    assert set(model.depends) == {"policy=sglang/seed1/capacity-1", "policy=sglang,load=0.5/seed1/hybrid-1"}
    assert spec.comparisons[0].tolerances()["p99_ttft_ms"] == 25.0
    assert spec.comparisons[1].tolerances() == {"median_ttft_ms": 3.0}


def test_a_runs_configuration_resolves_its_references(tmp_path):
    spec = load_campaign(write(tmp_path, GOOD))
    model = next(r for r in plan_runs(spec) if r.arm == "model")
    values = {"folder": "/x/hybrid", "request_throughput": 30.0}
    tree = run_config(spec, {}, model, lambda rid, field: values[field] if "hybrid" in rid or field != "folder" else 0)
    assert tree["mode"] == "model" and tree["seed"] == 1001 and tree["workload"]["seed"] == 1001
    assert tree["policy"]["name"] == "sglang"
    assert tree["workload"]["arrival"]["rate"] == 15.0  # the arm's set replaces the campaign's
    assert tree["costs"]["grammar_profile"] == "/x/hybrid/grammar_profile.json"
    hybrid = next(r for r in plan_runs(spec) if r.arm == "hybrid" and r.cell.as_dict()["load"] == 1)
    assert run_config(spec, {}, hybrid, lambda *_: None)["workload"]["arrival"]["rate"] == 10


def test_listed_cells_expand_their_list_values_and_a_layout_names_folders(tmp_path):
    spec = load_campaign(write(tmp_path, """
name: t
cells:
  - {policy.name: [sglang, vllm], scheduler.overlap: true, kind_weights: [[1, 2]]}
arms: {live: {mode: live, copies: 2}, model: {mode: model}}
layout: "{policy}-overlap_{overlap}-{arm}{copy_suffix}"
"""))
    assert [r.run_id for r in plan_runs(spec)] == [
        "sglang-overlap_true-live-a", "sglang-overlap_true-live-b", "sglang-overlap_true-model",
        "vllm-overlap_true-live-a", "vllm-overlap_true-live-b", "vllm-overlap_true-model"]
    assert run_id(spec, "live", Cell((("policy.name", "x"), ("scheduler.overlap", False), ("kind_weights", [1]))),
                  0, 2) == "x-overlap_false-live-b"


def test_only_limits_an_arm_to_some_cells_and_campaign_folder_is_absolute(tmp_path):
    spec = load_campaign(write(tmp_path, """
name: t
cells: {share: [0.5, 1.0], threads: [1, 8]}
arms:
  base: {mode: model}
  ipc: {mode: model, only: {share: [1.0], threads: [8]}, set: {costs.spec_store: "${campaign_folder}/store"}}
"""))
    runs = plan_runs(spec)
    assert [r.run_id for r in runs if r.arm == "ipc"] == ["share=1.0,threads=8/seed0/ipc-1"]
    assert sum(r.arm == "base" for r in runs) == 4
    tree = run_config(spec, {}, runs[-1], lambda *_: None, tmp_path / "out")
    assert tree["costs"]["spec_store"] == f"{(tmp_path / 'out').resolve()}/store"


def test_arithmetic_and_lone_references():
    assert evaluate("= round_sig(0.9 * 26.65682195993375, 4)", "x") == 23.99
    assert resolve("${n}", {"n": [1, 2]}, {}, lambda *_: None, "x") == [1, 2]  # a lone reference keeps its type
    assert resolve("a-${n}", {"n": 3}, {}, lambda *_: None, "x") == "a-3"
    with pytest.raises(ConfigError, match="is not arithmetic"):
        evaluate("= __import__('os')", "arms.m.set.rate")
    with pytest.raises(ConfigError, match="cannot be evaluated"):
        evaluate("= 1 / 0", "arms.m.set.rate")


def test_references_read_another_runs_live_json_and_nested_summary_values(tmp_path):
    """What a model arm priced from a live run's ranks reads: live.json's measured agreement and spread."""
    spec = load_campaign(write(tmp_path, """
name: t
arms:
  live: {mode: live}
  model:
    mode: model
    set: {scheduler.all_gather_s: "${live.live.ranks.all_gather_s.p50}", scheduler.rank_jitter: "= 2 * ${live.live.ranks.compile_sigma}",
          costs.grammar_profile: "${live.folder}/grammar_profile.json", workload.seed: "${live.spec_costs.seed}"}
"""))
    out = tmp_path / "out"
    live = out / "all/seed0/live-1"
    live.mkdir(parents=True)
    (live / "summary.json").write_text('{"request_throughput": 3.5, "spec_costs": {"seed": 7}}')
    (live / "live.json").write_text('{"device": "NVIDIA H200", "ranks": {"all_gather_s": {"p50": 0.0007}, '
                                    '"compile_sigma": 0.25}}')
    model = next(r for r in plan_runs(spec) if r.arm == "model")
    tree = run_config(spec, {}, model, folder_lookup(out))
    assert tree["scheduler"] == {"all_gather_s": 0.0007, "rank_jitter": 0.5}
    assert tree["workload"]["seed"] == 7 and tree["costs"]["grammar_profile"] == f"{live.resolve()}/grammar_profile.json"
    lookup = folder_lookup(out)
    assert lookup("all/seed0/live-1", "live.device") == "NVIDIA H200"
    with pytest.raises(ConfigError, match=r"live\.json has no 'ranks\.all_reduce_s' \(no 'all_reduce_s'\)"):
        lookup("all/seed0/live-1", "live.ranks.all_reduce_s")
    with pytest.raises(ConfigError, match=r"summary\.json has no 'capacity'"):
        lookup("all/seed0/live-1", "capacity")
    (live / "live.json").unlink()
    with pytest.raises(ConfigError, match=r"run all/seed0/live-1 has no live\.json \(only live runs write one\)"):
        lookup("all/seed0/live-1", "live.device")


def test_a_reference_may_name_another_copy_of_an_arm(tmp_path):
    """``${live@c.folder}``: the third copy's run, which the model run then waits for; no ``@``, the first."""
    spec = load_campaign(write(tmp_path, """
name: t
arms:
  live: {mode: live, copies: 3}
  model:
    mode: model
    set: {costs.rank_costs: "live-run:${live@c.folder}", costs.grammar_profile: "${live.folder}/grammar_profile.json",
          scheduler.all_gather_s: "= 2 * ${live@b.live.ranks.all_gather_s.p50}"}
layout: "{arm}{copy_suffix}"
"""))
    model = next(r for r in plan_runs(spec) if r.arm == "model")
    assert set(model.depends) == {"live-a", "live-b", "live-c"}
    out = tmp_path / "out"
    for copy, sigma in zip("abc", (1.0, 2.0, 3.0), strict=True):
        (out / f"live-{copy}").mkdir(parents=True)
        (out / f"live-{copy}" / "summary.json").write_text("{}")
        (out / f"live-{copy}" / "live.json").write_text(f'{{"ranks": {{"all_gather_s": {{"p50": {sigma}}}}}}}')
    tree = run_config(spec, {}, model, folder_lookup(out))
    assert tree["costs"] == {"rank_costs": f"live-run:{(out / 'live-c').resolve()}",
                             "grammar_profile": f"{(out / 'live-a').resolve()}/grammar_profile.json"}
    assert tree["scheduler"]["all_gather_s"] == 4.0


def test_later_copies_of_an_arm_wait_for_the_arms_it_names(tmp_path):
    """Copy b and c of ``live`` wait for every copy of ``store`` in their cell; copy a and the other cells' runs
    do not; a run's configuration refers to nothing more for it."""
    spec = load_campaign(write(tmp_path, """
name: t
cells: {load: [1, 2]}
arms:
  live: {mode: live, copies: 3, later_copies_after: [store]}
  store: {mode: model, copies: 2, only: {load: [1]}}
layout: "{cell}/{arm}{copy_suffix}"
"""))
    runs = {r.run_id: r for r in plan_runs(spec)}
    assert runs["load=1/live-a"].waits_for == ()
    for copy in "bc":
        assert runs[f"load=1/live-{copy}"].waits_for == ("load=1/store-a", "load=1/store-b")
        assert runs[f"load=2/live-{copy}"].waits_for == ()  # no store runs in that cell
        assert runs[f"load=1/live-{copy}"].depends == ()


@pytest.mark.parametrize(("text", "message"), [
    ("name: t\narms: {a: {mode: model, set: {x: '${b@c.folder}'}}, b: {mode: live, copies: 2}}",
     r"arm a: set\.x refers to copy c of arm b, which has 2"),
    ("name: t\ncells: {load: [1]}\narms: {a: {mode: model, set: {x: '${load@b}'}}}", r"names a copy of \$\{load\}"),
    ("name: t\narms: {a: {mode: modle}}", r"arms\.a\.mode"),
    ("name: t\narms: {a: {mode: model, copies: 0}}", r"arms\.a\.copies"),
    ("name: t\narms: {a: {mode: model, colour: red}}", r"arms\.a\.colour"),
    ("name: t\narms: {}", r"arms"),
    ("name: t\narms: {a: {mode: model, set: {x: '${b.folder}'}}}", r"arm a: set\.x refers to arm 'b', which is not an arm"),
    ("name: t\narms: {a: {mode: model, set: {x: '${load}'}}}", r"\$\{load\}, which is neither a cell variable"),
    ("name: t\narms: {a: {mode: model, set: {x: '${b.folder}'}}, b: {mode: model, set: {x: '${a.folder}'}}}",
     r"cycle: a -> b -> a"),
    ("name: t\narms: {a: {mode: live, copies: 2, later_copies_after: [z]}}",
     r"arm a: later_copies_after names 'z', which is not another arm"),
    ("name: t\narms: {a: {mode: live, later_copies_after: [b]}, b: {mode: model}}",
     r"arm a: later_copies_after needs copies >= 2"),
    ("name: t\narms: {a: {mode: live, copies: 2, later_copies_after: [b]}, "
     "b: {mode: model, set: {x: '${a@b.folder}'}}}",
     r"runs wait for each other in a cycle: a@b -> b@a -> a@b"),
    ("name: t\ncells: {load: [1], rate: [2]}\narms: {a: {mode: live, copies: 2, over: [load], "
     "later_copies_after: [b]}, b: {mode: model}}", r"later_copies_after names b, which varies with axes a does not"),
    ("name: t\narms: {a: {mode: model}}\ncomparisons: [{name: c, reference: a, runs: [z]}]",
     r"comparison c: 'z' is not an arm"),
    ("name: t\narms: {a: {mode: model}}\ncomparisons: [{name: c, reference: a, runs: [a], noise: a}]",
     r"noise arm a needs copies >= 2"),
    ("name: t\narms: {a: {mode: model}}\ncomparisons: [{name: c, reference: a, runs: [a], bar: loose}]",
     r"comparisons\.0\.bar.*'loose' is not a named bar"),
    ("name: t\narms: {a: {mode: model}}\ncomparisons: [{name: c, reference: a, runs: [a], bar: {p99_tft_ms: 5}}]",
     r"p99_tft_ms"),
    ("name: t\ncells: {load: []}\narms: {a: {mode: model}}", r"axis 'load' has no values"),
    ("name: t\ncells: {load: [1]}\narms: {a: {mode: model, over: [rate]}}", r"over or only names 'rate'"),
    ("name: t\narms: {a: {mode: model}}\nlayout: '{arm}'", r"layout must hold \{arm\} and one of"),
    ("name: t\narms: [a]", r"arms"),
])
def test_a_bad_file_gets_one_line_naming_the_field(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_campaign(write(tmp_path, text))
    assert "\n" not in str(err.value)
    assert "c.yaml" in str(err.value)


def test_folders_two_runs_would_share_are_refused(tmp_path):
    spec = load_campaign(write(tmp_path, "name: t\ncells: {load: [1, 2]}\narms: {a: {mode: model}}\n"
                                         "layout: '{arm}-{copy}'"))
    with pytest.raises(ConfigError, match="two runs would share the folder a-1"):
        plan_runs(spec)


def test_not_yaml_and_missing_files_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_campaign(write(tmp_path, "name: [t"))
    with pytest.raises(ConfigError):
        load_campaign(tmp_path / "missing.yaml")


def test_the_shipped_campaign_files_parse():
    files = sorted((Path(__file__).parents[2] / "campaigns").glob("*.yaml"))
    assert files
    for path in files:
        spec = load_campaign(path)
        base = base_config(spec.base, path)
        for run in plan_runs(spec):  # every run's configuration is a valid RunConfig
            tree = run_config(spec, base, run, lambda rid, field: "/x" if field == "folder" else 1.0, Path("/x"))
            validate_config(RunConfig, tree, f"{path.name}: {run.run_id}")


def test_the_ranks_campaign_pack_holds_every_live_copy_and_the_records_its_arms_price_from():
    """campaigns/ranks_vs_model.yaml: its committed pack holds every live copy the file plans (the model arms
    are rerun from them), the tensor-parallel copies the arms price the ranks from (live-b) keep every rank's
    own records, and every arm priced from live-b waits for it."""
    from cdbench.results.pack import Pack

    repo = Path(__file__).resolve().parents[2]
    spec = load_campaign(repo / "campaigns/ranks_vs_model.yaml")
    runs = {r.run_id: r for r in plan_runs(spec)}
    pack = Pack(repo / "reports/fidelity/live_vs_model/ranks_vs_model.pack")
    live = sorted(rid for rid, r in runs.items() if spec.arms[r.arm].mode == "live")
    assert sorted(pack.run_ids) == live and len(live) == 24
    for rid in live:
        if "-tp2-live-b" in rid:
            assert pack.open(rid).read_file("rank_steps.parquet") is not None, rid
        if rid.endswith("-live-a"):
            assert pack.open(rid).read_file("grammar_profile.json") is not None, rid
    for rid, run in runs.items():
        if run.arm in ("model-tp", "speed-tp", "speed-dp"):
            cell, arm_copy = rid.rsplit("-", 2)[0], rid.rsplit("-", 2)[1:]
            assert f"{cell}-live-b" in run.depends, rid
            assert arm_copy[0] in ("model", "speed") and len(arm_copy[1]) == 1
