"""A live run's own host costs (costs.host_costs=live-run:...): fitted from its steps, read from its config."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from cdbench.harness.policies import policy
from cdbench.harness.records import STEP_COLUMNS
from cdbench.results.config_files import ConfigError
from cdbench.results.errors import ResultsError
from cdbench.results.live_loop_costs import SPUN_FIELDS, fit_launch, live_loop_costs
from cdbench.results.pack import pack_runs
from cdbench.results.run_config import validate_run_config


def _steps(launch_s=2.5e-4, launch_row_s=4e-6, launch_prefill_s=1.2e-4, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    n = 400
    rows = rng.integers(1, 64, n)
    prefill = rng.random(n) < 0.1
    noise = rng.normal(0, 2e-6, n)
    launch = np.where(prefill, launch_prefill_s, launch_s) + launch_row_s * rows + noise
    frame = pd.DataFrame(0.0, index=range(n + 2), columns=list(STEP_COLUMNS))
    frame["kind"] = ["decode" if not p else "mixed" for p in prefill] + ["idle", "idle"]
    frame["rows"] = np.append(rows, [0, 0])
    frame["prefill_tokens"] = np.append(np.where(prefill, 256, 0), [0, 0])
    frame["launch_s"] = np.append(launch, [0.0, 0.0])  # idle iterations launch nothing and are left out
    return frame


def _live_run(folder, steps: pd.DataFrame, mode="live", **scheduler):
    folder.mkdir(parents=True)
    config = {"mode": mode, "seed": 0, "policy": {"name": "sglang"}, "scheduler": scheduler}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "summary.json").write_text(json.dumps({"completed": 1}))
    steps.to_parquet(folder / "steps.parquet", index=False)
    steps.head(0).to_parquet(folder / "requests.parquet", index=False)
    return folder


def test_the_launch_line_and_the_prefill_launch_are_recovered():
    launch_s, launch_row_s, launch_prefill_s, n_decode, n_prefill = fit_launch(_steps())
    assert launch_s == pytest.approx(2.5e-4, rel=0.02) and launch_row_s == pytest.approx(4e-6, rel=0.05)
    assert launch_prefill_s == pytest.approx(1.2e-4, rel=0.05)
    assert n_decode + n_prefill == 400


def test_a_launch_falling_with_the_rows_fits_no_negative_slope():
    launch_s, launch_row_s, *_ = fit_launch(_steps(launch_s=5e-4, launch_row_s=0.0) .assign(
        launch_s=lambda f: np.where(f["kind"] == "idle", 0.0, 5e-4 - 1e-6 * f["rows"])))
    assert launch_row_s == 0.0 and launch_s > 0


def test_the_spun_fields_come_from_the_live_config_and_missing_ones_are_zero(tmp_path):
    run = _live_run(tmp_path / "live-a", _steps(), schedule_s=1e-4, process_row_s=2e-5)
    costs = live_loop_costs(str(run))
    assert costs.values["schedule_s"] == 1e-4 and costs.values["process_row_s"] == 2e-5
    # the live run's configuration had no accept_row_s: its loop spent nothing on it
    assert costs.values["accept_row_s"] == 0.0
    assert set(costs.values) == set(SPUN_FIELDS) | {"launch_s", "launch_row_s", "launch_prefill_s"}
    assert costs.values["launch_row_s"] == pytest.approx(4e-6, rel=0.05)


def test_a_packed_live_run_is_read_the_same(tmp_path):
    run = _live_run(tmp_path / "runs" / "live-a", _steps(), schedule_s=1e-4)
    from_folder = live_loop_costs(str(run)).values
    exact = pack_runs({"live-a": run}, tmp_path / "exact.pack", exact=True)
    assert live_loop_costs(f"{exact}::live-a").values == from_folder
    # a pack keeps the steps' seconds at 0.1 µs: the launch, fitted from what is left of each step, moves by less
    packed = pack_runs({"live-a": run}, tmp_path / "runs.pack")
    assert live_loop_costs(f"{packed}::live-a").values == pytest.approx(from_folder, rel=1e-3, abs=1e-9)


def test_a_model_run_or_one_without_steps_is_refused(tmp_path):
    model = _live_run(tmp_path / "model", _steps(), mode="model")
    with pytest.raises(ResultsError, match="is a model run"):
        live_loop_costs(str(model))
    bare = _live_run(tmp_path / "bare", _steps().head(0))
    with pytest.raises(ResultsError, match="kept no step log"):
        live_loop_costs(str(bare))


def test_a_model_config_takes_the_live_runs_host_costs_over_its_own(tmp_path):
    run = _live_run(tmp_path / "live-a", _steps(), schedule_s=1e-4, schedule_row_s=0.0, accept_row_s=3e-6)
    # a dumped model config sets every field; the live run's host costs still replace them
    tree = {"mode": "model", "policy": {"name": "sglang"},
            "scheduler": {"schedule_s": 9.0, "launch_s": 9.0, "compile_threads": 3},
            "costs": {"host_costs": f"live-run:{run}"}}
    cfg = validate_run_config(tree).scheduler_config()
    assert cfg.schedule_s == 1e-4 and cfg.accept_row_s == 3e-6 and cfg.launch_s == pytest.approx(2.5e-4, rel=0.02)
    assert cfg.compile_threads == 3  # not a host cost: the config's own
    preset = validate_run_config({"mode": "model", "policy": {"name": "sglang"}}).scheduler_config()
    assert preset.launch_s == policy("sglang").launch_s and preset.launch_row_s == 0.0


@pytest.mark.parametrize(("tree", "message"), [
    ({"mode": "model", "costs": {"host_costs": "live:x"}}, "expected 'preset' or 'live-run:"),
    ({"mode": "model", "costs": {"host_costs": "live-run:/no/such/run"}}, "costs.host_costs: "),
])
def test_a_bad_host_cost_source_is_one_line(tree, message):
    with pytest.raises(ConfigError, match=message):
        validate_run_config(tree)


def test_a_live_run_cannot_take_another_live_runs_costs(tmp_path):
    run = _live_run(tmp_path / "live-a", _steps())
    with pytest.raises(ConfigError, match="a live run measures its own"):
        validate_run_config({"mode": "live", "costs": {"host_costs": f"live-run:{run}"}})
