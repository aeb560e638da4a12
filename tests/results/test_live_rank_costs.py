"""Tensor-parallel ranks' prices from a live run's records (costs.rank_costs=live-run:...), and the ranks'
own step records in the run folder."""

from __future__ import annotations

import dataclasses
import doctest
import json

import numpy as np
import pandas as pd
import pytest
import yaml

import cdbench.harness.live.rank_steps as rank_steps_module
from cdbench.harness.live.rank_info import RanksInfo, Spread
from cdbench.harness.live.rank_steps import RANK_STEP_COLUMNS, RANK_STEPS_FILE
from cdbench.harness.live.step import LiveInfo
from cdbench.results.config_files import ConfigError
from cdbench.results.live_rank_costs import live_rank_costs
from cdbench.results.pack import pack_runs
from cdbench.results.run_config import validate_run_config

SIGMA = 0.25


def test_the_records_module_examples_run():
    assert doctest.testmod(rank_steps_module).failed == 0


def _records(ranks=2, steps=600, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    fill = rng.lognormal(-7, 1.5, steps) * rng.lognormal(0, SIGMA, (ranks, steps))
    fill[:, ::10] = 0.0  # steps without grammar rows: no fill to compare
    frame = pd.DataFrame(0.0, index=range(ranks * steps), columns=list(RANK_STEP_COLUMNS))
    frame["rank"], frame["step"] = np.repeat(np.arange(ranks), steps), np.tile(np.arange(steps), ranks)
    frame["kind"], frame["fill_s"] = "decode", fill.ravel()
    return frame


def _compiles(ranks=2, specs=400, seed=0) -> pd.DataFrame:
    """A tensor-parallel run's merged requests: each spec compiled once on every rank, small compiles spread
    by a sigma of 0.05 among the ranks and large ones (over 20 ms) by 0.25."""
    rng = np.random.default_rng(seed)
    size = np.exp(rng.uniform(np.log(5e-4), np.log(0.5), specs))
    sigma = np.where(size > 0.02, 0.25, 0.05)
    seconds = size * rng.lognormal(0.0, 1.0, (ranks, specs)) ** sigma
    return pd.DataFrame({"cache": "miss", "compile_start_s": 1.0, "compile_end_s": 1.0 + seconds.max(axis=0),
                         "rank_skew_s": np.ptp(seconds, axis=0)})


def _live_run(folder, parallel="tp", ranks=2, mode="live", records=True, compiles=False):
    folder.mkdir(parents=True)
    config = {"mode": mode, "seed": 0, "policy": {"name": "sglang"},
              "scheduler": {"ranks": ranks, "parallel": parallel}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "summary.json").write_text(json.dumps({"completed": 1}))
    pd.DataFrame({"x": [0]}).to_parquet(folder / "steps.parquet", index=False)
    (_compiles(ranks) if compiles else pd.DataFrame({"x": [0]})).to_parquet(folder / "requests.parquet", index=False)
    spread = Spread(100, 7e-4, 6.5e-4, 9e-4, 2e-3)
    info = RanksInfo(parallel, ranks, ["cpu"] * ranks, all_gather_s=spread if parallel == "tp" else None,
                     compile_sigma=0.12 if parallel == "tp" else None)
    live = LiveInfo("cpu", "2", "tiny", 512, 16, 8, 64, 600, [], ranks=info)
    (folder / "live.json").write_text(json.dumps(dataclasses.asdict(live)))
    if records:
        _records(ranks).to_parquet(folder / RANK_STEPS_FILE, index=False)
    return folder


def test_the_ranks_prices_come_from_live_json_and_the_records(tmp_path):
    run = _live_run(tmp_path / "live-a")
    costs = live_rank_costs(str(run))
    assert costs.values["all_gather_s"] == 6.5e-4 and costs.values["rank_jitter"] == 0.12
    # each rank's own lognormal(0, SIGMA) about the step's fill: the ratio to rank 0's spreads by SIGMA * sqrt(2)
    assert costs.values["rank_fill_jitter"] == pytest.approx(SIGMA * np.sqrt(2), rel=0.15)
    assert costs.values["rank_fill_offset"] == pytest.approx(0.0, abs=0.06)
    assert costs.ranks == 2 and costs.steps == 540  # every tenth step had no fill
    ratios = costs.values["rank_fill_ratios"]  # each filled step: rank 0's fill, the slowest's over it
    records = _records()
    fills = records.pivot(index="step", columns="rank", values="fill_s")
    fills = fills[(fills > 0).all(axis=1)]
    assert len(ratios) == 540 and [f for f, _ in ratios] == sorted(f for f, _ in ratios)
    assert sorted(r for _, r in ratios) == pytest.approx(sorted(fills.max(axis=1) / fills[0]), rel=1e-3)
    packed = pack_runs({"live-a": run}, tmp_path / "runs.pack", exact=True)
    assert live_rank_costs(f"{packed}::live-a").values == costs.values


def test_a_model_config_takes_the_live_runs_prices(tmp_path):
    run = _live_run(tmp_path / "live-a")
    tree = {"mode": "model", "scheduler": {"ranks": 2, "all_gather_s": 1.0, "schedule_s": 1e-4},
            "costs": {"rank_costs": f"live-run:{run}", "fixed_grammar": {}, "fixed_gpu": {}}}
    sched = validate_run_config(tree).scheduler_config()
    assert sched.all_gather_s == 6.5e-4 and sched.rank_jitter == 0.12 and sched.schedule_s == 1e-4
    assert sched.rank_fill_jitter == pytest.approx(SIGMA * np.sqrt(2), rel=0.15)
    assert len(sched.rank_fill_ratios) == 540 and min(r for _, r in sched.rank_fill_ratios) == 1.0


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_ranks_compile_spread_is_read_by_size_from_the_runs_requests(ranks):
    from cdbench.harness.live.ranks import MIN_SPECS_A_SIZE, compile_sigma_by_size

    points = compile_sigma_by_size(_compiles(ranks), ranks)
    sizes, sigmas = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    assert len(points) >= 4 and list(sizes) == sorted(sizes)
    assert sigmas[sizes < 0.004] == pytest.approx(0.05, rel=0.25)  # (bins away from the 20 ms edge)
    assert sigmas[sizes > 0.06] == pytest.approx(0.25, rel=0.25)
    assert compile_sigma_by_size(_compiles(ranks, specs=MIN_SPECS_A_SIZE - 1), ranks) is None
    assert compile_sigma_by_size(pd.DataFrame({"x": [0]}), ranks) is None


def test_a_model_config_takes_the_compile_spread_by_size(tmp_path):
    run = _live_run(tmp_path / "live-a", compiles=True)
    tree = {"mode": "model", "scheduler": {"ranks": 2},
            "costs": {"rank_costs": f"live-run:{run}", "fixed_grammar": {}, "fixed_gpu": {}}}
    by_size = validate_run_config(tree).scheduler_config().rank_jitter_by_size
    assert by_size and by_size[-1][1] > 3 * by_size[0][1]
    assert live_rank_costs(str(_live_run(tmp_path / "old"))).values["rank_jitter_by_size"] is None


@pytest.mark.parametrize("make,tree,message", [
    (dict(), {"scheduler": {"ranks": 4}}, "ran 2 tensor-parallel ranks; this run has 4 tp rank"),
    (dict(), {"scheduler": {"ranks": 2, "parallel": "dp"}}, "this run has 2 dp rank"),
    (dict(parallel="dp"), {"scheduler": {"ranks": 2}}, "is a dp run of 2 ranks: they never wait for each other"),
    (dict(mode="model"), {"scheduler": {"ranks": 2}}, "is a model run: its ranks' costs are priced"),
    (dict(records=False), {"scheduler": {"ranks": 2}}, "kept no rank_steps.parquet"),
])
def test_prices_that_cannot_apply_are_refused_in_one_line(tmp_path, make, tree, message):
    run = _live_run(tmp_path / "live-a", **make)
    tree = {"mode": "model", **tree, "costs": {"rank_costs": f"live-run:{run}", "fixed_grammar": {}, "fixed_gpu": {}}}
    with pytest.raises(ConfigError, match="costs.rank_costs: ") as err:
        validate_run_config(tree)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_live_run_is_not_priced_from_another(tmp_path):
    run = _live_run(tmp_path / "live-a")
    with pytest.raises(ConfigError, match="costs.rank_costs prices a model or hybrid run .* a live run measures its own"):
        validate_run_config({"mode": "live", "scheduler": {"ranks": 2}, "costs": {"rank_costs": f"live-run:{run}"}})


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_run_of_ranks_keeps_each_ranks_own_steps(tmp_path, ranks):
    from cdbench.harness.config import RunConfig
    from cdbench.results.run_folder import record_run

    config = RunConfig.model_validate({
        "mode": "model", "workload": {"num_requests": 6}, "trace_steps": 0,
        "scheduler": {"ranks": ranks, "parallel": "dp"},
        "costs": {"fixed_grammar": {"compile_time_s": 0.002}, "fixed_gpu": {"forward_base_s": 0.01}}})
    saved = record_run(config, tmp_path / "run")
    path = tmp_path / "run" / RANK_STEPS_FILE
    if ranks == 1:
        assert not path.exists()  # one scheduler: its step log is the rank's
        return
    own = pd.read_parquet(path)
    assert list(own.columns) == list(RANK_STEP_COLUMNS)
    busy = saved.steps[saved.steps["kind"] != "idle"]
    assert own.groupby("rank").size().to_dict() == busy.groupby("rank").size().to_dict()
    assert (own["wait_s"] == 0).all()
