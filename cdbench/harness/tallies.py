"""Per-request token counters, kept per step and added to the request table in bulk.

Each step's sampled rows add to their requests' counters (output tokens, and with speculative
decoding or jump-forward, drafts and forced tokens). Adding them every step would cost several small
scattered adds a step; :class:`StepTallies` keeps each step's arrays and sums them every
:data:`ROWS` rows, and once more at the end of a run.

>>> import numpy as np
>>> from cdbench.harness.records import RequestTable
>>> table = RequestTable(3)
>>> tallies = StepTallies(table)
>>> tallies.add([np.array([0, 2]), np.array([1, 4])], 2)
>>> tallies.add([np.array([2]), np.array([3])], 1)
>>> tallies.flush()
>>> table.output_tokens.tolist()
[1, 0, 7]
"""

from __future__ import annotations

import numpy as np

from cdbench.harness.records import DraftPositionCounts, RequestTable

ROWS = 1 << 16  # sampled rows whose counters are kept before they are summed per request


class StepTallies:
    """The counters of the steps not yet summed into ``table``.

    Each step adds its sampled rows' request ids, then one array per counted column, in this
    order: ``output_tokens``; with ``draft_positions``, ``drafted``, ``accepted`` and
    ``rolled_back`` (also counted by draft position there); with ``jump_forward``,
    ``jump_forward_tokens``.

    Parameters
    ----------
    table : the request table whose columns the counters add to.
    draft_positions : speculative decoding's per-position counts (``None``: no drafts counted).
    jump_forward : whether the steps count jump-forward tokens.
    """

    __slots__ = ("_counted", "_columns", "_draft_positions", "_steps", "_rows", "_joined")

    def __init__(self, table: RequestTable, draft_positions: DraftPositionCounts | None = None,
                 jump_forward: bool = False) -> None:
        drafts = ("drafted", "accepted", "rolled_back") if draft_positions is not None else ()
        self._counted = ("output_tokens", *drafts) + (("jump_forward_tokens",) if jump_forward else ())
        self._columns = [getattr(table, name) for name in self._counted]
        self._draft_positions = draft_positions
        self._steps: list[list[np.ndarray]] = []
        self._rows = 0
        # the kept steps' arrays joined, kept between sums: arrays made anew each sum would be given back to the
        # system and faulted in again where nothing else holds the heap (a run of bounded memory)
        self._joined = np.empty((1 + len(self._counted), 0), np.int64)

    def entered(self, table: RequestTable) -> None:
        """``table``'s columns were made anew (more rows): the counters go to the new ones."""
        self._columns = [getattr(table, name) for name in self._counted]

    def add(self, counters: list[np.ndarray], rows: int) -> None:
        """Keep one step's ``counters`` (request ids first) over its ``rows`` sampled rows; the arrays
        are read when summed, so they must not change meanwhile."""
        self._steps.append(counters)
        self._rows += rows
        if self._rows >= ROWS:
            self.flush()

    def flush(self) -> None:
        """Add the kept steps' counters to the request table (and the draft-position counts)."""
        if not self._steps:
            return
        n = sum(len(step[0]) for step in self._steps)
        if self._joined.shape[1] < n:
            self._joined = np.empty((len(self._joined), max(n, 2 * self._joined.shape[1])), np.int64)
        rid, *counters = (np.concatenate(column, out=out, casting="unsafe")
                          for column, out in zip(zip(*self._steps), self._joined[:, :n]))
        for column, values in zip(self._columns, counters):
            np.add.at(column, rid, values)
        if self._draft_positions is not None:
            self._draft_positions.add(*counters[1:4])
        self._steps.clear()
        self._rows = 0
