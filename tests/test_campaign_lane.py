"""benchmarks/campaign_lane.py: one lane of a campaign's live runs loads as a campaign of those runs alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

from cdbench.campaigns.plan import plan_runs
from cdbench.campaigns.spec import load_campaign

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("campaign_lane", REPO / "benchmarks" / "campaign_lane.py")
campaign_lane = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(campaign_lane)


def _lane(tmp_path, campaign: str, filters: dict[str, str], live_copies: int | None = None):
    source = yaml.safe_load((REPO / "campaigns" / campaign).read_text())
    path = tmp_path / "lane.yaml"
    path.write_text(yaml.safe_dump(campaign_lane.lane(source, filters, live_copies=live_copies), sort_keys=False))
    return plan_runs(load_campaign(path))


def test_a_lane_holds_the_matching_cells_live_copies_alone(tmp_path):
    runs = _lane(tmp_path, "model_family_vs_model.yaml", {"costs.model": "qwen3.5-35b-a3b", "load": "under"})
    # a cell's list axis narrowed to the filter's value; the model arm left to the campaign
    assert [r.run_id for r in runs] == ["qwen3.5-35b-a3b/under-8-live-a", "qwen3.5-35b-a3b/under-8-live-b"]
    tp = _lane(tmp_path, "ranks_under_vs_model.yaml", {"scheduler.parallel": "tp", "workload": "json"})
    assert [r.run_id for r in tp] == [f"under/json-tp2-live-{c}" for c in "abc"]
    source = yaml.safe_load((REPO / "campaigns" / "ranks_under_vs_model.yaml").read_text())
    assert campaign_lane.lane(source, {"workload": "none"})["cells"] == []


def test_a_lane_of_one_live_copy_runs_one_copy_of_the_narrowed_cell(tmp_path):
    runs = _lane(tmp_path, "ranks_under_long_vs_model.yaml", {"workload": "json", "workload.num_requests": "1000"},
                 live_copies=1)
    assert [r.run_id for r in runs] == ["under/json-1000-tp2-live"]
    assert runs[0].cell.as_dict()["workload.num_requests"] == 1000


def test_a_lane_keeps_later_copies_waiting_only_for_arms_it_runs(tmp_path):
    source = {"name": "t", "cells": [{"policy.name": ["sglang", "vllm"]}],
              "arms": {"live": {"mode": "live", "copies": 2, "later_copies_after": ["store"]},
                       "store": {"mode": "model"}, "other": {"mode": "model"}}}
    kept = campaign_lane.lane(source, {"policy.name": "vllm"}, frozenset({"store"}))
    assert kept["arms"]["live"]["later_copies_after"] == ["store"]
    alone = campaign_lane.lane(source, {"policy.name": "vllm"})
    assert "later_copies_after" not in alone["arms"]["live"]
    one = campaign_lane.lane(source, {"policy.name": "vllm"}, frozenset({"store"}), live_copies=1)
    assert "later_copies_after" not in one["arms"]["live"]
    for i, written in enumerate((kept, alone, one)):
        path = tmp_path / f"lane{i}.yaml"
        path.write_text(yaml.safe_dump(written, sort_keys=False))
        assert plan_runs(load_campaign(path))
