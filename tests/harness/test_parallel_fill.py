"""vLLM's parallel mask fill: hybrid (and live) mode run it on a real thread pool and time its wall;
model mode prices the pool's makespan, scaled by the factor a run measured."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from cdbench.backends import create_backend
from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import load_vocab
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.costs.grammar_profile import GrammarProfile, ParallelFillProfile
from cdbench.harness.executors.hybrid import HybridExecutor
from cdbench.harness.executors.model import FixedGrammarCosts, ProfileGrammarCosts
from cdbench.harness.policies import policy
from cdbench.harness.run import simulate
from cdbench.harness.step_time import parallel_makespan
from cdbench.workloads.request import Request
from scheduler_helpers import req, sim

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
FILL_SLEEP_S = 0.004  # each traced fill also sleeps this long (off the CPU), so two threads halve a step
POOL = dict(fill_parallel_threshold=2, fill_chunk=2, fill_threads=2, fill_step_s=0.0, fill_row_s=0.0,
            mask_alloc_byte_s=0.0)


class _TracedMatcher:
    """A real matcher whose fills note their thread and mask row, and sleep a little."""

    def __init__(self, matcher, seen: list) -> None:
        self._matcher, self._seen = matcher, seen

    def fill_mask(self, mask, row: int) -> None:
        self._seen.append((threading.current_thread().name, row))
        self._matcher.fill_mask(mask, row)
        time.sleep(FILL_SLEEP_S)

    def __getattr__(self, name: str):
        return getattr(self._matcher, name)


class _TracedBackend:
    """xgrammar, with traced matchers."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.seen: list[tuple[str, int]] = []

    def matcher(self, grammar):
        return _TracedMatcher(self._backend.matcher(grammar), self.seen)

    def __getattr__(self, name: str):
        return getattr(self._backend, name)


@pytest.fixture(scope="module")
def backend():
    return create_backend("xgrammar", load_vocab("cl100k"))


def _requests(vocab, n: int = 8) -> list[Request]:
    eos = vocab.eos_token_ids[0]
    out = []
    for i in range(n):
        tokens = tuple(vocab.encode(json.dumps({"name": f"P{i}", "age": i}))) + (eos,)
        out.append(Request(i, 0.0, 20, len(tokens), ConstraintSpec("json_schema", SCHEMA), "person", tokens))
    return out


def _hybrid(backend, **overrides):
    traced = _TracedBackend(backend)
    result = simulate(_requests(backend.vocab), policy("vllm", overlap=False, **{**POOL, **overrides}),
                      HybridExecutor(traced, seed=1), FixedGpuCosts(forward_base_s=0.01), seed=1, trace_steps=0)
    return result, traced.seen


def test_hybrid_fills_a_step_above_the_threshold_on_the_pool_and_charges_its_wall(backend):
    result, seen = _hybrid(backend)
    assert result.summary.validity_rate == 1.0
    steps = result.steps[result.steps["grammar_rows"] > 0]
    pooled = steps[steps["grammar_rows"] > 2]
    assert len(pooled) > 0
    # every fill of a pooled step ran on a pool thread, each row into its own mask row
    on_pool = [(name, row) for name, row in seen if name.startswith("cdbench-fill")]
    assert sorted(row for _, row in on_pool) == sorted(r for n in pooled["grammar_rows"] for r in range(n))
    assert len({name for name, _ in on_pool}) == 2
    profile = result.grammar_profile
    measured = profile.parallel_fill
    assert (measured.steps, measured.threads, measured.chunk) == (len(pooled), 2, 2)
    # the step's fill is the pool's wall time (no host costs here), not the rows' sum (how much two threads save
    # is a timing, left to benchmarks: the two pool threads above are what makes it parallel)
    assert pooled["fill_s"].sum() == pytest.approx(measured.wall_s)
    # a row's own time is its thread's CPU time: the sleep (off the CPU) is in the pool's wall, not in the row
    assert measured.makespan_s < 0.5 * measured.wall_s


def test_hybrid_fills_serially_at_or_below_the_threshold_and_with_drafts(backend):
    _, seen = _hybrid(backend, fill_parallel_threshold=8)
    assert seen and all(name == threading.main_thread().name and row == 0 for name, row in seen)
    drafted, seen = _hybrid(backend, spec_tokens=2)
    assert all(not name.startswith("cdbench-fill") for name, _ in seen)
    assert drafted.grammar_profile.parallel_fill is None


def test_model_mode_scales_the_pool_makespan_by_the_cost_source_factor():
    reqs = [req(i, 0.0, out=3, prompt=10) for i in range(200)]
    results = {factor: sim(reqs, "vllm", overlap=False, grammar=FixedGrammarCosts(
        compile_time_s=0.0, fill_time_s=10e-6, accept_time_s=0.0, rollback_time_s=0.0,
        parallel_fill_factor=factor)) for factor in (1.0, 2.5)}
    fills = {f: r.steps.loc[r.steps["kind"] == "decode", "fill_s"].to_numpy() for f, r in results.items()}
    makespan = parallel_makespan(np.full(200, 10e-6), 16, 8)
    assert fills[1.0] == pytest.approx([makespan] * 2)
    assert fills[2.5] == pytest.approx([2.5 * makespan] * 2)


def test_a_measured_pool_factor_round_trips_and_model_mode_takes_it(backend, tmp_path):
    result, _ = _hybrid(backend)
    measured = result.grammar_profile.parallel_fill
    path = tmp_path / "grammar_profile.json"
    result.grammar_profile.save(path)
    loaded = GrammarProfile.load(path)
    assert loaded.parallel_fill == measured
    costs = ProfileGrammarCosts(loaded, seed=1)
    assert costs.parallel_fill_factor == pytest.approx(measured.wall_s / measured.makespan_s)
    assert ProfileGrammarCosts(loaded.model_copy(update={"parallel_fill": None}), seed=1).parallel_fill_factor == 1.0
    with pytest.raises(ValueError, match="makespan_s"):
        ParallelFillProfile(steps=1, threads=2, chunk=2, wall_s=1.0, makespan_s=0.0)
