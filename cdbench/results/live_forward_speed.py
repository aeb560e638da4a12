"""A live run's forward speed, for pricing a model (or hybrid) run at the speed of the host it ran on.

``costs.forward_speed=live-run:<ref>`` fits :class:`~cdbench.harness.costs.forward_speed.ForwardSpeed` from
the live run's steps against the forward model of the run being configured (its model, GPU, TP and
calibration; the live run's must be the same): each step's measured forward over the model's price of its
shape (:func:`step_ratios`), decode-only steps priced as model mode prices the live run's CUDA-graph
replays (:func:`~cdbench.harness.policies.padded_decode`), steps with prefill chunks priced with the prompts they admitted (:func:`prefill_prompts`), and in a run
drafting with the model's MTP head the head's passes added where a step verified drafts (the live step's
forward holds them); the fit's rule is :mod:`cdbench.harness.costs.forward_speed`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from pydantic import ValidationError

from cdbench.harness.costs.forward import ForwardCostModel, attention_pairs
from cdbench.harness.costs.forward_speed import (
    ForwardSpeed,
    ForwardSpeedError,
    fit_speed,
)
from cdbench.harness.costs.hardware import (
    SpecFileError,
    UnknownSpecError,
    resolve_gpu,
    resolve_model,
)
from cdbench.harness.policies import padded_decode
from cdbench.results.errors import ResultsError
from cdbench.results.live_loop_costs import LIVE_RUN_PREFIX, open_live_run

if TYPE_CHECKING:
    from cdbench.harness.config import CostConfig

#: what a live run's step log must hold to price its forwards
STEP_SHAPE_COLUMNS = ("forward_s", "prefill_tokens", "decode_tokens", "context_tokens")


def prefill_prompts(steps: pd.DataFrame, requests: pd.DataFrame) -> dict[int, np.ndarray]:
    """The prompts each step with prefill chunks ran, by step index: a request's prefill is the first
    such step whose span ends after its admission (a loop with overlap admits while the step before
    runs). Only steps whose prompts add up to their ``prefill_tokens`` are kept.

    >>> steps = pd.DataFrame({"start_s": [0.0, 1.0, 2.0], "duration_s": [1.0, 1.0, 1.0],
    ...                       "prefill_tokens": [30, 0, 7]})
    >>> requests = pd.DataFrame({"admitted_s": [0.2, 0.5, 1.5], "prompt_len": [10, 20, 8]})
    >>> {k: v.tolist() for k, v in prefill_prompts(steps, requests).items()}
    {0: [10, 20]}
    """
    prefill = steps[steps["prefill_tokens"] > 0]
    admitted = requests.dropna(subset=["admitted_s"])
    ends = (prefill["start_s"] + prefill["duration_s"]).to_numpy()
    at = np.searchsorted(ends, admitted["admitted_s"].to_numpy(), side="right")
    inside = at < len(prefill)
    step_of = prefill.index.to_numpy()[at[inside]]
    prompts = pd.Series(admitted["prompt_len"].to_numpy()[inside]).groupby(step_of).agg(list)
    tokens = prefill["prefill_tokens"]
    return {int(i): np.asarray(p, np.int64) for i, p in prompts.items() if sum(p) == tokens[i]}


def _drafting_s(steps: pd.DataFrame, forward: ForwardCostModel, mtp_drafts: int) -> np.ndarray:
    """The MTP head's ``mtp_drafts`` passes over each step's decode rows where the step verified drafts (the
    head drafts inside the step after verifying, as model mode prices it); 0 without an MTP drafter."""
    if not mtp_drafts or steps.empty:
        return np.zeros(len(steps))
    rows, context = steps["decode_rows"].to_numpy(), steps["context_tokens"].to_numpy()
    drafted = steps["decode_tokens"].to_numpy() > rows
    return np.array([forward.mtp_draft_s(int(r), mtp_drafts, int(c)) if d else 0.0
                     for r, c, d in zip(rows, context, drafted, strict=True)])


def step_ratios(steps: pd.DataFrame, requests: pd.DataFrame, forward: ForwardCostModel,
                graph_sizes: Sequence[int], mtp_drafts: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """``(decode ratios, prefill ratios, steps with prefill chunks left out)``: each forward step's measured
    ``forward_s`` over ``forward``'s price of its shape (module doc), with the MTP head's ``mtp_drafts``
    passes where the run drafted with it (:func:`priced_steps` with the prefill steps' tokens)."""
    decode, prefill, _, left_out = priced_steps(steps, requests, forward, graph_sizes, mtp_drafts)
    return decode, prefill, left_out


def priced_steps(steps: pd.DataFrame, requests: pd.DataFrame, forward: ForwardCostModel, graph_sizes: Sequence[int],
                 mtp_drafts: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """:func:`step_ratios`' ``(decode ratios, prefill ratios, each prefill ratio's step's prefill tokens,
    steps with prefill chunks left out)``."""
    ran = steps[(steps["kind"] != "idle") & (steps["forward_s"] > 0)]
    decode = ran[(ran["prefill_tokens"] == 0) & (ran["decode_tokens"] > 0)]
    tokens, context = decode["decode_tokens"].to_numpy(), decode["context_tokens"].to_numpy()
    padded = np.array([padded_decode(graph_sizes, int(n), int(c)) for n, c in zip(tokens, context)],
                      np.int64).reshape(-1, 2)
    decode_price = forward.step_s_array(0, 0, padded[:, 0], padded[:, 1]) + _drafting_s(decode, forward, mtp_drafts)
    decode_ratios = decode["forward_s"].to_numpy() / decode_price
    with_prefill = ran[ran["prefill_tokens"] > 0]
    prompts = prefill_prompts(steps, requests)
    known = with_prefill[with_prefill.index.isin(list(prompts))]
    chunks = [prompts[i] for i in known.index]
    prefill_price = forward.step_s_array(
        known["prefill_tokens"].to_numpy(), [attention_pairs(p, 0).sum() for p in chunks],
        known["decode_tokens"].to_numpy(), known["context_tokens"].to_numpy(), [len(p) for p in chunks]
    ) + _drafting_s(known, forward, mtp_drafts)
    prefill_ratios = known["forward_s"].to_numpy() / prefill_price if len(known) else np.zeros(0)
    return decode_ratios, prefill_ratios, known["prefill_tokens"].to_numpy(), len(with_prefill) - len(known)


def _rank_logs(steps: pd.DataFrame, requests: pd.DataFrame) -> list[tuple[pd.DataFrame, pd.DataFrame]]:
    """Each rank's own step log (in time order) with the requests it ran: a data-parallel run keeps every
    rank's steps in one log, and a request's prefill is found among its own rank's steps only."""
    if "rank" not in steps or "rank" not in requests:
        return [(steps, requests)]
    return [(own.sort_values("start_s", kind="stable"), requests[requests["rank"] == rank])
            for rank, own in steps.groupby("rank", sort=True)]


def live_forward_speed(ref: str, costs: CostConfig) -> ForwardSpeed:
    """The forward speed of the live run ``ref`` (a run folder or ``PACK::RUN``) against the forward model of
    ``costs``; :class:`ResultsError` naming ``ref`` and the reason when it cannot give one."""
    from cdbench.harness.config import RunConfig

    run = open_live_run(ref, "forward speed", STEP_SHAPE_COLUMNS)
    try:
        live = RunConfig.model_validate(run.config)
    except ValidationError as err:
        raise ResultsError(f"{ref}: its config.yaml does not validate: {err.errors()[0]['msg']}") from None
    try:
        ran = (resolve_model(live.costs.model).name, resolve_gpu(live.costs.gpu).name, live.costs.tp)
        target = (resolve_model(costs.model).name, resolve_gpu(costs.gpu).name, costs.tp)
    except (UnknownSpecError, SpecFileError) as err:
        raise ResultsError(f"{ref}: {err}") from None
    if ran != target:
        raise ResultsError(f"{ref} ran {ran[0]} on {ran[1]} at tp={ran[2]}; this run prices {target[0]} on "
                           f"{target[1]} at tp={target[2]}: its forward speed does not carry over")
    forward = costs.model_copy(update={"forward_speed": 1.0}).build()
    sizes = live.scheduler_config().cuda_graph_sizes
    spec = live.workload.spec_decode
    mtp_drafts = spec.k if spec.drafter == "mtp" else 0
    decode, prefill, tokens, left_out = [], [], [], 0
    for steps, requests in _rank_logs(run.steps, run.requests):
        d, p, t, n = priced_steps(steps, requests, forward, sizes, mtp_drafts)
        decode.append(d)
        prefill.append(p)
        tokens.append(t)
        left_out += n
    decode, prefill, tokens = np.concatenate(decode), np.concatenate(prefill), np.concatenate(tokens)
    try:
        return fit_speed(decode, prefill, f"{LIVE_RUN_PREFIX}{ref}", left_out, prefill_tokens=tokens)
    except ForwardSpeedError as err:
        raise ResultsError(str(err)) from None


__all__ = ["STEP_SHAPE_COLUMNS", "live_forward_speed", "prefill_prompts", "priced_steps", "step_ratios"]
