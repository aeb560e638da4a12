"""Fit the engines' host-cost parameters from the committed step measurements.

Reads ``reports/engine_costs/{vllm,sglang}_steps.csv.gz`` (``measure_vllm.py``,
``measure_sglang.py``), ``sglang_scheduler_steps.csv.gz`` (``measure_sglang_scheduler.py``), the
older engine versions' ``<engine>-<version>_steps.csv.gz`` (``VERSIONS``), the grammar's own accepts
(``*_grammar_accepts.csv.gz``, ``measure_grammar_accept.py``), vLLM V0's logits-processor path
(``vllm-0.6.6_v0_processor.csv.gz``, ``measure_vllm_v0_processor.py``) and its sampler
(``vllm-0.6.6_v0_sampler.csv.gz``, the same script's ``--part sampler``) and what their GPU launches cost the host
(``vllm-0.6.6_v0_gpu_launch.csv.gz``, ``benchmarks/gpu_launch_costs.py`` on a GPU) and vLLM 0.10.1's model runner
building the bitmask it copies (``vllm-0.10.1_bitmask_build.csv.gz``, ``measure_vllm_bitmask_build.py``: medians
already); takes the median of each case (engine, backend, vocabulary, batch,
structured share: the steps of one case repeat the same work, and the machine is shared, so
medians rather than means), fits each cost by least squares on those medians, and writes
``reports/engine_costs/fitted.json``: one entry per parameter with its value, the engine,
version, function and the columns it was fitted from. The presets in
``cdbench/harness/policies.py`` copy these values; ``tests/harness/test_engine_costs.py``
pins them.

    .venv/bin/python scripts/engine_costs/fit.py
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd
from packaging.version import Version
from scipy.optimize import nnls

ROOT = Path(__file__).resolve().parents[2] / "reports" / "engine_costs"
PRESET_VOCABS = (129280, 151936)
CASE = ["engine", "version", "backend", "backend_version", "vocab", "batch", "share"]
#: fitted.json key of an older engine version -> its measurement file (same script, its own environment)
VERSIONS = {"vllm-0.10": ("vllm", "vllm-0.10.1_steps.csv.gz")}
#: fitted.json key of an engine version -> the grammar's own accepts timed in its environment
#: (measure_grammar_accept.py) and the fitted accept path that holds them: vLLM's update_from_output per
#: structured row, SGLang's process_batch_result_decode per structured row
GRAMMAR_ACCEPTS = {"vllm": ("vllm_grammar_accepts.csv.gz", "xgrammar.accept_row_s"),
                   "vllm-0.10": ("vllm-0.10.1_grammar_accepts.csv.gz", "xgrammar.accept_row_s"),
                   "sglang": ("sglang_grammar_accepts.csv.gz", "xgrammar.process_accept_row_s")}


def lstsq(frame: pd.DataFrame, y: str, xs: list[str], intercept: bool = True) -> tuple[list[float], float]:
    """Non-negative least squares of ``y`` on ``xs``; coefficients and R²."""
    cols = [np.ones(len(frame))] if intercept else []
    a = np.column_stack(cols + [frame[x].to_numpy(float) for x in xs])
    b = frame[y].to_numpy(float)
    coef, _ = nnls(a, b)  # costs are not negative: non-negative least squares
    resid = b - a @ coef
    r2 = 1 - float(resid @ resid) / float(((b - b.mean()) ** 2).sum()) if len(b) > 1 else float("nan")
    return [float(c) for c in coef], r2


def param(value: float, engine: str, version: str, function: str, fit: str, r2: float | None, n: int) -> dict:
    """One fitted parameter's entry (``r2`` ``None``: a mean, not a regression)."""
    return {"value": float(f"{max(value, 0.0):.4g}"), "engine": engine, "version": version, "function": function,
            "fit": fit, "r2": None if r2 is None else round(r2, 3), "cases": n}


def _vllm_functions(version: str) -> dict[str, str]:
    """Where each timed piece lives in that vLLM version (0.10 fills the bitmask inside ``schedule()`` and ships it
    inside ``SchedulerOutput``; later versions fill it in ``get_grammar_bitmask`` and ship it with ``sample_tokens``)."""
    if Version(version) < Version("0.11"):
        return {"schedule": "Scheduler.schedule (less the bitmask fill it calls)",
                "fill": "Scheduler.schedule -> StructuredOutputManager.grammar_bitmask (serial path)",
                "ipc": "MessageQueue.enqueue + dequeue of ('execute_model', (SchedulerOutput with the bitmask,))"}
    return {"schedule": "Scheduler.schedule",
            "fill": "Scheduler.get_grammar_bitmask -> StructuredOutputManager.grammar_bitmask (serial path)",
            "ipc": "MessageQueue.enqueue + dequeue of ('sample_tokens', (GrammarOutput,))"}


def fit_vllm(steps: pd.DataFrame) -> dict:
    fn = _vllm_functions(str(steps.version.iloc[0]))
    steps = steps.assign(mq_s=steps.enqueue_s + steps.dequeue_s, wrapper_s=steps.bitmask_s - steps.raw_fill_s)
    med = steps.groupby(CASE, as_index=False).median(numeric_only=True)
    out: dict[str, dict] = {}
    for backend, cases in med.groupby("backend"):
        v = f"vllm {cases.version.iloc[0]}, {backend} {cases.backend_version.iloc[0]}"
        (s0, s1), r2 = lstsq(cases, "schedule_s", ["rows"])
        out[f"{backend}.schedule_s"] = param(s0, "vllm", v, fn["schedule"], "schedule_s ~ a + b*rows: a", r2, len(cases))
        out[f"{backend}.schedule_row_s"] = param(s1, "vllm", v, fn["schedule"], "schedule_s ~ a + b*rows: b", r2, len(cases))
        # xgrammar's accept path costs about twice as much at 262144 logits (see the README); the fit keeps
        # the vocabularies of the 8B models the presets serve (128256, 151936)
        near = cases[cases.vocab.isin(PRESET_VOCABS)]
        (u0, u1, u2), r2 = lstsq(near, "update_s", ["rows", "structured_rows"])
        out[f"{backend}.process_step_s"] = param(u0, "vllm", v, "Scheduler.update_from_output",
                                                 "update_s ~ a + b*rows + c*structured_rows: a", r2, len(near))
        out[f"{backend}.process_row_s"] = param(u1, "vllm", v, "Scheduler.update_from_output",
                                                "update_s ~ a + b*rows + c*structured_rows: b", r2, len(near))
        out[f"{backend}.accept_row_s"] = param(u2, "vllm", v, "Scheduler.update_from_output (StructuredOutputManager "
                                               "should_advance + grammar.accept_tokens)",
                                               "update_s ~ a + b*rows + c*structured_rows: c", r2, len(near))
        serial = cases[(cases.structured_rows > 0) & (cases.structured_rows <= 128)]
        y = "wrapper_s" if backend == "xgrammar" else "bitmask_s"
        what = "bitmask_s - raw_fill_s" if backend == "xgrammar" else "bitmask_s (includes the fill itself)"
        (f0, f1), r2 = lstsq(serial, y, ["structured_rows"])
        out[f"{backend}.fill_step_s"] = param(f0, "vllm", v, fn["fill"], f"{what} ~ a + b*structured_rows: a", r2, len(serial))
        out[f"{backend}.fill_row_s"] = param(f1, "vllm", v, "StructuredOutputManager.grammar_bitmask (serial path)",
                                             f"{what} ~ a + b*structured_rows: b", r2, len(serial))
        par = cases[cases.structured_rows > 128]
        if len(par):
            (p1,), r2 = lstsq(par, y, ["structured_rows"], intercept=False)
            out[f"{backend}.fill_row_parallel_s"] = param(
                p1, "vllm", v, "StructuredOutputManager.grammar_bitmask (parallel path, fill pool of "
                "min(cpus // 2, 8) = 1 thread here)", f"{what} ~ b*structured_rows: b", r2, len(par))
    with_mask = steps[steps.message_bytes > 0]
    (m0, m1), r2 = lstsq(with_mask, "mq_s", ["message_bytes"])
    v = f"vllm {steps.version.iloc[0]}"
    out["ipc_s"] = param(m0, "vllm", v, fn["ipc"], "enqueue_s + dequeue_s ~ a + b*message_bytes (every step): a", r2,
                         len(with_mask))
    out["ipc_byte_s"] = param(m1, "vllm", v, fn["ipc"], "enqueue_s + dequeue_s ~ a + b*message_bytes (every step): b",
                              r2, len(with_mask))
    return out


def fit_accept_wrapper(fitted: dict, accepts: pd.DataFrame, total_key: str = "xgrammar.accept_row_s") -> dict:
    """The grammar's own accept per token (``measure_grammar_accept.py``: token-weighted over the validated
    instances, at the presets' vocabularies) and the engine's accept path per structured row without it
    (``total_key`` less it): model mode charges the grammar profile's accept beside the engine's."""
    near = accepts[accepts.vocab.isin(PRESET_VOCABS)]
    own = float(near.accept_s.sum() / near.tokens.sum())
    total = fitted[total_key]
    engine = total["engine"]
    v = f"{total['version'].split(',')[0]}, xgrammar {near.backend_version.iloc[0]}"
    fn = "GrammarMatcher.accept_token (xgrammar), walking each schema's validated instance"
    name = total_key.removeprefix("xgrammar.")
    return {"xgrammar.grammar_accept_row_s": param(own, engine, v, fn, "sum(accept_s) / sum(tokens)", None,
                                                   len(near)),
            "xgrammar.accept_wrapper_row_s": param(total["value"] - own, engine, v, total["function"] + ", less the "
                                                   "grammar's own accept_token", f"{name} - grammar_accept_row_s",
                                                   total["r2"], total["cases"])}


def fit_bitmask_build(cases: pd.DataFrame) -> dict:
    """vLLM 0.10.1's model runner building the bitmask it copies (``measure_vllm_bitmask_build.py``: the median of
    each case, one row a case): per byte of the array of every logits row and per byte of the mask rows scattered
    in, at the vocabularies of the models the entries run (the 8B models' and Qwen3's, as the other fits)."""
    near = cases[(cases.version.astype(str) == "0.10.1") & cases.vocab.isin((128256, *PRESET_VOCABS))]
    near = near.assign(array_bytes=4 * near.words * near.batch, mask_bytes=4 * near.words * near.structured)
    (a, b, c), r2 = lstsq(near, "build_s", ["array_bytes", "mask_bytes"])
    v = f"vllm 0.10.1's steps, numpy {near.numpy.iloc[0]}, torch {near['torch'].iloc[0]}"
    fn = ("GPUModelRunner.apply_grammar_bitmask up to the copy: the batch's walk, np.full of every logits row, the "
          "structured rows' row assignments, torch.from_numpy and the index tensor")
    fit = "build_s ~ a + b*array_bytes + c*mask_bytes"
    return {"mask_build_s": param(a, "vllm", v, fn, f"{fit}: a", r2, len(near)),
            "mask_build_byte_s": param(b, "vllm", v, fn, f"{fit}: b", r2, len(near)),
            "mask_scatter_byte_s": param(c, "vllm", v, fn, f"{fit}: c", r2, len(near))}


def fit_v0_processor(steps: pd.DataFrame) -> dict:
    """vLLM V0's per-row logits-processor path less the grammar's own calls and the CPU-only detour
    (``measure_vllm_v0_processor.py``): per step and per structured row, from the batch sizes' medians."""
    steps = steps.assign(wrapper_s=steps.total_s - steps.grammar_s - steps.cpu_detour_s)
    med = steps.groupby(["vllm", "xgrammar", "vocab", "batch"], as_index=False).median(numeric_only=True)
    v = f"vllm {med.vllm.iloc[0]}, xgrammar {med.xgrammar.iloc[0]}"
    fn = ("LogitsProcessor._apply_logits_processors + XGrammarLogitsProcessor.__call__ per row, less the grammar's "
          "own calls (is_terminated, accept_token, fill_next_token_bitmask)")
    return _step_and_row(med, "wrapper_s", ("xgrammar.fill_step_s", "xgrammar.fill_row_s"), v, fn,
                         "total_s - grammar_s - cpu_detour_s ~ a + b*rows")


def fit_v0_sampler(steps: pd.DataFrame) -> dict:
    """vLLM V0's sampler up to its first GPU-to-host sync, less the torch calls that launch GPU work in a GPU run
    (``measure_vllm_v0_processor.py --part sampler``), greedy rows (temperature 0): per step and per sampled row."""
    steps = steps[steps.params == "greedy"]
    steps = steps.assign(host_s=steps.presync_s - steps.presync_device_s)
    med = steps.groupby(["vllm", "batch"], as_index=False).median(numeric_only=True)
    v = f"vllm {med.vllm.iloc[0]}"
    fn = ("Sampler.forward up to its GPU-to-host sync (SamplingTensors.from_sampling_metadata, from_lists, "
          "_apply_min_tokens_penalty, _sample_with_torch's grouping), less the calls that launch GPU work")
    return _step_and_row(med, "host_s", ("sample_prep_s", "sample_prep_row_s"), v, fn,
                         "greedy presync_s - presync_device_s ~ a + b*rows")


def fit_v0_launches(path: Path) -> dict:
    """What the GPU-launching calls of V0's sampler (to its sync) and of its per-row processor path cost the host on
    a GPU (``benchmarks/gpu_launch_costs.py``'s CSV, its first line the device and versions), mode ``idle``: where
    they are exposed, after the forward behind a blocking copy. The sampler: its 16 device calls and its 7 pinned
    stagings less the pageable staging the CPU fit holds, per step and sampled row; a row: apply and write-back."""
    with gzip.open(path, "rt") as f:
        head = f.readline()
    calls = pd.read_csv(path, comment="#")
    calls = calls[calls["mode"] == "idle"].set_index(["part", "rows", "name"])["host_us"] * 1e-6
    v = f"vllm 0.6.6.post1's calls replayed, {head.lstrip('# ').strip()}"
    sampler = calls["sampler"].unstack("name")
    stages = sampler.filter(like="stage_").drop(columns="ref_stage_pageable")
    steps = pd.DataFrame({"batch": sampler.index, "launch_s": (
        sampler.drop(columns=[*stages, "ref_stage_pageable"]).sum(axis=1)
        + stages.sub(sampler["ref_stage_pageable"], axis=0).sum(axis=1)).to_numpy()})
    fn = ("Sampler.forward to its sync on a GPU: from_lists' 7 pinned torch.tensor (less a pageable one) and 9 .to, "
          "logits.to(float), div_, softmax, log_softmax, sample_indices.long(), the gather, argmax")
    out = _step_and_row(steps, "launch_s", ("sample_launch_s", "sample_launch_row_s"), v, fn,
                        "sum of the calls' median host time ~ a + b*rows")
    rows = calls["processor"].unstack("name")
    fn = ("XGrammarLogitsProcessor.__call__'s xgr.apply_token_bitmask_inplace"
          " + _apply_logits_processors' logits[i] = row")
    out["row_launch_s"] = param(float((rows["apply_bitmask"] + rows["write_back"]).mean()), "vllm", v, fn,
                                "apply_bitmask + write_back, median host time a row, mean over the batches", None,
                                len(rows))
    return out


def _step_and_row(med: pd.DataFrame, column: str, names: tuple[str, str], version: str, function: str,
                  fit: str) -> dict:
    """A V0 cost per step (``a``) and per row (``b``) of the batch sizes' medians of ``column``."""
    (a, b), r2 = lstsq(med, column, ["batch"])
    return {names[0]: param(a, "vllm", version, function, f"{fit}: a", r2, len(med)),
            names[1]: param(b, "vllm", version, function, f"{fit}: b", r2, len(med))}


def fit_sglang(steps: pd.DataFrame) -> dict:
    steps = steps.assign(wrapper_s=steps.mask_s - steps.raw_fill_s)
    med = steps.groupby(CASE, as_index=False).median(numeric_only=True)
    out: dict[str, dict] = {}
    med = med[med.vocab.isin(PRESET_VOCABS)]  # as for vLLM's accept path: xgrammar's costs rise at 262144
    for backend, cases in med.groupby("backend"):
        v = f"sglang {cases.version.iloc[0]}, {backend} {cases.backend_version.iloc[0]}"
        y = "wrapper_s" if backend == "xgrammar" else "mask_s"
        what = "mask_s - raw_fill_s" if backend == "xgrammar" else "mask_s (includes the fill itself)"
        (f0, f1, f2), r2 = lstsq(cases, y, ["structured_rows", "mask_bytes"])
        fn = "SamplingBatchInfo.update_regex_vocab_mask"
        out[f"{backend}.fill_step_s"] = param(f0, "sglang", v, fn, f"{what} ~ a + b*structured_rows + c*mask_bytes: a", r2, len(cases))
        out[f"{backend}.fill_row_s"] = param(f1, "sglang", v, fn, f"{what} ~ a + b*structured_rows + c*mask_bytes: b", r2, len(cases))
        out[f"{backend}.mask_alloc_byte_s"] = param(f2, "sglang", v, fn + " (allocate_vocab_mask: torch.full of the batch's mask)",
                                                    f"{what} ~ a + b*structured_rows + c*mask_bytes: c", r2, len(cases))
        (a1,), r2 = lstsq(cases, "accept_s", ["structured_rows"], intercept=False)
        out[f"{backend}.accept_row_s"] = param(a1, "sglang", v, "grammar.accept_token + is_terminated + finished "
                                               "(the calls of batch_result_processor._accept_grammar_tokens)",
                                               "accept_s ~ b*structured_rows: b", r2, len(cases))
    return out


def fit_sglang_scheduler(steps: pd.DataFrame) -> dict:
    """Batch forming and result processing of decode steps (``measure_sglang_scheduler.py``), per backend."""
    decode = steps[steps.kind == "decode"]
    med = decode.groupby(CASE, as_index=False).median(numeric_only=True)
    out: dict[str, dict] = {}
    for backend, cases in med.groupby("backend"):
        v = f"sglang {cases.version.iloc[0]}, {backend} {cases.backend_version.iloc[0]}"
        fn = ("ScheduleBatch.merge_batch + filter_batch + check_decode_mem + prepare_for_decode "
              "(Scheduler.get_next_batch_to_run / update_running_batch without retraction)")
        (s0, s1), r2 = lstsq(cases, "schedule_s", ["rows"])
        out[f"{backend}.schedule_s"] = param(s0, "sglang", v, fn, "decode schedule_s ~ a + b*rows: a", r2, len(cases))
        out[f"{backend}.schedule_row_s"] = param(s1, "sglang", v, fn, "decode schedule_s ~ a + b*rows: b", r2, len(cases))
        fn = "SchedulerBatchResultProcessor.process_batch_result_decode"
        fit = "decode process_s ~ a + b*rows + c*structured_rows"
        (p0, p1, p2), r2 = lstsq(cases, "process_s", ["rows", "structured_rows"])
        out[f"{backend}.process_step_s"] = param(p0, "sglang", v, fn, f"{fit}: a", r2, len(cases))
        out[f"{backend}.process_row_s"] = param(p1, "sglang", v, fn, f"{fit}: b", r2, len(cases))
        out[f"{backend}.process_accept_row_s"] = param(
            p2, "sglang", v, fn + " (its grammar accept path: _accept_grammar_tokens, grammar.finished)", f"{fit}: c",
            r2, len(cases))
    return out


def fit_all(folder: Path = ROOT) -> dict:
    """Every engine's fitted parameters from the measurement files in ``folder``."""
    fitted = {"vllm": fit_vllm(pd.read_csv(folder / "vllm_steps.csv.gz")),
              "sglang": {**fit_sglang(pd.read_csv(folder / "sglang_steps.csv.gz")),
                         **fit_sglang_scheduler(pd.read_csv(folder / "sglang_scheduler_steps.csv.gz"))}}
    for key, (engine, name) in VERSIONS.items():
        fitted[key] = {"vllm": fit_vllm}[engine](pd.read_csv(folder / name))
    for key, (name, total_key) in GRAMMAR_ACCEPTS.items():
        fitted[key].update(fit_accept_wrapper(fitted[key], pd.read_csv(folder / name), total_key))
    fitted["vllm-0.10"].update(fit_bitmask_build(pd.read_csv(folder / "vllm-0.10.1_bitmask_build.csv.gz")))
    fitted["vllm-0.6"] = {**fit_v0_processor(pd.read_csv(folder / "vllm-0.6.6_v0_processor.csv.gz")),
                          **fit_v0_sampler(pd.read_csv(folder / "vllm-0.6.6_v0_sampler.csv.gz")),
                          **fit_v0_launches(folder / "vllm-0.6.6_v0_gpu_launch.csv.gz")}
    return fitted


def main() -> None:
    fitted = fit_all()
    (ROOT / "fitted.json").write_text(json.dumps(fitted, indent=1) + "\n")
    for engine, params in fitted.items():
        for name, p in params.items():
            print(f"{engine:7s} {name:32s} {p['value']:.3g}  (R² {p['r2']}, {p['cases']} cases)")


if __name__ == "__main__":
    main()
