"""scheduler.accept_parallel: a step that fills on the parallel pool also accepts its sampled tokens there
(llguidance's LLExecutor.consume_token_par), priced in model mode as the pool's makespan of the accepts."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_helpers import req, sim

from cdbench.harness.config import RunConfig
from cdbench.harness.executors.model import FixedGrammarCosts
from cdbench.harness.policies import policy
from cdbench.harness.step_time import parallel_makespan

ACCEPT_S = 20e-6
GRAMMAR = FixedGrammarCosts(compile_time_s=0.0, fill_time_s=10e-6, accept_time_s=ACCEPT_S, rollback_time_s=0.0)


def _decode_process(n: int, **overrides) -> np.ndarray:
    result = sim([req(i, 0.0, out=3, prompt=10) for i in range(n)], "vllm", overlap=False, grammar=GRAMMAR,
                 **overrides)
    steps = result.steps
    return steps.loc[steps["kind"] == "decode", "process_s"].to_numpy()


def test_a_pooled_step_pays_the_pool_makespan_of_its_accepts_not_their_sum():
    serial = _decode_process(200)
    parallel = _decode_process(200, accept_parallel=True)
    assert serial == pytest.approx([200 * ACCEPT_S] * len(serial))
    makespan = parallel_makespan(np.full(200, ACCEPT_S), 16, 8)  # the vllm preset's chunk and threads
    assert makespan < 200 * ACCEPT_S / 6  # 13 tasks of 16 rows on 8 threads: two rounds
    assert parallel == pytest.approx([makespan] * len(parallel))


def test_at_or_below_the_fill_threshold_the_accepts_stay_serial():
    assert _decode_process(100, accept_parallel=True) == pytest.approx(_decode_process(100))


def test_accept_parallel_needs_a_fill_pool_and_model_mode():
    with pytest.raises(ValueError, match="fill_parallel_threshold"):
        policy("sglang", accept_parallel=True)
    tree = {"workload": {"num_requests": 4}, "policy": {"name": "vllm"}, "scheduler": {"accept_parallel": True}}
    assert RunConfig.model_validate({**tree, "mode": "model"}).scheduler_config().accept_parallel
    with pytest.raises(ValueError, match="accept_parallel is priced in model mode"):
        RunConfig.model_validate({**tree, "mode": "hybrid"})
