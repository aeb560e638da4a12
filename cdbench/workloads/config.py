"""The typed, seeded description of a workload.

>>> cfg = WorkloadConfig(num_requests=10, arrival={"process": "gamma", "rate": 5, "burstiness": 0.5})
>>> cfg.arrival.burstiness, cfg.max_concurrency
(0.5, None)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cdbench.backends.base import ConstraintKind
from cdbench.workloads.arrivals import ArrivalProcess, PoissonArrivals
from cdbench.workloads.lengths import FixedLengths, LengthDist


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpecReuse(_Config):
    """How often specs repeat across requests.

    - ``unique``: every structured request gets a distinct spec (a cold compile
      cache, like vLLM's ``json-unique``). Corpus items are used once each in a
      seeded order; past the end they are reused as *copies* made distinct: a
      JSON Schema gets ``"$comment": "cdbench copy <n>"`` (ignored by
      validators), any other kind gets ``options["unique_copy"] = n``. Either way
      the spec's canonical text, hence its compile-cache key, differs.
    - ``same``: one spec for all.
    - ``zipf``: item of popularity rank r (seeded order) is drawn with
      probability proportional to ``1 / r ** zipf_s``.
    """

    mode: Literal["unique", "same", "zipf"] = "unique"
    zipf_s: float = Field(default=1.1, gt=0)


class ReasoningConfig(_Config):
    """Which requests think, for how long, and under what budget."""

    fraction: float = Field(default=0.0, ge=0, le=1)
    think_len: LengthDist = FixedLengths(value=512)
    thinking_budget: int | None = Field(default=None, ge=0)


class SpecDecodeConfig(_Config):
    """Speculative decoding: ``k`` draft tokens per step, each accepted with probability ``alpha``.

    ``drafter``: who proposes the drafts. ``external`` (n-gram or prompt lookup, an oracle's
    answer): the drafts cost the forward nothing beyond verifying them. ``mtp``: the model's
    multi-token-prediction head drafts them after each step's verification, ``k`` sequential
    passes over the drafting rows, priced per step by the forward model
    (:meth:`~cdbench.harness.costs.forward.ForwardCostModel.mtp_draft_s`); the grammar checks
    and rolls back the drafts as for any drafter.
    """

    k: int = Field(default=0, ge=0)
    alpha: float = Field(default=1.0, ge=0, le=1)
    drafter: Literal["external", "mtp"] = "external"


class RandomWalkConfig(_Config):
    """The ``random_walk`` token source: each structured request's tokens are drawn
    from its mask rows at run time (:class:`~cdbench.workloads.token_sources.RandomWalk`).

    ``eos_bias``: probability of ending at each position where EOS is allowed.
    ``max_tokens``: from this position on, EOS is taken whenever allowed (a soft
    cap; the request's ``output_len`` is the hard cap). The walk's seed is drawn
    from the workload seed.
    """

    eos_bias: float = Field(default=0.05, ge=0, le=1)
    max_tokens: int | None = Field(default=None, ge=0)


class WorkloadConfig(_Config):
    """Everything that decides a workload; same config + seed → identical requests.

    ``token_source``: ``oracle`` (a validated instance of the spec is the
    output, so ``output_len = len(output_tokens)``, EOS included),
    ``random_walk`` (tokens are drawn from the mask at run time with the
    ``random_walk`` settings, carried on each structured request; ``output_len``
    from ``output_len`` is the hard token cap) or ``lengths`` (only lengths).
    Plain requests always take ``output_len`` from the distribution.

    ``trace``: replay this trace file (``docs/trace_format.md``) instead of
    generating: the requests, their specs and oracle tokens and the workload
    config are the trace's, so the other fields here do not apply, except
    ``spec_decode``, which is always this config's (one trace replays under
    several draft settings). ``num_requests`` is then optional.

    ``kind_weights``: the share of structured requests per constraint kind
    (normalized; e.g. ``{json_schema: 0.85, regex: 0.06, choice: 0.06, ebnf: 0.03}``
    for structured-output traffic). Each kind gets exactly its share of the
    structured requests (rounded), in a seeded random order; a request of a
    kind then draws a spec of that kind as ``spec_reuse`` says (``unique`` runs
    through each kind's items separately, ``same`` holds one spec per kind).
    Kinds the filtered corpus has no item of are left out and the others'
    shares renormalized; kinds without a weight are not drawn. Without it,
    specs are drawn from the whole corpus alike, so the kind mix is the corpus's.

    ``instances_per_spec``/``instance_seed``: each spec's pool of oracle
    instances, part of the dataset rather than of the draw: the pool is
    generated from ``instance_seed``, not the workload ``seed``, so runs at
    every seed answer a spec with the same texts, and a profile that walked
    them (``GrammarProfile.instances``) knows what each one costs. A spec's
    requests take its pool's instances in turn, from a seeded start, so a
    spec used ``instances_per_spec`` times walks each once. Change
    ``instance_seed`` to draw other instances.
    """

    num_requests: int | None = Field(default=None, gt=0)
    trace: Path | None = None
    seed: int = 0
    corpus: list[str] = Field(default_factory=lambda: ["embedded"], min_length=1)
    kinds: list[Literal["json_schema", "regex", "choice", "ebnf", "structural_tag"]] | None = None
    kind_weights: dict[ConstraintKind, float] | None = None
    id_prefix: str | None = None
    corpus_sample: int | None = Field(default=None, gt=0)
    corpus_limit: int | None = Field(default=None, gt=0)
    structured_ratio: float = Field(default=1.0, ge=0, le=1)
    spec_reuse: SpecReuse = SpecReuse()
    arrival: ArrivalProcess = PoissonArrivals(rate=10.0)
    prompt_len: LengthDist = FixedLengths(value=256)
    output_len: LengthDist = FixedLengths(value=128)
    token_source: Literal["oracle", "random_walk", "lengths"] = "oracle"
    instances_per_spec: int = Field(default=4, gt=0)
    instance_seed: int = 0
    reasoning: ReasoningConfig = ReasoningConfig()
    spec_decode: SpecDecodeConfig = SpecDecodeConfig()
    random_walk: RandomWalkConfig = RandomWalkConfig()

    @model_validator(mode="after")
    def _sized(self) -> WorkloadConfig:
        if self.num_requests is None and self.trace is None:
            raise ValueError("num_requests is required (unless trace names a trace to replay)")
        if self.kind_weights is not None:
            bad = [k for k, w in self.kind_weights.items() if not (w >= 0 and math.isfinite(w))]
            if bad:
                raise ValueError(f"kind_weights.{bad[0]} must be a finite number >= 0, got {self.kind_weights[bad[0]]}")
            if not sum(self.kind_weights.values()) > 0:
                raise ValueError("kind_weights needs at least one weight above 0")
        return self

    @property
    def max_concurrency(self) -> int | None:
        """Concurrent clients of a closed loop; ``None`` for open-loop arrivals."""
        return getattr(self.arrival, "max_concurrency", None)
