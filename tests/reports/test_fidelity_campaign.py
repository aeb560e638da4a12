"""The campaign script's evaluation and report (scripts/fidelity_campaign.py), on synthetic run folders."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pandas as pd
import pytest
from synthetic_run import write_synthetic_run

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fidelity_campaign.py"
_spec = importlib.util.spec_from_file_location("fidelity_campaign", _SCRIPT)
campaign = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = campaign  # its dataclasses look their module up while being defined
_spec.loader.exec_module(campaign)

BASE = {"median_ttft_ms": 20.0, "median_tpot_ms": 10.0, "request_throughput": 5.0, "p99_ttft_ms": 100.0,
        "p99_tpot_ms": 30.0, "p99_itl_ms": 40.0, "mask_share": 0.1}


def _run(folder: Path, rate: float, seed: int = 1, **scaled: float) -> None:
    summary = {**BASE, **{m: BASE[m] * f for m, f in scaled.items()}}
    write_synthetic_run(folder, summary=summary)
    (folder / "config.yaml").write_text(f"mode: model\nworkload:\n  seed: {seed}\n  arrival:\n    rate: {rate}\n")


def _capacity(group: Path) -> None:
    """The group's finished saturating run, as the campaign reads it: 10 requests/s."""
    (group / "capacity").mkdir(parents=True)
    (group / "capacity" / "summary.json").write_text(json.dumps({"request_throughput": 10.0}))


def test_cells_are_judged_against_their_bars_and_incomplete_groups_are_listed(tmp_path):
    out = tmp_path / "campaign"
    group = out / "xgrammar-sglang-default"
    _capacity(group)
    cell = group / "load0.5"
    _run(cell / "hybrid-a", 5.0)
    _run(cell / "hybrid-b", 5.0, median_ttft_ms=1.01)
    _run(cell / "model-own", 5.0, median_ttft_ms=1.04, p99_ttft_ms=0.92)  # within 5 % and 10 %
    _run(cell / "model-shipped", 5.0, p99_ttft_ms=0.5)  # -50 %: beyond the shipped bar of 25 %
    (out / "outlines-vllm-github_medium" / "capacity").mkdir(parents=True)  # its capacity run never finished

    frame = campaign.evaluate(out)
    own = frame[(frame["comparison"] == "model-own") & (frame["metric"] == "median_ttft_ms")].iloc[0]
    assert own["error_pct"] == pytest.approx(4.0) and own["verdict"] == "within" and own["rate_rps"] == 5.0
    assert own["noise_pct"] == pytest.approx(1.0) and own["capacity_rps"] == 10.0
    shipped = frame[(frame["comparison"] == "model-shipped") & (frame["metric"] == "p99_ttft_ms")].iloc[0]
    assert shipped["tolerance_pct"] == 25.0 and shipped["verdict"] == "beyond"
    assert (cell / "fidelity-own" / "fidelity.md").is_file() and (cell / "fidelity-shipped" / "fidelity.csv").is_file()

    md = campaign.write_report(frame, out, tmp_path / "report", "python scripts/fidelity_campaign.py ...", None)
    text = md.read_text()
    own_part, shipped_part = text.split("## model with the shipped default profile")
    assert "Cells passing: 1 of 1; figures within their bar: 6 of 6." in own_part
    assert "| xgrammar | sglang | default | 0.5 | 5 | +4.0 | +0.0 | +0.0 | -8.0 | +0.0 | +0.0 | yes |" in own_part
    assert "Cells passing: 0 of 1" in shipped_part and "**-50.0** ✗" in shipped_part
    assert "incomplete: outlines/vllm/github_medium/every load" in text and "did not finish" in text
    assert len(pd.read_csv(tmp_path / "report" / "campaign.csv")) == len(frame)


def _planned(tmp_path: Path, *options: str) -> dict[str, campaign.Job]:
    """Every run one group plans, by its folder below the group, the capacity run having found 10 requests/s."""
    args = campaign.parse_args(["--out", str(tmp_path), "--requests", "20", "--seed", "3", "--backends", "xgrammar",
                                "--policies", "sglang", "--corpora", "default", "--loads", "0.5", *options])
    plan = campaign.plan(args, campaign.Campaign(tmp_path, 20, 3, 1, False, 0, float("inf"), ["cdbench"]))
    capacity = plan[0]
    _capacity(capacity.folder.parent)
    jobs, found = [capacity], {}
    while jobs:
        job = jobs.pop()
        found[str(job.folder.relative_to(tmp_path / "xgrammar-sglang-default"))] = job
        jobs.extend(job.then(job.folder) if job.then else [])
    return found


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_out_of_sample_runs_replay_hybrid_a_profile_on_the_other_seed(tmp_path):
    jobs = _planned(tmp_path, "--out-of-sample", "--oos-seed-offset", "10")
    assert sorted(jobs) == ["capacity", *(f"load0.5/{name}" for name in (
        "hybrid-a", "hybrid-b", "hybrid-oos", "model-oos", "model-own", "model-shipped"))]
    hybrid_a, hybrid_oos, model_oos = (jobs[f"load0.5/{n}"].args for n in ("hybrid-a", "hybrid-oos", "model-oos"))
    assert _option(hybrid_a, "--seed") == "3"
    assert _option(hybrid_oos, "--seed") == _option(model_oos, "--seed") == "13"
    assert _option(hybrid_oos, "--mode") == "hybrid" and _option(model_oos, "--mode") == "model"
    assert _option(hybrid_oos, "--rate") == _option(model_oos, "--rate") == _option(hybrid_a, "--rate") == "5"
    profile = tmp_path / "xgrammar-sglang-default" / "load0.5" / "hybrid-a" / "grammar_profile.json"
    assert _option(model_oos, "--set") == f"costs.grammar_profile={profile}"
    # the other seed's hybrid run is hybrid-a's command but for the seed; the model run waits for hybrid-a's profile
    assert [a for a in hybrid_oos if a != "13"] == [a for a in hybrid_a if a != "3"]
    assert jobs["load0.5/model-oos"] in jobs["load0.5/hybrid-a"].then(tmp_path)


def test_without_out_of_sample_the_campaign_plans_what_it_did_before(tmp_path):
    assert sorted(_planned(tmp_path)) == ["capacity", *(f"load0.5/{name}" for name in (
        "hybrid-a", "hybrid-b", "model-own", "model-shipped"))]
    with pytest.raises(SystemExit):
        campaign.parse_args(["--out", str(tmp_path), "--out-of-sample", "--oos-seed-offset", "0"])


def test_out_of_sample_cells_are_judged_against_the_other_seeds_hybrid_with_the_cells_noise(tmp_path):
    out = tmp_path / "campaign"
    group = out / "llguidance-vllm-regex_choice"
    _capacity(group)
    for load, oos_error in ((0.5, 1.07), (0.9, 1.0)):
        cell = group / f"load{load:g}"
        _run(cell / "hybrid-a", 5.0)
        _run(cell / "hybrid-b", 5.0, median_tpot_ms=1.08)  # the noise floor of median TPOT: 8 %
        _run(cell / "model-own", 5.0)
        _run(cell / "hybrid-oos", 5.0, seed=1001, median_ttft_ms=2.0, median_tpot_ms=2.0)
        _run(cell / "model-oos", 5.0, seed=1001, median_ttft_ms=2.0 * oos_error, median_tpot_ms=2.0 * oos_error)
    _run(group / "load0.9" / "model-oos", 5.0, seed=7)  # not the workload of its hybrid-oos

    assert "model-oos" not in set(campaign.evaluate(out)["comparison"])  # only when asked for
    frame = campaign.evaluate(out, out_of_sample=True)
    oos = frame[frame["comparison"] == "model-oos"].set_index(["load", "metric"])
    ttft, tpot = oos.loc[(0.5, "median_ttft_ms")], oos.loc[(0.5, "median_tpot_ms")]
    assert ttft["reference"] == 40.0 and ttft["error_pct"] == pytest.approx(7.0) and ttft["verdict"] == "beyond"
    assert tpot["noise_pct"] == pytest.approx(8.0) and tpot["verdict"] == "within" and tpot["seed"] == 1001
    assert "different workload" in oos.loc[(0.9, "")]["verdict"]
    assert (group / "load0.5" / "fidelity-oos" / "fidelity.md").is_file()

    text = campaign.write_report(frame, out, tmp_path / "report", "python scripts/fidelity_campaign.py ...",
                                 None).read_text()
    oos_part = text.split("## out of sample")[1]
    assert "Cells passing: 0 of 1; figures within their bar: 5 of 6." in oos_part
    assert "Profiles measured on seed 1, replayed (model-oos) and measured again (hybrid-oos) on seed 1001." in oos_part
    assert "| llguidance | vllm | regex_choice | 0.5 | 5 | **+7.0** ✗ | +7.0 (n 8.0) |" in oos_part
    assert "incomplete: llguidance/vllm/regex_choice/load 0.9 (model-oos)" in oos_part


def test_more_noise_copies_are_planned_and_widen_the_floor_to_their_largest_spread(tmp_path):
    assert sorted(_planned(tmp_path / "plan", "--noise-copies", "3")) == ["capacity", *(
        f"load0.5/{name}" for name in ("hybrid-a", "hybrid-b", "hybrid-c", "model-own", "model-shipped"))]
    with pytest.raises(SystemExit):
        campaign.parse_args(["--out", str(tmp_path), "--noise-copies", "1"])

    out = tmp_path / "campaign"
    group = out / "xgrammar-vllm-default"
    _capacity(group)
    cell = group / "load0.9"
    _run(cell / "hybrid-a", 9.0)
    _run(cell / "hybrid-b", 9.0, p99_tpot_ms=1.03)
    _run(cell / "hybrid-c", 9.0, p99_tpot_ms=0.8)  # this copy's spread is the floor: 20 %
    _run(cell / "model-own", 9.0, p99_tpot_ms=1.15)
    two, three = campaign.evaluate(out, copies=2), campaign.evaluate(out, copies=3)
    pick = lambda f: f[(f["comparison"] == "model-own") & (f["metric"] == "p99_tpot_ms")].iloc[0]  # noqa: E731
    assert pick(two)["noise_pct"] == pytest.approx(3.0) and pick(two)["verdict"] == "beyond"
    assert pick(three)["noise_pct"] == pytest.approx(20.0) and pick(three)["verdict"] == "within"
    text = campaign.write_report(three, out, tmp_path / "report", "python scripts/fidelity_campaign.py ...",
                                 None, copies=3).read_text()
    assert "the largest |hybrid-a vs hybrid-b / hybrid-c|" in text and "+15.0 (n 20.0)" in text


@pytest.mark.parametrize(("per_run", "sets"), [(1, ["2", "3", "4"]), (2, ["2-3", "4-5", "6-7"])])
def test_pinned_runs_get_their_own_cores_per_run(tmp_path, monkeypatch, per_run, sets):
    """With --pin each slot is its own set of consecutive cores, and a run's command starts with its taskset."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "taskset").write_text('#!/bin/sh\necho taskset "$@"\n')  # stands in: this host may lack the cores
    (bin_dir / "taskset").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run = campaign.Campaign(tmp_path, 20, 1, 3, True, 2, float("inf"), ["cdbench"], cores_per_run=per_run)
    assert run.core_sets() == sets
    job = campaign.Job(tmp_path / "cell" / "hybrid-a", ["--seed", "1"])
    run.execute([job])
    assert not job.error and job in run.finished
    assert job.log.read_text().split()[:4] == ["taskset", "-c", sets[0], "cdbench"]
    assert sorted(run._cores) == sorted(sets)  # the slot went back after the run
