"""A live run's own host costs, for pricing a model (or hybrid) run of the same workload against it.

``live`` mode runs cdbench's loop, not an engine's: the engines' host work (batch forming, result
processing, the mask wrapper, the bitmask's trip to another process) is a busy wait of the values in
the live run's scheduler configuration, and everything else the loop spends on the host between the
timed parts of a step (staging the inputs, launching the forward, waking on the tokens, the loop's own
bookkeeping of the rows) is the step's measured ``launch_s``. A model run priced with the policy
preset compares two loops' host costs as well as the model; ``costs.host_costs=live-run:<ref>``
prices it with the live run's:

- the host-cost fields the live loop spun, read from its ``config.yaml`` (a field the run's
  configuration lacks did not exist when it ran: the loop spent nothing on it);
- ``launch_s`` + ``launch_row_s`` × rows: a least-squares line through the medians of the live
  decode steps' launch by their row count (weighted by the steps at each count, both coefficients
  non-negative); ``launch_prefill_s``: the median launch of its steps with prefill chunks, less the
  rows' part.

>>> LIVE_RUN_PREFIX
'live-run:'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from cdbench.harness.policies import HOST_COST_FIELDS
from cdbench.results.errors import ResultsError

if TYPE_CHECKING:
    from cdbench.results.run_folder import SavedRun

LIVE_RUN_PREFIX = "live-run:"

#: the fields the live loop spends as busy waits of their configured value (``cdbench/harness/live/step.py``)
SPUN_FIELDS = tuple(f for f in HOST_COST_FIELDS if not f.startswith("launch")) + ("think_filter_s",)


@dataclass(frozen=True)
class LiveLoopCosts:
    """The host costs of the live run ``source``: ``values`` by scheduler field, from ``decode_steps``
    decode-only steps and ``prefill_steps`` steps with prefill chunks."""

    source: str
    values: dict[str, float | None]
    decode_steps: int
    prefill_steps: int


def fit_launch(steps: pd.DataFrame) -> tuple[float, float, float | None, int, int]:
    """``(launch_s, launch_row_s, launch_prefill_s, decode steps, prefill steps)`` from a step log's
    non-idle steps (see the module doc); ``launch_prefill_s`` is ``None`` when no step had prefill chunks.

    >>> steps = pd.DataFrame({"kind": ["decode"] * 4 + ["prefill"], "rows": [1, 1, 3, 3, 1],
    ...                       "prefill_tokens": [0, 0, 0, 0, 64], "launch_s": [2.0, 2.2, 2.4, 2.6, 1.3]})
    >>> [round(v, 6) for v in fit_launch(steps)[:3]]
    [1.9, 0.2, 1.1]
    """
    ran = steps[steps["kind"] != "idle"]
    decode = ran[ran["prefill_tokens"] == 0]
    prefill = ran[ran["prefill_tokens"] > 0]
    if decode.empty:
        raise ValueError("no decode step to fit the launch on")
    by_rows = decode.groupby("rows")["launch_s"].agg(["median", "size"])
    weight = np.sqrt(by_rows["size"].to_numpy(float))
    rows = by_rows.index.to_numpy(float)
    (launch_s, launch_row_s), _ = nnls(np.column_stack([weight, weight * rows]), weight * by_rows["median"].to_numpy())
    launch_prefill_s = None
    if not prefill.empty:
        launch_prefill_s = max(0.0, float((prefill["launch_s"] - launch_row_s * prefill["rows"]).median()))
    return float(launch_s), float(launch_row_s), launch_prefill_s, len(decode), len(prefill)


def open_live_run(ref: str, what: str, columns: tuple[str, ...]) -> SavedRun:
    """The live run ``ref`` (a run folder or ``PACK::RUN``) whose steps give its ``what`` (``costs.host_costs``
    and ``costs.forward_speed`` read it so); :class:`ResultsError` naming it when it is no live run, or kept no
    step log with ``columns``."""
    from cdbench.results.pack import open_run

    run = open_run(ref)
    mode = run.config.get("mode")
    if mode != "live":
        raise ResultsError(f"{ref} is a {mode} run, not a live run: it measured no {what}")
    if run.steps.empty:
        raise ResultsError(f"{ref} kept no step log (steps.parquet) to measure its {what} from")
    missing = [c for c in columns if c not in run.steps.columns]
    if missing:
        raise ResultsError(f"{ref}: its step log has no {', '.join(missing)} column (a run older than them): it "
                           f"cannot give its {what}")
    return run


def live_loop_costs(ref: str) -> LiveLoopCosts:
    """The host costs of the live run ``ref`` (a run folder or ``PACK::RUN``); :class:`ResultsError`
    naming it when it is not a live run with its step log."""
    run = open_live_run(ref, "host costs", ("launch_s",))
    scheduler = run.config.get("scheduler") or {}
    values: dict[str, float | None] = {field: float(scheduler.get(field) or 0.0) for field in SPUN_FIELDS}
    try:
        launch_s, launch_row_s, launch_prefill_s, n_decode, n_prefill = fit_launch(run.steps)
    except ValueError as err:
        raise ResultsError(f"{ref}: {err}") from None
    values.update(launch_s=launch_s, launch_row_s=launch_row_s, launch_prefill_s=launch_prefill_s)
    return LiveLoopCosts(run.ref, values, n_decode, n_prefill)


__all__ = ["LIVE_RUN_PREFIX", "SPUN_FIELDS", "LiveLoopCosts", "fit_launch", "live_loop_costs", "open_live_run"]
