"""Shared builders for the scheduler tests: constant costs, so expected times are hand-computable."""

from __future__ import annotations

from cdbench.backends.base import ConstraintSpec
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.model import FixedGrammarCosts, ModelExecutor
from cdbench.harness.policies import HOST_COST_FIELDS, policy
from cdbench.harness.run import RunResult, simulate
from cdbench.workloads.request import Request

SPEC = ConstraintSpec("regex", "[a-z]+")
FORWARD_S = 0.010


def req(i: int, arrival: float, out: int = 5, prompt: int = 100, spec: str | None = "s1", **kw) -> Request:
    return Request(i, arrival, prompt, out, SPEC if spec else None, spec, **kw)


def sim(requests, name: str, *, gpu: FixedGpuCosts | None = None, grammar: FixedGrammarCosts | None = None,
        alpha: float = 0.0, seed: int = 0, **overrides) -> RunResult:
    gpu = gpu or FixedGpuCosts(forward_base_s=FORWARD_S)
    grammar = grammar or FixedGrammarCosts(compile_time_s=0.012, fill_time_s=0.0, accept_time_s=0.0,
                                           rollback_time_s=0.0)
    overrides.setdefault("cache_hit_s", 0.0)
    for field in HOST_COST_FIELDS:  # the engines' measured host costs would blur the hand-computed times
        overrides.setdefault(field, 0.0)
    overrides.setdefault("cuda_graph_sizes", ())  # as would decode steps padded to graph sizes (tested apart)
    executor = ModelExecutor(grammar, alpha=alpha)
    return simulate(requests, policy(name, **overrides), executor, gpu, seed=seed, trace_steps=0)


def row(result: RunResult, request_id: int) -> dict:
    frame = result.requests
    return frame[frame["request_id"] == request_id].iloc[0].to_dict()
