"""Each rank's own step records in a run of several rank processes (``rank_steps.parquet`` of its run folder).

A tensor-parallel run's step log is rank 0's, and each step's duration there is the slowest rank's (the
ranks agree on it, :class:`~cdbench.harness.live.ranks.AgreeingLiveStep`). What each rank spent on its own is
kept here, one row a rank and busy step:

- ``local_s``: the rank's own wall time of the step, before the agreement;
- ``wait_s``: what it waited for the slowest rank (the agreed duration minus its own);
- ``agree_s``: the wall time of the exchange of durations (its wait for the last rank to arrive included);
- ``forward_s``, ``fill_s``, ``launch_s``, ``sync_s``: its own forward (its shard, all-reduces included), its
  own grammar's mask fill, its own launch (its step's wall time beyond the timed parts) and its poll's
  grammar all_gather.

A data-parallel rank runs its own batches and waits for no one: its rows are its step log's, ``wait_s`` and
``agree_s`` 0. :func:`step_skew` reads a tensor-parallel run's records as the skew each step paid, the slowest
rank's own time minus the ranks' median; :func:`fill_spread` how the other ranks' fill of a step compares
with rank 0's, the model's ``rank_fill_offset`` and ``rank_fill_jitter``; :func:`fill_ratios` each step's
slowest fill over rank 0's beside rank 0's fill, the model's ``rank_fill_ratios``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

RANK_STEPS_FILE = "rank_steps.parquet"
_FROM_LOG = ("start_s", "kind", "rows", "prefill_tokens", "grammar_rows", "duration_s", "forward_s", "fill_s",
             "sync_s")
RANK_STEP_COLUMNS = ("rank", "step", *_FROM_LOG, "local_s", "wait_s", "agree_s", "launch_s")


def rank_step_frame(rank: int, steps: pd.DataFrame, local_s: Sequence[float] | None = None,
                    agree_s: Sequence[float] | None = None) -> pd.DataFrame:
    """Rank ``rank``'s records from its step log ``steps`` (idle rows left out) and, for a tensor-parallel
    rank, its busy steps' own durations ``local_s`` and exchange times ``agree_s`` (in step order).

    >>> log = pd.DataFrame({"start_s": [0.0, 0.1, 0.2], "kind": ["prefill", "idle", "decode"], "rows": [1, 0, 1],
    ...                     "prefill_tokens": [8, 0, 0], "grammar_rows": [1, 0, 1], "duration_s": [0.1, 0.1, 0.05],
    ...                     "forward_s": [0.06, 0.0, 0.03], "fill_s": [0.01, 0.0, 0.02], "sync_s": [0.0] * 3,
    ...                     "launch_s": [0.03, 0.0, 0.01]})
    >>> rank_step_frame(1, log, [0.08, 0.05], [0.001, 0.0])[["step", "local_s", "wait_s", "launch_s"]].round(3)
       step  local_s  wait_s  launch_s
    0     0     0.08    0.02      0.01
    1     2     0.05    0.00      0.01
    """
    busy = steps["kind"].to_numpy() != "idle"
    frame = steps.loc[busy, list(_FROM_LOG)].reset_index(drop=True)
    frame.insert(0, "step", np.flatnonzero(busy))
    frame.insert(0, "rank", rank)
    duration = frame["duration_s"].to_numpy()
    if local_s is None:
        local, agree = duration, np.zeros(len(frame))
    else:
        local, agree = np.asarray(local_s, float), np.asarray(agree_s, float)
        if len(local) != len(frame) or len(agree) != len(frame):
            raise ValueError(f"rank {rank}: {len(local)} own step times for {len(frame)} busy steps in its log")
    wait = duration - local
    frame["local_s"], frame["wait_s"], frame["agree_s"] = local, wait, agree
    frame["launch_s"] = steps.loc[busy, "launch_s"].to_numpy() - wait  # the log's launch holds the wait
    return frame[list(RANK_STEP_COLUMNS)]


def step_skew(rank_steps: pd.DataFrame) -> pd.DataFrame:
    """Per step of a tensor-parallel run's records: the slowest rank's own time minus the ranks' median
    (``skew_s``), the slowest rank, and its fill's part of it (the slowest rank's fill minus the median fill).

    >>> recs = pd.DataFrame({"rank": [0, 1, 0, 1], "step": [0, 0, 3, 3], "local_s": [1.0, 1.4, 2.0, 2.0],
    ...                      "fill_s": [0.1, 0.5, 0.2, 0.2]})
    >>> step_skew(recs).round(3).to_dict("list")
    {'step': [0, 3], 'skew_s': [0.2, 0.0], 'slowest': [1, 0], 'fill_skew_s': [0.2, 0.0]}
    """
    local = rank_steps.pivot(index="step", columns="rank", values="local_s")
    fill = rank_steps.pivot(index="step", columns="rank", values="fill_s").reindex_like(local)
    slowest = local.to_numpy().argmax(axis=1)
    picked = np.arange(len(local))
    return pd.DataFrame({
        "step": local.index.to_numpy(),
        "skew_s": local.max(axis=1).to_numpy() - local.median(axis=1).to_numpy(),
        "slowest": local.columns.to_numpy()[slowest],
        "fill_skew_s": fill.to_numpy()[picked, slowest] - fill.median(axis=1).to_numpy()})


@dataclass(frozen=True)
class FillSpread:
    """How the other ranks' mask fill of a step compares with rank 0's, as a lognormal of the ratio
    (another rank's fill over rank 0's): ``offset`` its mean log (a rank whose host fills faster or slower
    throughout the run), ``sigma`` the step-to-step spread about it. Rank 0's is the fill a run's grammar
    profile keeps, so a model run pricing the step's wait for the slowest rank multiplies that fill by
    ``max(1, ratio)`` over the other ranks (model and hybrid mode's ``rank_fill_offset``, ``rank_fill_jitter``)."""

    offset: float
    sigma: float


def fill_spread(rank_steps: pd.DataFrame) -> FillSpread | None:
    """The other ranks' fill of a step against rank 0's (:class:`FillSpread`), from a tensor-parallel run's
    records; each step weighted by its ranks' mean fill (the long fills are the ones the steps wait for; a step of a
    few microseconds of fill has a wide relative spread that no step pays; the mean of all ranks, as rank 0's
    alone would lean the offset towards rank 0's longer draws). ``None`` without a step that every rank filled.

    >>> rng = np.random.default_rng(0)
    >>> base = rng.lognormal(-6, 1, 2000)
    >>> recs = pd.DataFrame({"rank": np.repeat([0, 1], 2000), "step": np.tile(np.arange(2000), 2),
    ...                      "fill_s": np.concatenate([base, base * rng.lognormal(-0.2, 0.3, 2000)])})
    >>> spread = fill_spread(recs)
    >>> round(spread.offset, 1), round(spread.sigma, 1)
    (-0.2, 0.3)
    """
    fills = rank_steps.pivot(index="step", columns="rank", values="fill_s").to_numpy().T
    if fills.shape[0] < 2:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(fills)
    filled = np.isfinite(logs).all(axis=0)
    if not filled.any():
        return None
    ratios = (logs[1:, filled] - logs[0, filled]).ravel()
    weight = np.tile(fills[:, filled].mean(axis=0), fills.shape[0] - 1)
    offset = float((weight * ratios).sum() / weight.sum())
    return FillSpread(offset, float(np.sqrt((weight * (ratios - offset) ** 2).sum() / weight.sum())))


def fill_ratios(rank_steps: pd.DataFrame) -> tuple[tuple[float, float], ...]:
    """Each step of a tensor-parallel run's records that every rank filled, as (rank 0's fill, the slowest
    rank's fill over rank 0's), in order of rank 0's fill: what a model run's step waits for given the fill its
    grammar profile (rank 0's) prices, read from steps of about the same fill
    (:class:`~cdbench.harness.step_cost.StepPricer`). Unlike :func:`fill_spread`'s one lognormal, it keeps
    that the ratio depends on the fill: rank 0's longest fills are long partly by rank 0's own draw, so
    another rank rarely takes longer there (three TP=2 copies on two H200s, ``reports/fidelity/
    live_vs_model.md``, "Under capacity with 150 requests"), and a ratio drawn regardless of the fill
    lengthens exactly the steps that make the tail.

    >>> recs = pd.DataFrame({"rank": [0, 1, 0, 1, 0, 1], "step": [0, 0, 1, 1, 2, 2],
    ...                      "fill_s": [0.004, 0.006, 0.150, 0.120, 0.0, 0.001]})
    >>> fill_ratios(recs)
    ((0.004, 1.5), (0.15, 1.0))
    """
    fills = rank_steps.pivot(index="step", columns="rank", values="fill_s")
    fills = fills[(fills > 0).all(axis=1)]
    if fills.shape[1] < 2 or fills.empty:
        return ()
    own = fills[0].to_numpy()
    ratio = fills.max(axis=1).to_numpy() / own
    order = np.argsort(own, kind="stable")
    return tuple((float(f), float(r)) for f, r in zip(own[order], ratio[order], strict=True))


__all__ = ["RANK_STEPS_FILE", "RANK_STEP_COLUMNS", "FillSpread", "fill_ratios", "fill_spread", "rank_step_frame",
           "step_skew"]
