"""``fill_beside_forward``: without overlap, the mask path runs beside the forward or before it."""

from __future__ import annotations

import pytest

from cdbench.harness.config import RunConfig
from cdbench.harness.policies import HOST_COST_FIELDS
from cdbench.harness.run import run

FORWARD_S, FILL_S = 0.010, 0.002


def _tpot_ms(beside: bool, overlap: bool = False, ratio: float = 1.0) -> float:
    cfg = RunConfig.model_validate({
        "mode": "model", "policy": {"name": "vllm"},
        "scheduler": {"overlap": overlap, "fill_beside_forward": beside, "cuda_graph_sizes": [],
                      **dict.fromkeys(HOST_COST_FIELDS, 0.0)},
        "costs": {"fixed_gpu": {"forward_base_s": FORWARD_S},
                  "fixed_grammar": {"compile_time_s": 0.001, "fill_time_s": FILL_S}},
        "workload": {"num_requests": 4, "token_source": "lengths", "structured_ratio": ratio,
                     "arrival": {"process": "closed_loop", "max_concurrency": 1},
                     "prompt_len": {"dist": "fixed", "value": 32}, "output_len": {"dist": "fixed", "value": 50}},
    })
    return run(cfg).summary.mean_tpot_ms


def test_a_serial_mask_path_adds_the_fill_to_every_structured_step():
    beside, before = _tpot_ms(beside=True), _tpot_ms(beside=False)
    assert beside == pytest.approx(FORWARD_S * 1e3, abs=0.01)  # the fill hides under the forward
    assert before - beside == pytest.approx(FILL_S * 1e3, abs=1e-6)


def test_the_toggle_changes_nothing_with_overlap_or_without_grammar():
    assert _tpot_ms(beside=False, overlap=True) == _tpot_ms(beside=True, overlap=True)
    assert _tpot_ms(beside=False, ratio=0.0) == _tpot_ms(beside=True, ratio=0.0)
