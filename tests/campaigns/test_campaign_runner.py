"""The campaign runner's placement: core pinning, lanes, jobs, dependencies and the deadline.

The runs are a small script standing in for ``cdbench run`` (``run_campaign`` takes the command to run), which
records the cores it was pinned to and when it ran, so placement is checked without simulating anything.
"""

import json
import os
import sys
import textwrap

import pytest

from cdbench.campaigns.execute import run_campaign
from cdbench.campaigns.plan import plan_runs
from cdbench.campaigns.spec import CampaignSpec

STAND_IN = textwrap.dedent("""
    import json, os, sys, time, yaml
    config, folder = sys.argv[2], sys.argv[4]
    tree = yaml.safe_load(open(config))
    start = time.time()
    time.sleep(tree.get("sleep", 0.3))
    os.makedirs(folder, exist_ok=True)
    summary = {"cores": sorted(os.sched_getaffinity(0)), "start": start, "end": time.time(),
               "omp": os.environ.get("OMP_NUM_THREADS"), "rate": tree.get("rate")}
    json.dump(summary, open(os.path.join(folder, "summary.json"), "w"))
""")


def campaign(tmp_path, deadline_s=None, **fields):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    spec = CampaignSpec.model_validate({"name": "t", **fields})
    out = tmp_path / "out"
    outcomes = run_campaign(spec, {}, plan_runs(spec), out, [sys.executable, str(script)],
                            deadline_s=deadline_s)
    summaries = {o.run.run_id: json.loads((out / o.run.run_id / "summary.json").read_text())
                 for o in outcomes if o.status == "done"}
    return outcomes, summaries


def overlaps(a, b):
    return a["start"] < b["end"] and b["start"] < a["end"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning two runs apart needs two cores")
def test_pinned_runs_get_cores_of_their_own_and_one_thread(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    outcomes, runs = campaign(tmp_path, arms={"a": {"mode": "model", "copies": 2}},
                              runner={"jobs": 2, "pin": True, "first_core": cores[0]})
    assert [o.status for o in outcomes] == ["done", "done"]
    first, second = runs.values()
    assert len(first["cores"]) == 1 and len(second["cores"]) == 1
    if overlaps(first, second):  # side by side, so on different cores
        assert first["cores"] != second["cores"]
    assert first["omp"] == "1"


def test_runs_of_one_lane_go_one_at_a_time(tmp_path):
    _, runs = campaign(tmp_path, arms={"live": {"mode": "live", "copies": 3, "lane": "gpu"}}, runner={"jobs": 3})
    spans = list(runs.values())
    assert len(spans) == 3
    assert not any(overlaps(a, b) for i, a in enumerate(spans) for b in spans[i + 1:])


def test_a_run_waits_for_the_runs_it_refers_to_and_reads_their_summary(tmp_path):
    _, runs = campaign(tmp_path, arms={"first": {"mode": "model"},
                                       "second": {"mode": "model", "set": {"rate": "= 2 * ${first.end}"}}},
                       runner={"jobs": 2})
    first, second = runs["all/seed0/first-1"], runs["all/seed0/second-1"]
    assert second["start"] >= first["end"]
    assert second["rate"] == 2 * first["end"]


def test_the_deadline_stops_starting_runs(tmp_path):
    outcomes, _ = campaign(tmp_path, arms={"a": {"mode": "model", "copies": 3, "set": {"sleep": 2.0}}},
                           runner={"jobs": 1}, deadline_s=0.5)
    assert [o.status for o in outcomes] == ["failed", "not started", "not started"]
    assert "deadline" in outcomes[0].error


def test_an_arm_wider_than_the_machine_is_refused_only_while_it_has_runs_to_do(tmp_path):
    """A GPU host's finished live runs (more cores a run than this machine has) do not stop the other arms."""
    from cdbench.results.config_files import ConfigError

    wide = len(os.sched_getaffinity(0)) + 1
    fields = dict(arms={"live": {"mode": "live", "cores": wide}, "model": {"mode": "model"}},
                  runner={"jobs": 1, "pin": True, "first_core": min(os.sched_getaffinity(0))})
    with pytest.raises(ConfigError, match=f"arm live needs {wide} cores a run"):
        campaign(tmp_path, **fields)
    finished = tmp_path / "out" / "all" / "seed0" / "live-1"
    finished.mkdir(parents=True)
    (finished / "summary.json").write_text("{}")
    outcomes, runs = campaign(tmp_path, **fields)
    assert {o.run.arm: o.status for o in outcomes} == {"live": "skipped", "model": "done"}


def test_later_copies_wait_for_the_named_arms_whatever_their_outcome(tmp_path):
    """``later_copies_after``: the first copy runs beside the named arm, the second only once it has ended, and a
    failure of the named arm does not block the copy (the floor is what it is for)."""
    _, runs = campaign(tmp_path, arms={"live": {"mode": "live", "copies": 2, "later_copies_after": ["store"]},
                                       "store": {"mode": "model", "set": {"sleep": 0.6}}},
                       runner={"jobs": 3})
    first, second, store = runs["all/seed0/live-1"], runs["all/seed0/live-2"], runs["all/seed0/store-1"]
    assert overlaps(first, store)
    assert second["start"] >= store["end"]
    one_at_a_time = tmp_path / "one"
    one_at_a_time.mkdir()
    _, runs = campaign(one_at_a_time, arms={"live": {"mode": "live", "copies": 2, "later_copies_after": ["store"]},
                                            "store": {"mode": "model"}}, runner={"jobs": 1})
    first, second, store = runs["all/seed0/live-1"], runs["all/seed0/live-2"], runs["all/seed0/store-1"]
    assert first["end"] <= store["start"] and store["end"] <= second["start"]  # the store between the copies
    failing = tmp_path / "failing"
    failing.mkdir()
    outcomes, runs = campaign(failing, arms={"live": {"mode": "live", "copies": 2, "later_copies_after": ["store"]},
                                             "store": {"mode": "model", "set": {"sleep": "not a number"}}},
                              runner={"jobs": 2})
    assert {o.run.run_id: o.status for o in outcomes} == {
        "all/seed0/live-1": "done", "all/seed0/live-2": "done", "all/seed0/store-1": "failed"}
