"""The running batch: one entry a request in the engine, as a struct of numpy arrays."""

from __future__ import annotations

import numpy as np

_NAN_BITS = int(np.array(np.nan).view(np.int64))  # last_tok's NaN as the int64 it is stored as


class RunningBatch:
    """The running batch as a struct of arrays (one entry a running request).

    The columns (:attr:`INTS`, then ``last_tok`` as the bits of its float64
    values) are rows of one 2-D array, so adding and dropping requests is one
    gather rather than one per column; each column is a view.

    Parameters
    ----------
    entry : every request's :attr:`INTS` as it enters (one column a request, indexed by ``rid``).
    """

    INTS = ("rid", "prefill_left", "cached", "gen_left", "think_left")
    __slots__ = ("_ints", "_entry", "last_tok", *INTS)

    def __init__(self, entry: np.ndarray) -> None:
        nan_bits = np.full(entry.shape[1], np.nan).view(np.int64)  # last_tok: NaN until the first token
        self._entry = np.vstack((entry, nan_bits))
        self._set(self._entry[:, :0].copy())

    def _set(self, ints: np.ndarray) -> None:
        self._ints = ints
        self.rid, self.prefill_left, self.cached, self.gen_left, self.think_left, last_tok = ints
        self.last_tok = last_tok.view(np.float64)

    @property
    def entry_prefill(self) -> np.ndarray:
        """Each request's tokens to prefill when it is admitted (its prompt; after a preemption, every
        token it had computed): a view, indexed by ``rid``."""
        return self._entry[1]

    def enter(self, rids: np.ndarray, prompt: np.ndarray, gen_total: np.ndarray, think: np.ndarray) -> None:
        """Requests ``rids``' entries as they enter (over the requests that held their slots before)."""
        entry = self._entry
        entry[0, rids] = rids
        entry[1, rids] = prompt
        entry[2, rids] = 0
        entry[3, rids] = gen_total
        entry[4, rids] = think
        entry[5, rids] = _NAN_BITS

    def grow(self, n: int) -> None:
        """Entries for ``n`` requests (the new ones empty)."""
        more = np.zeros((self._entry.shape[0], n - self._entry.shape[1]), np.int64)
        more[0] = np.arange(self._entry.shape[1], n)
        more[-1] = _NAN_BITS
        self._entry = np.concatenate((self._entry, more), axis=1)

    def __len__(self) -> int:
        return len(self.rid)

    def append(self, rids: np.ndarray) -> None:
        """Add requests ``rids`` at the end, in that order."""
        # take: several times cheaper than fancy indexing along the second axis
        self._set(np.concatenate((self._ints, self._entry.take(rids, axis=1)), axis=1))

    def park(self, rows: np.ndarray) -> None:
        """Store ``rows``' state as their requests' entry, with their KV gone: when they are admitted again,
        every token they had computed (prompt and output) is prefilled anew; what is left to generate,
        to think and the last token's time are kept (a preempted request's recompute)."""
        state = self._ints[:, rows]
        state[1] += state[2]  # prefill_left: the tokens to recompute
        state[2] = 0
        self._entry[:, state[0]] = state

    def keep(self, rows: np.ndarray) -> None:
        """Keep only ``rows`` (increasing row indices), in order."""
        self._set(self._ints.take(rows, axis=1))
