"""A live run's forward speed (costs.forward_speed=live-run:...): fitted from its steps, refused with a reason."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from cdbench.harness.costs.forward import ForwardCostModel, attention_pairs
from cdbench.harness.costs.forward_speed import ForwardSpeed
from cdbench.harness.policies import padded_decode, policy
from cdbench.harness.records import STEP_COLUMNS
from cdbench.results.config_files import ConfigError
from cdbench.results.pack import pack_runs
from cdbench.results.run_config import validate_run_config

MODEL, GPU = "qwen3-8b", "h100-sxm"


def _live_tables(decode_speed: float, prefill_speed: float, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Steps and requests of a live run whose forwards take ``decode_speed`` (``prefill_speed`` with prefill
    chunks) times the calibrated model's price, with 0.3 % of scatter; one prefill step admits prompts that
    do not add up to its tokens (a chunked prompt)."""
    rng = np.random.default_rng(seed)
    forward = ForwardCostModel(MODEL, GPU)
    sizes = policy("sglang").cuda_graph_sizes
    rows, requests, t = [], [], 0.0
    for i in range(300):
        prompts = rng.integers(64, 900, rng.integers(1, 4)) if i % 10 == 0 else np.zeros(0, np.int64)
        n = int(rng.integers(0 if len(prompts) else 1, 120))
        kv = int(n * rng.integers(100, 2000))
        if len(prompts):
            price = forward.step_s(prompts.sum(), attention_pairs(prompts, 0).sum(), n, kv, len(prompts))
            speed = prefill_speed
        else:
            price = forward.step_s(0, 0, *padded_decode(sizes, n, kv))
            speed = decode_speed
        forward_s = speed * price * (1.0 + rng.normal(0.0, 0.003))
        duration = forward_s + 1e-3
        tokens = int(prompts.sum()) + (7 if i == 150 else 0)  # step 150: a chunk no admission accounts for
        rows.append({"start_s": t, "duration_s": duration, "kind": "prefill" if len(prompts) and not n else
                     "mixed" if len(prompts) else "decode", "rows": n + len(prompts), "decode_rows": n,
                     "prefill_tokens": tokens, "decode_tokens": n, "context_tokens": kv, "forward_s": forward_s})
        requests += [{"admitted_s": t + 2e-4, "prompt_len": int(p)} for p in prompts]
        t += duration
    steps = pd.DataFrame(0.0, index=range(len(rows)), columns=list(STEP_COLUMNS))
    for column in rows[0]:
        steps[column] = [r[column] for r in rows]
    return steps, pd.DataFrame(requests)


def _live_run(folder, steps: pd.DataFrame, requests: pd.DataFrame, mode: str = "live", model: str = MODEL):
    folder.mkdir(parents=True)
    config = {"mode": mode, "seed": 0, "policy": {"name": "sglang"}, "costs": {"model": model, "gpu": GPU}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "summary.json").write_text(json.dumps({"completed": 1}))
    steps.to_parquet(folder / "steps.parquet", index=False)
    requests.to_parquet(folder / "requests.parquet", index=False)
    return folder


def _model_config(ref, **costs) -> dict:
    return {"mode": "model", "policy": {"name": "sglang"},
            "costs": {"model": MODEL, "gpu": GPU, "fixed_grammar": {}, "forward_speed": f"live-run:{ref}", **costs}}


def test_forwards_at_105_percent_of_the_price_fit_105(tmp_path):
    run = _live_run(tmp_path / "live-a", *_live_tables(1.05, 1.05))
    speed = validate_run_config(_model_config(run)).costs.forward_speed
    assert isinstance(speed, ForwardSpeed)
    assert speed.decode == speed.prefill == pytest.approx(1.05, abs=1e-3)
    assert (speed.decode_steps, speed.prefill_steps, speed.left_out_steps) == (270, 29, 1)
    assert speed.source == f"live-run:{run}"
    assert "fitted from live-run:" in speed.describe() and "270 decode steps" in speed.describe()


def test_decode_and_prefill_forwards_apart_fit_apart(tmp_path):
    run = _live_run(tmp_path / "live-a", *_live_tables(1.05, 0.97))
    speed = validate_run_config(_model_config(run)).costs.forward_speed
    assert speed.decode == pytest.approx(1.05, abs=1e-3) and speed.prefill == pytest.approx(0.97, abs=2e-3)


def test_a_data_parallel_run_fits_each_ranks_steps_against_its_own_requests(tmp_path):
    """A data-parallel run keeps every rank's steps in one log (rank by rank, not in time order) and its
    requests with their rank: each prefill step is matched with its own rank's admissions, so every one of
    them is priced, as in a one-rank run of the same steps."""
    ranks = [_live_tables(1.05, 0.97, seed=seed) for seed in (0, 1)]
    steps = pd.concat([s.assign(rank=r) for r, (s, _) in enumerate(ranks)], ignore_index=True)
    requests = pd.concat([q.assign(rank=r) for r, (_, q) in enumerate(ranks)], ignore_index=True)
    speed = validate_run_config(_model_config(_live_run(tmp_path / "dp", steps, requests))).costs.forward_speed
    alone = [validate_run_config(_model_config(_live_run(tmp_path / f"rank{r}", *t))).costs.forward_speed
             for r, t in enumerate(ranks)]
    assert speed.prefill_steps == sum(a.prefill_steps for a in alone) and speed.left_out_steps == 2
    assert speed.decode == pytest.approx(1.05, abs=1e-3) and speed.prefill == pytest.approx(0.97, abs=2e-3)


def test_a_packed_live_run_fits_the_same_and_the_resolved_config_reruns_without_it(tmp_path):
    run = _live_run(tmp_path / "runs" / "live-a", *_live_tables(1.04, 1.04))
    packed = pack_runs({"live-a": run}, tmp_path / "runs.pack")
    from_folder = validate_run_config(_model_config(run)).costs.forward_speed
    from_pack = validate_run_config(_model_config(f"{packed}::live-a")).costs.forward_speed
    assert from_pack.decode == pytest.approx(from_folder.decode, rel=1e-5)
    assert from_pack.source == f"live-run:{packed}::live-a"
    # the dumped config holds the fitted speed: it validates again with the live run gone
    dumped = validate_run_config(_model_config(run)).model_dump(mode="json")
    (run / "steps.parquet").unlink()
    assert validate_run_config(dumped).costs.forward_speed == from_folder


def test_bad_refs_are_one_line_naming_the_ref_and_the_reason(tmp_path):
    steps, requests = _live_tables(1.0, 1.0)
    model = _live_run(tmp_path / "model", steps, requests, mode="model")
    old = _live_run(tmp_path / "old", steps.drop(columns=["context_tokens"]), requests)
    other = _live_run(tmp_path / "other", steps, requests, model="llama-3.1-8b")
    few = _live_run(tmp_path / "few", steps.head(5), requests)
    cases = [(tmp_path / "missing", "costs.forward_speed: .*missing"),
             (model, f"{model} is a model run, not a live run: it measured no forward speed"),
             (old, f"{old}: its step log has no context_tokens column"),
             (other, f"{other} ran llama-3.1-8b on h100-sxm at tp=1; this run prices qwen3-8b"),
             (few, f"live-run:{few}: 5 priced forward steps; a fit needs 10")]
    for ref, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            validate_run_config(_model_config(ref))
        assert "\n" not in str(err.value)


def test_a_live_run_cannot_take_another_live_runs_speed(tmp_path):
    run = _live_run(tmp_path / "live-a", *_live_tables(1.0, 1.0))
    with pytest.raises(ConfigError, match="a live run runs its own"):
        validate_run_config({"mode": "live", "costs": {"forward_speed": f"live-run:{run}"}})


def test_the_summary_the_report_and_the_console_state_the_speed_and_its_source(tmp_path):
    from typer.testing import CliRunner

    from cdbench.cli.app import app

    live = _live_run(tmp_path / "live-a", *_live_tables(1.05, 1.05))
    tree = _model_config(live)
    tree.update(vocab="cl100k", workload={"num_requests": 6, "kinds": ["regex"],
                                          "arrival": {"process": "poisson", "rate": 50.0},
                                          "prompt_len": {"dist": "fixed", "value": 64},
                                          "output_len": {"dist": "fixed", "value": 4}})
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump(tree))
    result = CliRunner().invoke(app, ["run", str(config), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["forward_speed"]
    assert summary["source"] == f"live-run:{live}" and summary["decode"] == pytest.approx(1.05, abs=1e-3)
    assert summary["decode_steps"] == 270
    assert f"fitted from live-run:{live}: 270 decode steps" in (tmp_path / "out" / "report.md").read_text()
    assert "forward speed: 1.05" in " ".join(result.output.split())
