"""Where output tokens come from at run time when no oracle instance fixes them.

:class:`RandomWalk` draws the next token from the allowed set of a mask row
(the scheduler passes the row its backend filled), with a bias towards EOS and
a token cap. It knows mask layouts, not engines. A request generated with the
``random_walk`` token source carries its own :class:`WalkParams` (seed, EOS
bias, cap from the workload config); passed as ``params`` they replace the
walk's defaults for that request.

>>> import torch
>>> row = torch.zeros(2, dtype=torch.int32); row[0] = 0b1010  # tokens 1 and 3 allowed
>>> walk = RandomWalk(eos_token_ids=(3,), vocab_size=64, seed=0, eos_bias=0.0)
>>> walk.next_token(row, request_id=0, position=0)
1
>>> walk.next_token(row, request_id=0, position=0, params=WalkParams(seed=0, eos_bias=1.0))
3
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from cdbench.workloads.request import WalkParams

_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(mask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Ids allowed by one mask row: an int32 bitmask (bit i of word w is 32*w+i) or a bool row."""
    if mask_row.dtype == torch.bool:
        return torch.nonzero(mask_row[:vocab_size]).flatten()
    bits = (mask_row.to(torch.int32).unsqueeze(-1) >> _BITS) & 1
    return torch.nonzero(bits.flatten()[:vocab_size]).flatten()


class RandomWalk:
    """Seeded draws from a mask row; deterministic given seed, request id and position.

    Parameters
    ----------
    eos_bias : probability of ending (taking an allowed EOS) at each step.
    max_tokens : at this position (0-based) and later, EOS is taken when allowed.
    """

    def __init__(self, eos_token_ids: Sequence[int], vocab_size: int, seed: int, *,
                 eos_bias: float = 0.05, max_tokens: int | None = None) -> None:
        self.eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long)
        self.vocab_size = vocab_size
        self.seed = seed
        self.eos_bias = eos_bias
        self.max_tokens = max_tokens

    def next_token(self, mask_row: torch.Tensor, *, request_id: int, position: int,
                   params: WalkParams | None = None) -> int:
        """The token at ``position`` of request ``request_id``; ``ValueError`` if the row allows nothing.

        ``params`` (the request's own walk settings) replace this walk's seed, EOS bias and cap.
        """
        allowed = allowed_tokens(mask_row, self.vocab_size)
        if allowed.numel() == 0:
            raise ValueError(f"mask row of request {request_id} at position {position} allows no token")
        seed, eos_bias, max_tokens = ((self.seed, self.eos_bias, self.max_tokens) if params is None
                                      else (params.seed, params.eos_bias, params.max_tokens))
        rng = np.random.default_rng([seed, request_id, position])
        is_eos = torch.isin(allowed, self.eos)
        eos_allowed = allowed[is_eos]
        others = allowed[~is_eos]
        at_cap = max_tokens is not None and position >= max_tokens
        if eos_allowed.numel() and (others.numel() == 0 or at_cap or rng.random() < eos_bias):
            return int(eos_allowed[0])
        return int(others[int(rng.integers(others.numel()))])
