"""Draft tokens for speculative decoding, with a tunable acceptance rate.

At output position ``p`` a draft of length ``k`` is the oracle tokens
``p .. p+k-1``, each replaced independently with probability ``1 - alpha`` by
a different token. Half of the replacements are plausible (the token another
valid instance of the same spec has at that position, else a token seen in the
instance pool), half are a random non-special token, so verification and
grammar rollback see both grammar-valid and grammar-invalid drafts.

This is the one draft source of the project: ``hybrid`` mode uses it for every
request that carries oracle tokens (a request without them proposes no drafts).

>>> from cdbench.backends.vocab import load_vocab
>>> from cdbench.workloads.request import Request
>>> req = Request(0, 0.0, 8, 3, output_tokens=(10, 11, 12))
>>> DraftSource(alpha=1.0, vocab=load_vocab("cl100k"), seed=0).propose(req, 1, 4)
[11, 12]
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from cdbench.backends.vocab import Vocabulary
from cdbench.workloads.instances import InstancePool
from cdbench.workloads.request import Request

_TO_UNIT = 1.0 / (1 << 53)  # a 53-bit integer times this is a double in [0, 1)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# odd multipliers that spread request ids and positions over the 64-bit key space before mixing
_ROW, _POSITION = np.uint64(0xD1B54A32D192ED03), np.uint64(0xAEF17502108EF2D9)
_BLOCK = 64  # requests whose drafts are drawn together, on first use


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, a bijective 64-bit mixer, elementwise on a ``uint64`` array.

    A counter-based stream: numpy has no vectorized one (its Philox takes one
    key per generator), and a generator per request or call costs about as
    much as a grammar fill.
    """
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def draft_lists(block: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    """Each row's drafts from :meth:`DraftSource.propose_block`: ``block[i, :counts[i]]`` as a list."""
    lists = block.tolist()
    for i in np.flatnonzero(counts < block.shape[1]).tolist():  # the few rows near their output's end
        lists[i] = lists[i][:counts[i]]
    return lists


@dataclass(frozen=True)
class OracleTokens:
    """The output tokens of a list of requests back to back.

    Request ``i``'s tokens are ``tokens[start[i]:start[i] + length[i]]``;
    ``present[i]`` says whether it has output tokens at all (``length`` is 0
    without), ``request_id[i]`` is its id.
    """

    tokens: np.ndarray
    start: np.ndarray
    length: np.ndarray
    present: np.ndarray
    request_id: np.ndarray

    @classmethod
    def of(cls, requests: Sequence[Request]) -> OracleTokens:
        n = len(requests)
        oracles = [r.output_tokens for r in requests]
        length = np.fromiter((len(o) if o is not None else 0 for o in oracles), np.int64, count=n)
        start = np.zeros(n, np.int64)
        np.cumsum(length[:-1], out=start[1:])
        tokens = np.fromiter(chain.from_iterable(o for o in oracles if o), np.int64, count=int(length.sum()))
        present = np.fromiter((o is not None for o in oracles), bool, count=n)
        request_id = np.fromiter((r.request_id for r in requests), np.int64, count=n)
        return cls(tokens, start, length, present, request_id)


class DraftSource:
    """Proposes draft tokens; deterministic given ``seed``, request id and position.

    ``pools`` maps a request's ``spec_id`` to its instance pool; without it,
    plausible replacements come from the request's own output tokens.

    Three uniforms decide each draft token (replace it? plausible or random?
    which one?); they are a hash of ``(seed, request id, position, offset)``,
    so proposals do not depend on call order (the same drafts under every
    policy) and a longer draft starts with the shorter one's tokens.
    :meth:`propose_rows` proposes for a whole step's rows with array
    operations; :meth:`propose` is the same for one request.
    """

    def __init__(self, alpha: float, vocab: Vocabulary, seed: int, pools: Mapping[str, InstancePool] | None = None) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha = alpha
        self.vocab = vocab
        self.seed = seed
        self.pools = pools or {}
        forbidden = np.fromiter(vocab.forbidden_token_ids, dtype=np.int64)
        self._plain = np.setdiff1d(np.arange(vocab.size, dtype=np.int64), forbidden)
        self._seed_word = np.uint64(seed % (1 << 64))
        self._columns = np.zeros(0, np.uint64)
        self._oracle: OracleTokens | None = None  # the one the drafts table was drawn for
        self._drafts = np.zeros((0, 0), np.int32)
        self._drawn = np.zeros(0, bool)  # per block of requests: drafts drawn
        self._seen: dict[str, list[int]] = {}  # spec id -> sorted distinct tokens of its pool

    def propose(self, request: Request, position: int, k: int) -> list[int]:
        """Up to ``k`` draft tokens following the first ``position`` output tokens.

        Fewer than ``k`` near the end of the output; empty for requests without
        output tokens.
        """
        n = min(k, len(request.output_tokens or ()) - position)
        if n <= 0:
            return []
        oracle = OracleTokens.of([request])
        return self._draw([request], oracle, np.zeros(1, np.int64), np.array([position]), n)[0].tolist()

    def propose_rows(self, requests: Sequence[Request], oracle: OracleTokens, rows: np.ndarray,
                     positions: np.ndarray, ks: np.ndarray) -> list[list[int]]:
        """:meth:`propose` for ``requests[rows[i]]`` at ``positions[i]`` with ``ks[i]`` drafts, each i;
        ``oracle`` holds the output tokens of ``requests``."""
        return draft_lists(*self.propose_block(requests, oracle, rows, positions, ks))

    def propose_block(self, requests: Sequence[Request], oracle: OracleTokens, rows: np.ndarray,
                      positions: np.ndarray, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`propose_rows` as arrays: ``(drafts [rows, max count], count per row)``; row ``i``'s
        drafts are ``drafts[i, :count[i]]`` (the rest of the row is not a draft).

        The drafts of every position of a block of requests are drawn at once,
        the first time one of them asks (a step's rows then cost one lookup,
        not a draw each): kept for the last ``oracle`` given.
        """
        counts = np.maximum(np.minimum(ks, oracle.length[rows] - positions), 0)  # fewer near the end
        k = int(counts.max()) if len(counts) else 0
        if k == 0:
            return np.zeros((len(rows), 0), np.int32), counts
        table = self._table(requests, oracle, rows, k)
        # a row without drafts may point one past the last token: any row serves, it is cut to nothing
        return table[np.minimum(oracle.start[rows] + positions, len(table) - 1), :k], counts

    def _table(self, requests: Sequence[Request], oracle: OracleTokens, rows: np.ndarray, k: int) -> np.ndarray:
        """Drafts (``k`` or more columns) at every flat oracle position of the blocks ``rows`` fall in."""
        if self._oracle is not oracle or self._drafts.shape[1] < k:
            self._oracle = oracle
            self._drafts = np.empty((len(oracle.tokens), k), np.int32)  # pages are touched block by block
            self._drawn = np.zeros(-(-len(oracle.length) // _BLOCK), bool)
        blocks = rows // _BLOCK
        if self._drawn[blocks].all():  # the common case: one test, not a sort
            return self._drafts
        blocks = np.unique(blocks)
        for b in blocks[~self._drawn[blocks]].tolist():
            first, last = b * _BLOCK, min((b + 1) * _BLOCK, len(oracle.length))
            lengths = oracle.length[first:last]
            if lengths.any():
                members = np.repeat(np.arange(first, last), lengths)
                begin, end = int(oracle.start[first]), int(oracle.start[last - 1] + oracle.length[last - 1])
                positions = np.arange(begin, end) - oracle.start[members]
                self._drafts[begin:end] = self._draw(requests, oracle, members, positions, self._drafts.shape[1])
            self._drawn[b] = True
        return self._drafts

    def _draw(self, requests: Sequence[Request], oracle: OracleTokens, rows: np.ndarray, positions: np.ndarray,
              k: int) -> np.ndarray:
        """``k`` drafts after ``positions[i]`` of ``requests[rows[i]]``, each i; columns past an
        output's end hold no draft (callers cut them off)."""
        at = (oracle.start[rows] + positions)[:, None] + np.arange(k)
        live = np.arange(k) < (oracle.length[rows] - positions)[:, None]
        target = oracle.tokens[np.where(live, at, 0)]
        if self.alpha < 1.0:
            u = self._uniforms(oracle.request_id[rows], positions, k)
            replace = (u[:, :, 0] >= self.alpha) & live
            if replace.any():
                target = self._replace(requests, oracle, rows, positions, target, replace, u)
        return target

    def _uniforms(self, request_ids: np.ndarray, positions: np.ndarray, k: int) -> np.ndarray:
        """Uniforms [row, offset, replace/kind/pick] for drafts at ``positions`` of ``request_ids``."""
        row = _mix(self._seed_word + request_ids.astype(np.uint64) * _ROW + positions.astype(np.uint64) * _POSITION)
        if len(self._columns) < 3 * k:  # one key offset per (draft offset, uniform)
            self._columns = np.arange(1, 3 * k + 1, dtype=np.uint64) * _GOLDEN
        words = _mix(row[:, None] + self._columns[: 3 * k])
        return ((words >> np.uint64(11)) * _TO_UNIT).reshape(len(row), k, 3)

    def _replace(self, requests: Sequence[Request], oracle: OracleTokens, rows: np.ndarray, positions: np.ndarray,
                 target: np.ndarray, replace: np.ndarray, u: np.ndarray) -> np.ndarray:
        """``target`` with the tokens ``replace`` marks swapped for different ones."""
        at_row, at_offset = np.nonzero(replace)
        token = target[at_row, at_offset]
        kind, pick = u[at_row, at_offset, 1], u[at_row, at_offset, 2]
        # random: a non-special token (the next id when the drawn one is the target)
        plain = self._plain
        i = (pick * len(plain)).astype(np.int64)
        chosen = np.where(plain[i] != token, plain[i], plain[(i + 1) % len(plain)])
        # plausible: a token of the request's own output that differs from the target (else random)
        start, length = oracle.start[rows][at_row], oracle.length[rows][at_row]
        j = (pick * length).astype(np.int64)
        own = oracle.tokens[start + j]
        own = np.where(own != token, own, oracle.tokens[start + (j + 1) % length])
        chosen = np.where((kind < 0.5) & (own != token), own, chosen)
        if self.pools:  # plausible replacements of requests with an instance pool come from the pool
            chosen = chosen.tolist()
            for e, (r, offset) in enumerate(zip(at_row.tolist(), at_offset.tolist())):
                request = requests[int(rows[r])]
                pool = self.pools.get(request.spec_id or "")
                if pool is not None and kind[e] < 0.5:
                    found = self._from_pool(request, pool, int(positions[r]) + offset, int(token[e]), float(pick[e]))
                    if found is not None:
                        chosen[e] = found
        out = target.copy()
        out[at_row, at_offset] = chosen
        return out

    def _from_pool(self, request: Request, pool: InstancePool, pos: int, token: int, pick: float) -> int | None:
        """The token another instance has at ``pos``, else a token seen in the pool; ``None``: none differs."""
        others = [seq[pos] for i, seq in enumerate(pool.tokens)
                  if i != request.instance_index and pos < len(seq) and seq[pos] != token]
        if others:
            return others[int(pick * len(others))]
        seen = self._seen.get(pool.spec_id)
        if seen is None:
            seen = self._seen[pool.spec_id] = sorted(pool.token_set())
        skip = bisect_left(seen, token)
        n = len(seen) - (skip < len(seen) and seen[skip] == token)  # the seen tokens other than the target
        if not n:
            return None
        i = int(pick * n)
        return seen[i + 1] if i >= skip and n < len(seen) else seen[i]
