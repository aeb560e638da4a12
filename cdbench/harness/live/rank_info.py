"""What a run of several rank processes measured (:mod:`.ranks`), as ``live.json`` holds it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Parallel = Literal["tp", "dp"]
_QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Spread:
    """Quantiles and mean of a measured quantity (seconds), with its count."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float] | np.ndarray) -> Spread:
        v = np.asarray(values, float)
        v = v[np.isfinite(v)]
        if not len(v):
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        return cls(len(v), float(v.mean()), *(float(np.quantile(v, q)) for q in _QUANTILES))


@dataclass(frozen=True)
class RanksInfo:
    """What a run of several rank processes measured (the ``ranks`` entry of ``live.json``).

    all_gather_s : each poll's grammar all_gather (the exchange alone, after a barrier), every rank's.
    step_agree_s : each step's exchange of durations (tp).
    step_skew_s : per step, the slowest rank's duration minus the fastest's (tp): what the others wait.
    step_lag_s : per step, the slowest rank's duration minus the ranks' median (tp): what the step pays
        for its slowest rank (:func:`~.rank_steps.step_skew`).
    compile_skew_s : per compiled request, the latest rank's compile end minus the earliest's (tp).
    compile_sigma : the spread of one spec's compile time among the ranks, as a lognormal sigma (tp): the
        model's ``rank_jitter``.
    fill_offset, fill_sigma : the other ranks' mask fill of a step against rank 0's, as a lognormal of the
        ratio: its mean log and spread (tp, :func:`~.rank_steps.fill_spread`): the model's
        ``rank_fill_offset`` and ``rank_fill_jitter``.
    all_reduce_s : the forward's all-reduce of ``tokens`` rows of the hidden size (tp, timed alone at start).
    requests, steps, busy_s : per rank: requests run, steps, summed step durations.
    """

    parallel: Parallel
    ranks: int
    devices: list[str]
    all_gather_s: Spread | None = None
    step_agree_s: Spread | None = None
    step_skew_s: Spread | None = None
    step_lag_s: Spread | None = None
    compile_skew_s: Spread | None = None
    compile_sigma: float | None = None
    fill_sigma: float | None = None
    fill_offset: float | None = None
    all_reduce_s: dict[int, float] = field(default_factory=dict)
    requests: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)

    @property
    def all_reduce_token_s(self) -> float | None:
        """One all-reduce's time per row where it is bandwidth-bound: the slope between the two largest
        sizes timed (the launch and synchronisation each timing holds cancel); None below two sizes."""
        if len(self.all_reduce_s) < 2:
            return None
        (small, small_s), (large, large_s) = sorted(self.all_reduce_s.items())[-2:]
        return (large_s - small_s) / (large - small)
