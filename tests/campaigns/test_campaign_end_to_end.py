"""A tiny campaign on the CPU, end to end: run, resume (nothing to run), report, pack, report from the pack."""

import json
import shutil

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from cdbench.campaigns.report import verdicts, write_campaign_report
from cdbench.campaigns.spec import load_campaign
from cdbench.cli.app import app
from cdbench.results.resolution import ITL_FIGURES, RESOLVED_FIGURES

runner = CliRunner()

TINY = """
name: tiny
base: ci
set: {workload.num_requests: 24}
seeds: [3]
cells: {policy.name: [sglang]}
arms:
  model-a: {mode: model, copies: 2}
  model-b: {mode: model, copies: 2, set: {scheduler.overlap: false, seed: "=${seed}+${copy}-1"}}
comparisons:
  - {name: b-vs-a, reference: model-a, runs: [model-b], noise: model-a}
runner: {jobs: 2}
"""


def test_run_resume_report_pack_and_report_from_the_pack(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    out = tmp_path / "out"
    first = runner.invoke(app, ["campaign", "run", str(spec), "--out", str(out)])
    assert first.exit_code == 0, first.output
    assert "(4 run, 0 already done, 0 not done)" in first.output
    runs = sorted(p.parent.relative_to(out).as_posix() for p in out.rglob("summary.json"))
    assert runs == [f"policy=sglang/seed3/{arm}-{copy}" for arm in ("model-a", "model-b") for copy in (1, 2)]

    again = runner.invoke(app, ["campaign", "run", str(spec), "--out", str(out)])
    assert again.exit_code == 0, again.output
    assert "(0 run, 4 already done, 0 not done)" in again.output

    report = runner.invoke(app, ["campaign", "report", str(spec), "--out", str(out)])
    assert report.exit_code == 0, report.output
    md = (out / "report" / "campaign.md").read_text()
    assert "## b-vs-a: model-b against model-a" in md and "| policy | run | median_ttft_ms" in md
    assert "Cells passing: " in md and "figures within their bar: " in md
    fidelity_md = (out / "report" / "b-vs-a" / "policy=sglang" / "fidelity.md").read_text()
    assert "`model-b`: the median of 2 copies' figures" in fidelity_md
    # model-b's copies: one workload (seed 3), the model's own draws from seeds 3 and 4
    configs = [yaml.safe_load((out / f"policy=sglang/seed3/model-b-{c}/config.yaml").read_text()) for c in (1, 2)]
    assert [c["seed"] for c in configs] == [3, 4] and {c["workload"]["seed"] for c in configs} == {3}
    frame = pd.read_csv(out / "report" / "campaign.csv")
    ttft = frame[(frame["run"] == "model-b") & (frame["metric"] == "median_ttft_ms")].iloc[0]
    summaries = [json.loads((out / f"policy=sglang/seed3/{arm}/summary.json").read_text())["median_ttft_ms"]
                 for arm in ("model-a-1", "model-b-1", "model-b-2")]
    errors = sorted((v - summaries[0]) / summaries[0] * 100 for v in summaries[1:])
    assert ttft["copies"] == 2 and ttft["spread_min_pct"] == pytest.approx(errors[0])
    assert ttft["spread_max_pct"] == pytest.approx(errors[1])
    assert ttft["error_pct"] == pytest.approx((sum(summaries[1:]) / 2 - summaries[0]) / summaries[0] * 100)
    assert f"[{errors[0]:+.1f}..{errors[1]:+.1f}]" in md
    # model mode is deterministic: model-a's copies agree exactly, so the noise floor is 0
    assert ttft["noise_pct"] == 0
    # per-request figures' errors carry their interval over paired resamples of the requests; ITL and throughput none
    assert "Unresolved: an error beyond its bar" in fidelity_md
    for _, row in frame[frame["run"] == "model-b"].iterrows():
        banded = pd.notna(row["interval_low_pct"])
        # per-request figures always; ITL where the steps rebuild the runs' own gaps; nothing else
        assert banded if row["metric"] in RESOLVED_FIGURES else (not banded or row["metric"] in ITL_FIGURES)
        if banded:
            assert row["interval_low_pct"] <= row["error_pct"] <= row["interval_high_pct"], row["metric"]
            reaches = row["interval_low_pct"] <= row["allowed_pct"] and row["interval_high_pct"] >= -row["allowed_pct"]
            assert bool(row["unresolved"]) == (row["verdict"] == "beyond" and reaches), row["metric"]
    csv = (out / "report" / "campaign.csv").read_text()
    assert ",model-b," in csv and ",median_ttft_ms," in csv
    runs_csv = (out / "report" / "runs.csv").read_text().splitlines()
    assert runs_csv[0].startswith("policy.name,seed,arm,copy,run_id,") and len(runs_csv) == 5

    pack = tmp_path / "tiny.pack"
    packed = runner.invoke(app, ["campaign", "pack", str(spec), str(pack), "--out", str(out)])
    assert packed.exit_code == 0, packed.output
    assert "(4 runs)" in packed.output
    from_pack = runner.invoke(app, ["campaign", "report", str(spec), "--pack", str(pack),
                                    "--report", str(tmp_path / "from-pack")])
    assert from_pack.exit_code == 0, from_pack.output
    assert (tmp_path / "from-pack" / "campaign.md").read_text() == md
    assert (tmp_path / "from-pack" / "campaign.csv").read_text() == csv
    assert (tmp_path / "from-pack" / "runs.csv").read_text().splitlines() == runs_csv


def test_a_failing_run_is_reported_and_the_others_still_run(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("""
name: bad
base: ci
set: {workload.num_requests: 12}
arms:
  good: {mode: model}
  broken: {mode: model, set: {scheduler.no_such_setting: 1}}
  after-broken: {mode: model, set: {workload.arrival.rate: "${broken.request_throughput}"}}
""")
    result = runner.invoke(app, ["campaign", "run", str(spec), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "(1 run, 0 already done, 2 not done)" in result.output
    assert "failed all/seed0/broken-1" in " ".join(result.output.split())
    assert "blocked all/seed0/after-broken-1: needs run all/seed0/broken-1, which failed" in " ".join(result.output.split())
    assert (tmp_path / "out" / "all" / "seed0" / "good-1" / "summary.json").is_file()


def test_a_finished_run_whose_configuration_changed_is_refused(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text("name: c\nbase: ci\nset: {workload.num_requests: 12}\narms: {a: {mode: model}}\n")
    assert runner.invoke(app, ["campaign", "run", str(spec), "--out", str(tmp_path / "out")]).exit_code == 0
    spec.write_text("name: c\nbase: ci\nset: {workload.num_requests: 13}\narms: {a: {mode: model}}\n")
    changed = runner.invoke(app, ["campaign", "run", str(spec), "--out", str(tmp_path / "out")])
    assert changed.exit_code == 2
    assert "finished run all/seed0/a-1 was made from another configuration" in " ".join(changed.output.split())


def test_a_folder_of_runs_made_before_campaigns_is_adopted_only_when_asked(tmp_path):
    spec, out = tmp_path / "c.yaml", tmp_path / "out"
    spec.write_text("name: c\nbase: ci\nset: {workload.num_requests: 12}\narms: {a: {mode: model}, b: {mode: model}}\n")
    assert runner.invoke(app, ["campaign", "run", str(spec), "--out", str(out)]).exit_code == 0
    # what a folder of runs made by hand looks like: the runs as cdbench run wrote them, and nothing of a campaign
    shutil.rmtree(out / ".campaign")
    shutil.rmtree(out / "all/seed0/b-1")
    (out / ".cdbench.json").unlink()
    (out / "notes.txt").write_text("how these runs were made\n")
    summary = (out / "all/seed0/a-1/summary.json").read_text()
    spec.write_text("name: c\nbase: ci\nset: {workload.num_requests: 13}\narms: {a: {mode: model}, b: {mode: model}}\n")

    refused = runner.invoke(app, ["campaign", "run", str(spec), "--out", str(out)])
    assert refused.exit_code == 2
    assert "holds 1 of the campaign's runs made before campaigns (e.g. all/seed0/a-1) but no campaign marker; " \
           "--adopt takes them as finished runs" in " ".join(refused.output.split())
    assert not (out / ".cdbench.json").exists() and not (out / "all/seed0/b-1").exists()  # refused before claiming

    adopted = runner.invoke(app, ["campaign", "run", str(spec), "--out", str(out), "--adopt"])
    assert adopted.exit_code == 0, adopted.output
    text = " ".join(adopted.output.split())
    assert "adopted all/seed0/a-1; its config differs from the file's in workload.num_requests" in text
    assert "(1 run, 1 already done, 0 not done)" in text
    assert (out / "all/seed0/a-1/summary.json").read_text() == summary and (out / "notes.txt").is_file()
    assert (out / "all/seed0/b-1/summary.json").is_file() and (out / ".cdbench.json").is_file()
    again = runner.invoke(app, ["campaign", "run", str(spec), "--out", str(out)])  # now the campaign's folder
    assert again.exit_code == 0 and "(0 run, 2 already done, 0 not done)" in " ".join(again.output.split())


def test_adopt_refuses_a_folder_it_cannot_take_in_one_line(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text("name: c\nbase: ci\nset: {workload.num_requests: 12}\narms: {a: {mode: model}}\n")
    missing = runner.invoke(app, ["campaign", "run", str(spec), "--out", str(tmp_path / "none"), "--adopt"])
    assert missing.exit_code == 2 and "is missing, empty or already a cdbench command's folder" in missing.output
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not runs\n")
    unrelated = runner.invoke(app, ["campaign", "run", str(spec), "--out", str(other), "--adopt"])
    assert unrelated.exit_code == 2
    assert "holds none of the campaign's runs at the folders its layout gives (e.g. all/seed0/a-1)" in \
        " ".join(unrelated.output.split())
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    own = tmp_path / "own"
    assert runner.invoke(app, ["campaign", "run", str(spec), "--out", str(own)]).exit_code == 0
    again = runner.invoke(app, ["campaign", "run", str(spec), "--out", str(own), "--adopt"])
    assert again.exit_code == 2 and "a campaign's own folder resumes without --adopt" in " ".join(again.output.split())


def test_a_run_that_stopped_early_is_not_judged(tmp_path):
    spec, out = tmp_path / "c.yaml", tmp_path / "out"
    spec.write_text("name: c\nbase: ci\nset: {workload.num_requests: 12}\narms: {a: {mode: model}, b: {mode: model}}\n"
                    "comparisons: [{name: b-vs-a, reference: a, runs: [b]}]\n")
    assert runner.invoke(app, ["campaign", "run", str(spec), "--out", str(out)]).exit_code == 0
    folder = out / "all/seed0/b-1"
    summary = json.loads((folder / "summary.json").read_text())
    summary["run_status"] = {"status": "failed", "reason": "boom", "requests_done": 5, "requests_total": 12}
    (folder / "summary.stopped.json").write_text(json.dumps(summary))
    (folder / "summary.json").unlink()
    result = runner.invoke(app, ["campaign", "report", str(spec), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "cells passing 0 of 0" in result.output  # an incomplete judgement is listed, not counted
    md = " ".join((out / "report/campaign.md").read_text().split())
    assert "all/seed0/b-1 holds a run that stopped early (failed (boom) after 5 of 12 requests)" in md


def test_an_unresolved_figure_is_marked_and_counted_but_still_fails(tmp_path):
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(TINY)
    spec = load_campaign(spec_file)
    base = {"policy.name": "sglang", "seed": 3, "comparison": "b-vs-a", "run": "model-b", "noise_pct": 0.0,
            "tolerance_pct": 10.0, "spread_min_pct": None, "spread_max_pct": None, "requests_to_resolve": None}
    frame = pd.DataFrame([
        {**base, "metric": "p99_ttft_ms", "error_pct": 14.0, "verdict": "beyond", "unresolved": True,
         "interval_low_pct": 2.5, "interval_high_pct": 31.0, "requests_to_resolve": 190},
        {**base, "metric": "p99_tpot_ms", "error_pct": 2.0, "verdict": "within", "unresolved": False},
    ])
    assert verdicts(spec, frame)["b-vs-a"] == (0, 1, 1, 2, 1)
    md = write_campaign_report(spec, frame, pd.DataFrame({"arm": []}), tmp_path / "r").read_text()
    assert "**+14.0** ✗ (unresolved: +2.5..+31.0, ~190 requests)" in md and "| no |" in md
    assert "figures within their bar: 1 of 2; of the others, 1 unresolved" in md
