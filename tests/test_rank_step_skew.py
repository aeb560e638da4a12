"""benchmarks/rank_step_skew.py: a run's rank records read as the skew each step paid."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from cdbench.harness.live.rank_steps import RANK_STEP_COLUMNS, RANK_STEPS_FILE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import rank_step_skew  # noqa: E402


def _run(folder: Path, parallel: str, records: bool = True) -> Path:
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump({"mode": "live", "scheduler": {"ranks": 2, "parallel": parallel}}))
    (folder / "summary.json").write_text(json.dumps({"completed": 1}))
    if records:
        own = pd.DataFrame(0.0, index=range(6), columns=list(RANK_STEP_COLUMNS))
        own["rank"], own["step"] = np.repeat([0, 1], 3), np.tile([0, 2, 3], 2)
        # rank 1 is slower on steps 0 and 3, by its fill; step 2 is even
        own["local_s"] = [0.010, 0.010, 0.010, 0.014, 0.010, 0.030]
        own["fill_s"] = [0.002, 0.002, 0.002, 0.006, 0.002, 0.022]
        own["wait_s"] = np.array([0.014, 0.010, 0.030] * 2) - own["local_s"]
        own.to_parquet(folder / RANK_STEPS_FILE, index=False)
    return folder


def test_a_tensor_parallel_runs_skew_and_its_fill_part(tmp_path, capsys):
    rows = {r["quantity"]: r for r in rank_step_skew.summarize(str(_run(tmp_path / "tp", "tp")))}
    skew = rows["skew: slowest rank minus the median"]
    assert skew["max_ms"] == pytest.approx(10.0) and skew["p50_ms"] == pytest.approx(2.0)
    assert rows["its fill part: slowest rank's fill minus the median"]["max_ms"] == pytest.approx(10.0)
    assert rows["rank 0: wait for the slowest"]["max_ms"] == pytest.approx(20.0)
    assert "slowest rank's share of steps rank 0 33%, rank 1 67%" in capsys.readouterr().out


def test_a_data_parallel_run_lists_each_ranks_own_steps_and_a_run_without_records_is_named(tmp_path):
    rows = rank_step_skew.summarize(str(_run(tmp_path / "dp", "dp")))
    assert [r["quantity"] for r in rows][:4] == ["rank 0: local", "rank 0: forward", "rank 0: fill", "rank 0: launch"]
    with pytest.raises(SystemExit, match="none: no rank_steps.parquet"):
        rank_step_skew.summarize(str(_run(tmp_path / "none", "tp", records=False)))
