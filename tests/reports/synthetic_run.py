"""A synthetic run folder with the real column schema, so report code is tested without running the scheduler."""

import json

import numpy as np
import pandas as pd

from cdbench.harness.records import REQUEST_COLUMNS, STEP_COLUMNS
from cdbench.results.run_folder import SavedRun


def synthetic_frames(seed: int = 0, n: int = 60, steps: int = 120, ranks_skew: bool = True, drafts: bool = True):
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0, 2.0, n))
    structured = rng.random(n) < 0.7
    cache = np.where(structured, np.where(rng.random(n) < 0.5, "miss", "hit"), "")
    compile_start = np.where(cache == "miss", arrival, np.nan)
    compile_end = compile_start + rng.lognormal(-5, 1, n)
    first = arrival + 0.02 + np.nan_to_num(compile_end - arrival)
    out_tokens = rng.integers(1, 200, n)
    finish = first + out_tokens * 0.01
    drafted = rng.integers(0, 40, n) if drafts else np.zeros(n, int)
    requests = pd.DataFrame({
        "request_id": np.arange(n), "arrival_s": arrival, "issued_s": arrival, "prompt_len": rng.integers(10, 500, n),
        "output_len": out_tokens, "think_tokens": 0, "structured": structured, "spec_key": np.where(structured, 1, -1),
        "cache": cache, "compile_start_s": compile_start, "compile_end_s": compile_end, "grammar_ready_s": compile_end,
        "rank_skew_s": np.where(cache == "miss", rng.uniform(0, 0.003, n) if ranks_skew else 0.0, np.nan),
        "admitted_s": first - 0.01, "first_token_s": first, "finish_s": finish, "output_tokens": out_tokens,
        "drafted": drafted, "accepted": drafted // 2, "rolled_back": drafted - drafted // 2, "jump_forward_tokens": 0,
        "forced_think_end": False, "abort_reason": "", "valid": pd.array([True] * n, dtype="boolean"),
        "preemptions": 0, "recomputed_tokens": 0, "kv_wait_s": 0.0,
    })[list(REQUEST_COLUMNS)]
    start = np.cumsum(rng.uniform(0.01, 0.02, steps))
    grammar_rows = rng.integers(0, 30, steps)
    step_frame = pd.DataFrame({
        "start_s": start, "duration_s": np.full(steps, 0.012), "kind": rng.choice(["decode", "mixed", "idle"], steps),
        "rows": grammar_rows + 5, "decode_rows": grammar_rows + 5, "prefill_tokens": 0, "grammar_rows": grammar_rows,
        "mask_rows": grammar_rows, "tokens": grammar_rows + 5, "schedule_s": 1e-4, "poll_s": 0.0, "sync_s": 0.0,
        "check_s": 0.0, "forward_s": 0.01, "fill_s": grammar_rows * 3e-5, "copy_s": 1e-5, "apply_s": 1e-5,
        "sample_s": 2e-4, "process_s": 1e-4, "exposed_cpu_s": 5e-4, "hidden_cpu_s": grammar_rows * 3e-5,
        "transfer_s": 0.0, "launch_s": 3e-4, "contention": 1.0, "decode_tokens": grammar_rows + 5,
        "context_tokens": (grammar_rows + 5) * 300, "kv_tokens": (grammar_rows + 5) * 300, "preempted": 0,
    })[list(STEP_COLUMNS)]
    return requests, step_frame


def write_synthetic_run(folder, seed=0, summary=None, **kwargs) -> SavedRun:
    requests, steps = synthetic_frames(seed, **kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    summary = summary or {"completed": 60, "request_throughput": 20.0 + seed, "mean_ttft_ms": 30.0 + seed,
                          "median_ttft_ms": 25.0, "p99_ttft_ms": 90.0, "mean_tpot_ms": 10.0, "p99_tpot_ms": 12.0,
                          "cache_hit_rate": 0.5, "rollback_rate": 0.5,
                          "drafted_by_position": [400, 300, 200] if kwargs.get("drafts", True) else [],
                          "accepted_by_position": [300, 150, 50] if kwargs.get("drafts", True) else [],
                          "rolled_back_by_position": [70, 100, 110] if kwargs.get("drafts", True) else []}
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "config.yaml").write_text("mode: model\nseed: %d\n" % seed)
    requests.to_parquet(folder / "requests.parquet", index=False)
    steps.to_parquet(folder / "steps.parquet", index=False)
    return SavedRun(folder, {"mode": "model", "seed": seed}, summary, (requests, steps))

