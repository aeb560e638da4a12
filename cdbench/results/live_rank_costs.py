"""A live tensor-parallel run's measured rank prices, for a model (or hybrid) run of the same ranks.

``costs.rank_costs=live-run:<ref>`` (a run folder or ``PACK::RUN``, resolved as ``costs.host_costs`` resolves
its live run, :mod:`cdbench.results.live_loop_costs`) replaces the scheduler's rank prices with what the
live run's rank processes measured:

- ``all_gather_s``: the median grammar all_gather of a poll (``live.json``'s ``ranks.all_gather_s``);
- ``rank_jitter``: the spread of one spec's compile time among the ranks (``ranks.compile_sigma``), and
  ``rank_jitter_by_size`` that spread by the compile's size, from the run's requests
  (:func:`~cdbench.harness.live.ranks.compile_sigma_by_size`; ``None`` where they kept no compile spread);
- ``rank_fill_ratios``: each step's slowest rank's mask fill over rank 0's (whose fills the grammar profile
  keeps) beside rank 0's fill, from every rank's own step records (``rank_steps.parquet``,
  :func:`~cdbench.harness.live.rank_steps.fill_ratios`): what a priced step waits for, read from the
  measured steps of about its fill; ``rank_fill_offset``, ``rank_fill_jitter``: the same as one lognormal
  (:func:`~cdbench.harness.live.rank_steps.fill_spread`), kept in the configuration as a summary.

The live run must be tensor-parallel with as many ranks as the configuration's (a data-parallel run's ranks
do not agree: there is nothing to price).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import pandas as pd

from cdbench.harness.live.rank_steps import RANK_STEPS_FILE, fill_ratios, fill_spread
from cdbench.results.errors import ResultsError


@dataclass(frozen=True)
class LiveRankCosts:
    """The rank prices of the live run ``source`` (``values`` by scheduler field), its ``ranks`` and the
    ``steps`` of its records that every rank filled."""

    source: str
    ranks: int
    values: dict[str, float | tuple[tuple[float, float], ...]]
    steps: int


def live_rank_costs(ref: str) -> LiveRankCosts:
    """The rank prices of the live run ``ref``; :class:`ResultsError` naming it when it is not a live
    tensor-parallel run with its ranks' records."""
    from cdbench.harness.live.ranks import compile_sigma_by_size, model_parameters, ranks_info_of
    from cdbench.results.pack import open_run
    from cdbench.results.run_folder import LIVE_FILE

    run = open_run(ref)
    mode = run.config.get("mode")
    if mode != "live":
        raise ResultsError(f"{ref} is a {mode} run: its ranks' costs are priced, not measured (name a live run)")
    text = run.read_file(LIVE_FILE)
    if text is None:
        raise ResultsError(f"{ref} kept no {LIVE_FILE}")
    try:
        info = ranks_info_of(text, f"{ref}/{LIVE_FILE}")
    except (ValueError, TypeError) as err:
        raise ResultsError(str(err)) from None
    if info.parallel != "tp":
        raise ResultsError(f"{ref} is a {info.parallel} run of {info.ranks} ranks: they never wait for each other "
                           "(name a tensor-parallel run)")
    records = run.read_file(RANK_STEPS_FILE)
    if records is None:
        raise ResultsError(f"{ref} kept no {RANK_STEPS_FILE}: its ranks' own steps were not recorded")
    steps = pd.read_parquet(io.BytesIO(records))
    spread = fill_spread(steps)
    values = model_parameters(info)
    values.pop("ranks")
    values["rank_fill_offset"] = spread.offset if spread else 0.0
    values["rank_fill_jitter"] = spread.sigma if spread else 0.0
    requests = run.read_file("requests.parquet")
    values["rank_jitter_by_size"] = None if requests is None else \
        compile_sigma_by_size(pd.read_parquet(io.BytesIO(requests)), info.ranks)
    values["rank_fill_ratios"] = tuple((float(f"{f:.4g}"), float(f"{r:.4g}")) for f, r in fill_ratios(steps)) or None
    filled = int((steps[steps["fill_s"] > 0].groupby("step").size() == info.ranks).sum())
    return LiveRankCosts(run.ref, info.ranks, values, filled)


__all__ = ["LiveRankCosts", "live_rank_costs"]
