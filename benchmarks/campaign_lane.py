"""Write one lane of a campaign: the cells matching KEY=VALUE filters, the live arms alone (or the arms named).

A host of several GPUs runs a campaign's live copies faster in lanes, each lane its own GPUs and cores
(``benchmarks/gpu_campaign_lanes.sh``); the lanes' run folders, copied into one folder, are then the
campaign's (``cdbench campaign run FILE --out F --adopt`` runs the model arms beside them). A cell's list
value (its own axis) is narrowed to the filter's value. Arms named after the filters are kept with the live
ones (model arms that must run on the GPU host, e.g. measuring specs on its CPU), with the campaign's runner
and its comparisons. Usage::

    python benchmarks/campaign_lane.py campaigns/ranks_under_vs_model.yaml \
        "scheduler.parallel=tp,workload=default" /tmp/lanes/tpdef.yaml
    python benchmarks/campaign_lane.py campaigns/spec_costs_vs_live.yaml "policy.name=sglang" \
        /tmp/lanes/oos_sglang.yaml model-defaults,model-own
"""

from __future__ import annotations

import sys

import yaml


def lane(campaign: dict, filters: dict[str, str], keep_arms: frozenset[str] = frozenset()) -> dict:
    """``campaign`` with only its cells that match ``filters`` and only its live arms, one run at a time;
    with ``keep_arms``, those arms too, run as the campaign's runner runs them."""
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
    if keep_arms:
        return {**campaign, "cells": cells, "arms": arms,
                "comparisons": [c for c in campaign.get("comparisons", []) if set(c["runs"]) <= set(arms)]}
    rest = {k: v for k, v in campaign.items() if k not in ("cells", "arms", "comparisons", "runner")}
    return {**rest, "cells": cells, "arms": arms, "runner": {"jobs": 1, "pin": True}}


def main() -> None:
    source, filters, dest = sys.argv[1:4]
    keep = frozenset(sys.argv[4].split(",")) if len(sys.argv) > 4 else frozenset()
    wanted = dict(item.split("=", 1) for item in filters.split(",") if item)
    with open(source, encoding="utf-8") as f:
        written = lane(yaml.safe_load(f), wanted, keep)
    with open(dest, "w", encoding="utf-8") as f:
        yaml.safe_dump(written, f, sort_keys=False)
    print(f"{dest}: {len(written['cells'])} cells, arms {', '.join(written['arms'])}")


if __name__ == "__main__":
    main()
