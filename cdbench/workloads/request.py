"""The unit of work that arrives at the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from cdbench.backends.base import ConstraintSpec


@dataclass(frozen=True, slots=True)
class WalkParams:
    """How a random walk draws a request's tokens from its mask rows at run time.

    Attributes
    ----------
    seed : the walk's seed; the token at a position is fixed by (seed, request id, position).
    eos_bias : probability of ending (taking an allowed EOS) at each position.
    max_tokens : from this position (0-based) on, EOS is taken whenever the
        grammar allows it (a soft cap; ``output_len`` stays the hard cap).
    """

    seed: int
    eos_bias: float = 0.05
    max_tokens: int | None = None


@dataclass(slots=True)
class Request:
    """One generation request, as the workload generator expands it.

    Attributes
    ----------
    request_id : position in the workload, 0-based.
    arrival_s : arrival time in seconds of virtual time.
    prompt_len : prompt tokens to prefill.
    output_len : answer tokens to decode (after thinking), EOS included.
    spec : the constraint, or ``None`` for a plain (unconstrained) request.
    spec_id : corpus item id of ``spec``; equal ids mean the same spec (cache reuse).
    output_tokens : the answer's token ids when a token source produced them
        (the oracle instance, EOS last); ``None`` when only lengths are modelled.
    think_len : thinking tokens before the answer (0: no reasoning).
    thinking_budget : cap on thinking tokens; at the cap only think-end is allowed.
    closed_loop : the scheduler decides the arrival (closed-loop clients);
        ``arrival_s`` is then 0.
    instance_index : which instance of the spec's pool ``output_tokens`` is.
    random_walk : for the ``random_walk`` token source, how the executor draws
        this request's tokens from the mask; ``None`` otherwise.
    """

    request_id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    spec: ConstraintSpec | None = None
    spec_id: str | None = None
    output_tokens: tuple[int, ...] | None = None
    think_len: int = 0
    thinking_budget: int | None = None
    closed_loop: bool = False
    instance_index: int | None = None
    random_walk: WalkParams | None = None

    @property
    def structured(self) -> bool:
        return self.spec is not None
