"""Draft tokens for speculative decoding, with a tunable acceptance rate.

At output position ``p`` a draft of length ``k`` is the oracle tokens
``p .. p+k-1``, each replaced independently with probability ``1 - alpha`` by
a different token. Half of the replacements are plausible (the token another
valid instance of the same spec has at that position, else a token seen in the
instance pool), half are a random non-special token, so verification and
grammar rollback see both grammar-valid and grammar-invalid drafts.

>>> from cdbench.backends.vocab import load_vocab
>>> from cdbench.workloads.request import Request
>>> req = Request(0, 0.0, 8, 3, output_tokens=(10, 11, 12))
>>> DraftSource(alpha=1.0, vocab=load_vocab("cl100k"), seed=0).propose(req, 1, 4)
[11, 12]
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from cdbench.backends.vocab import Vocabulary
from cdbench.workloads.instances import InstancePool
from cdbench.workloads.request import Request


class DraftSource:
    """Proposes draft tokens; deterministic given ``seed``, request id and position.

    ``pools`` maps a request's ``spec_id`` to its instance pool; without it,
    plausible replacements come from the request's own output tokens.
    """

    def __init__(self, alpha: float, vocab: Vocabulary, seed: int, pools: Mapping[str, InstancePool] | None = None) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha = alpha
        self.vocab = vocab
        self.seed = seed
        self.pools = pools or {}
        forbidden = np.fromiter(vocab.forbidden_token_ids, dtype=np.int64)
        self._plain_ids = np.setdiff1d(np.arange(vocab.size, dtype=np.int64), forbidden)
        self._seen: dict[str, np.ndarray] = {}

    def propose(self, request: Request, position: int, k: int) -> list[int]:
        """Up to ``k`` draft tokens following the first ``position`` output tokens.

        Fewer than ``k`` near the end of the output; empty for requests without
        output tokens.
        """
        oracle = request.output_tokens or ()
        target = list(oracle[position : position + k])
        if not target or self.alpha >= 1.0:
            return target
        rng = np.random.default_rng([self.seed, request.request_id, position])
        pool = self.pools.get(request.spec_id or "")
        draft = []
        for offset, token in enumerate(target):
            if rng.random() >= self.alpha:
                token = self._replacement(request, pool, position + offset, token, rng)
            draft.append(token)
        return draft

    def _replacement(self, request: Request, pool: InstancePool | None, pos: int, token: int,
                     rng: np.random.Generator) -> int:
        if rng.random() < 0.5:
            if pool is not None:
                others = [seq[pos] for i, seq in enumerate(pool.tokens)
                          if i != request.instance_index and pos < len(seq) and seq[pos] != token]
                if others:
                    return int(others[int(rng.integers(len(others)))])
            seen = self._seen_tokens(request, pool)
            seen = seen[seen != token]
            if seen.size:
                return int(seen[int(rng.integers(seen.size))])
        while True:
            candidate = int(self._plain_ids[int(rng.integers(self._plain_ids.size))])
            if candidate != token:
                return candidate

    def _seen_tokens(self, request: Request, pool: InstancePool | None) -> np.ndarray:
        key = request.spec_id if pool is not None else f"#request{request.request_id}"
        if key not in self._seen:
            tokens = pool.token_set() if pool is not None else set(request.output_tokens or ())
            self._seen[key] = np.array(sorted(tokens), dtype=np.int64)
        return self._seen[key]
