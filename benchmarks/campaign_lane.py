"""Write one lane of a campaign: the cells matching KEY=VALUE filters, the live arms alone (or the arms named).

A host of several GPUs runs a campaign's live copies faster in lanes, each lane its own GPUs and cores
(``benchmarks/gpu_campaign_lanes.sh``); the lanes' run folders, copied into one folder, are then the
campaign's (``cdbench campaign run FILE --out F --adopt`` runs the model arms beside them). A cell's list
value (its own axis) is narrowed to the filter's value. Arms named after the filters are kept with the live
ones (model arms that must run on the GPU host, e.g. measuring specs on its CPU), with the campaign's runner
and its comparisons. ``--live-copies N`` runs N copies of each live arm instead of the campaign's count, so
that copies of one cell can run side by side in lanes of their own (a one-copy arm's folder has no copy
letter: name it live-a, live-b, ... when the lanes' folders are put together). Usage::

    python benchmarks/campaign_lane.py campaigns/ranks_under_vs_model.yaml \
        "scheduler.parallel=tp,workload=default" /tmp/lanes/tpdef.yaml
    python benchmarks/campaign_lane.py campaigns/spec_costs_vs_live.yaml "policy.name=sglang" \
        /tmp/lanes/oos_sglang.yaml model-defaults,model-own
    python benchmarks/campaign_lane.py campaigns/ranks_under_long_vs_model.yaml \
        "workload=json,workload.num_requests=1000" /tmp/lanes/json1k_a.yaml --live-copies 1
"""

from __future__ import annotations

import argparse

import yaml


def lane(campaign: dict, filters: dict[str, str], keep_arms: frozenset[str] = frozenset(),
         live_copies: int | None = None) -> dict:
    """``campaign`` with only its cells that match ``filters`` and only its live arms, one run at a time;
    with ``keep_arms``, those arms too, run as the campaign's runner runs them; with ``live_copies``, that
    many copies of each live arm."""
    cells = []
    for cell in campaign["cells"]:
        cell, keep = dict(cell), True
        for key, want in filters.items():
            have = cell.get(key)
            if isinstance(have, list) and want in map(str, have):
                cell[key] = next(v for v in have if str(v) == want)
            elif str(have) != want:
                keep = False
        if keep:
            cells.append(cell)
    arms = {name: arm for name, arm in campaign["arms"].items() if arm.get("mode") == "live" or name in keep_arms}
    if live_copies is not None:
        arms = {name: {**arm, "copies": live_copies} if arm.get("mode") == "live" else arm
                for name, arm in arms.items()}
    for name, arm in arms.items():  # later copies wait only for the arms this lane runs
        after = [a for a in arm.get("later_copies_after", []) if a in arms]
        rest = {k: v for k, v in arm.items() if k != "later_copies_after"}
        arms[name] = {**rest, "later_copies_after": after} if after and arm.get("copies", 1) > 1 else rest
    if keep_arms:
        return {**campaign, "cells": cells, "arms": arms,
                "comparisons": [c for c in campaign.get("comparisons", []) if set(c["runs"]) <= set(arms)]}
    rest = {k: v for k, v in campaign.items() if k not in ("cells", "arms", "comparisons", "runner")}
    return {**rest, "cells": cells, "arms": arms, "runner": {"jobs": 1, "pin": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("campaign")
    parser.add_argument("filters", help="KEY=VALUE,... of the cells kept")
    parser.add_argument("dest")
    parser.add_argument("keep_arms", nargs="?", default="", help="ARM,... kept beside the live arms")
    parser.add_argument("--live-copies", type=int, default=None, help="copies of each live arm in this lane")
    args = parser.parse_args()
    wanted = dict(item.split("=", 1) for item in args.filters.split(",") if item)
    keep = frozenset(a for a in args.keep_arms.split(",") if a)
    with open(args.campaign, encoding="utf-8") as f:
        written = lane(yaml.safe_load(f), wanted, keep, args.live_copies)
    with open(args.dest, "w", encoding="utf-8") as f:
        yaml.safe_dump(written, f, sort_keys=False)
    print(f"{args.dest}: {len(written['cells'])} cells, arms {', '.join(written['arms'])}")


if __name__ == "__main__":
    main()
