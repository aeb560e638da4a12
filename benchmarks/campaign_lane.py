"""Write one lane of a campaign's live runs: the cells matching KEY=VALUE filters, the live arms alone.

A host of several GPUs runs a campaign's live copies faster in lanes, each lane its own GPUs and cores
(``benchmarks/gpu_campaign_lanes.sh``); the lanes' run folders, copied into one folder, are then the
campaign's (``cdbench campaign run FILE --out F --adopt`` runs the model arms beside them). A cell's list
value (its own axis) is narrowed to the filter's value. Usage::

    python benchmarks/campaign_lane.py campaigns/ranks_under_vs_model.yaml \
        "scheduler.parallel=tp,workload=default" /tmp/lanes/tpdef.yaml
"""

from __future__ import annotations

import sys

import yaml


def lane(campaign: dict, filters: dict[str, str]) -> dict:
    """``campaign`` with only its cells that match ``filters`` and only its live arms, one run at a time."""
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
    arms = {name: arm for name, arm in campaign["arms"].items() if arm.get("mode") == "live"}
    rest = {k: v for k, v in campaign.items() if k not in ("cells", "arms", "comparisons", "runner")}
    return {**rest, "cells": cells, "arms": arms, "runner": {"jobs": 1, "pin": True}}


def main() -> None:
    source, filters, dest = sys.argv[1:4]
    wanted = dict(item.split("=", 1) for item in filters.split(",") if item)
    with open(source, encoding="utf-8") as f:
        written = lane(yaml.safe_load(f), wanted)
    with open(dest, "w", encoding="utf-8") as f:
        yaml.safe_dump(written, f, sort_keys=False)
    print(f"{dest}: {len(written['cells'])} cells, arms {', '.join(written['arms'])}")


if __name__ == "__main__":
    main()
