"""``mask_apply="per_row"``: vLLM V0's per-sequence logits processors, a copy and an apply kernel a row,
blocking the host per row when the copy is not pinned."""

from __future__ import annotations

import pytest
from scheduler_helpers import req, sim

from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.model import FixedGrammarCosts
from cdbench.harness.policies import policy

FORWARD_S, FILL_S, COPY_S, APPLY_S = 0.010, 0.001, 3e-5, 1e-5
GPU = FixedGpuCosts(forward_base_s=FORWARD_S, copy_row_s=COPY_S, apply_row_s=APPLY_S)
GRAMMAR = FixedGrammarCosts(compile_time_s=0.0, fill_time_s=FILL_S, accept_time_s=0.0, rollback_time_s=0.0)


def _decode_step(rows: int, **overrides) -> float:
    """The duration of a decode step of ``rows`` structured rows."""
    result = sim([req(i, 0.0, out=3) for i in range(rows)], "vllm", gpu=GPU, grammar=GRAMMAR, overlap=False,
                 fill_parallel_threshold=None, **overrides)
    steps = result.steps
    decode = steps[(steps["kind"] == "decode") & (steps["grammar_rows"] == rows)]
    assert len(decode)
    return float(decode["duration_s"].iloc[0])


def test_a_batched_apply_hides_the_fills_and_the_copy_under_the_forward():
    assert _decode_step(4) == pytest.approx(FORWARD_S + 4 * APPLY_S, abs=1e-9)


def test_non_blocking_per_row_copies_and_applies_run_after_the_forward():
    # every fill beside the forward; the GPU then runs each row's copy and apply in turn
    assert _decode_step(4, mask_apply="per_row", pinned_mask=True) == pytest.approx(
        FORWARD_S + 4 * (COPY_S + APPLY_S), abs=1e-9)


def test_a_blocking_per_row_copy_leaves_the_later_fills_and_every_copy_after_the_forward():
    # the first fill beside the forward; then copy, fill, copy, ... with the GPU idle; the last row's apply
    blocking = _decode_step(4, mask_apply="per_row", pinned_mask=False)
    assert blocking == pytest.approx(FORWARD_S + 3 * FILL_S + 4 * COPY_S + APPLY_S, abs=1e-9)
    # it grows by a fill and a copy a row
    assert _decode_step(8, mask_apply="per_row", pinned_mask=False) - blocking == pytest.approx(
        4 * (FILL_S + COPY_S), abs=1e-9)


def test_a_blocking_per_row_copy_pays_each_later_rows_wrapper_after_the_forward():
    # V0's per-row Python (fill_row_s) runs with its row: the first row's beside the forward, the others after
    wrapper = 2e-4
    base = _decode_step(4, mask_apply="per_row", pinned_mask=False)
    assert _decode_step(4, mask_apply="per_row", pinned_mask=False, fill_row_s=wrapper) - base == pytest.approx(
        3 * wrapper, abs=1e-9)
    # a non-blocking copy leaves the host free to run every row's wrapper beside the forward
    assert _decode_step(4, mask_apply="per_row", pinned_mask=True, fill_row_s=wrapper) == pytest.approx(
        _decode_step(4, mask_apply="per_row", pinned_mask=True), abs=1e-9)


PREP = {"sample_prep_s": 2e-4, "sample_prep_row_s": 1e-5}  # V0's sampler's host work up to its GPU sync


def test_a_blocking_per_row_copy_leaves_the_samplers_host_work_after_the_forward():
    # the host waited out the forward at the first row's copy: the sampler's preparation then runs with the GPU idle
    blocking = _decode_step(4, mask_apply="per_row", pinned_mask=False)
    assert _decode_step(4, mask_apply="per_row", pinned_mask=False, **PREP) - blocking == pytest.approx(
        2e-4 + 4 * 1e-5, abs=1e-9)


def test_a_non_blocking_per_row_copy_leaves_the_samplers_host_work_beside_the_forward():
    assert _decode_step(4, mask_apply="per_row", pinned_mask=True, **PREP) == pytest.approx(
        _decode_step(4, mask_apply="per_row", pinned_mask=True), abs=1e-9)
    # until it outlasts the forward: the fills and it, then the rows' copies and applies on the GPU
    long = {"sample_prep_s": 0.012, "sample_prep_row_s": 0.0}
    assert _decode_step(4, mask_apply="per_row", pinned_mask=True, **long) == pytest.approx(
        4 * FILL_S + 0.012 + 4 * (COPY_S + APPLY_S), abs=1e-9)


def test_the_samplers_host_work_runs_beside_the_forward_without_masks():
    # V0's loop without grammar rows: the host prepares the sampler while the forward runs
    result = sim([req(i, 0.0, out=3, spec=None) for i in range(4)], "vllm", gpu=GPU, grammar=GRAMMAR, overlap=False,
                 mask_apply="per_row", pinned_mask=False, **PREP)
    decode = result.steps[result.steps["kind"] == "decode"]
    assert len(decode) and decode["duration_s"].to_numpy() == pytest.approx(FORWARD_S, abs=1e-9)


def test_the_samplers_host_work_is_v0s_loop_without_overlap():
    with pytest.raises(ValueError, match="sample_prep_s"):
        policy("vllm", overlap=True, **PREP)
    assert policy("vllm-0.6").sample_prep_s > 0 and policy("vllm").sample_prep_s == 0.0


@pytest.mark.parametrize("overrides", [{"overlap": True}, {"overlap": False, "fill_beside_forward": False}])
def test_per_row_is_v0s_loop_without_overlap_after_the_forwards_launch(overrides):
    with pytest.raises(ValueError, match="mask_apply 'per_row'"):
        policy("vllm", mask_apply="per_row", **overrides)


def test_live_mode_refuses_the_per_row_apply():
    from cdbench.harness.config import RunConfig

    tree = {"mode": "live", "policy": {"name": "vllm"},
            "scheduler": {"mask_apply": "per_row", "overlap": False, "fill_beside_forward": True}}
    with pytest.raises(ValueError, match="live mode runs the batched copy and apply"):
        RunConfig.model_validate(tree)
    assert RunConfig.model_validate({**tree, "mode": "model"}).scheduler_config().mask_apply == "per_row"
    # a live step runs its own sampler: V0's priced one is refused there
    for priced in (PREP, LAUNCH, {"mask_apply": "per_row", "row_launch_s": 1e-5}):
        prep = {"mode": "hybrid", "costs": {"live_gpu": True}, "policy": {"name": "vllm"},
                "scheduler": {"overlap": False, **priced}}
        with pytest.raises(ValueError, match="runs its own"):
            RunConfig.model_validate(prep)


LAUNCH = {"sample_launch_s": 1e-4, "sample_launch_row_s": 5e-6}  # the sampler's launches on a GPU (gpu_launch_costs)


def test_the_samplers_launches_are_paid_with_its_host_work():
    # after the forward behind a blocking copy, beside it (hidden here) behind a non-blocking one
    blocking = _decode_step(4, mask_apply="per_row", pinned_mask=False)
    assert _decode_step(4, mask_apply="per_row", pinned_mask=False, **LAUNCH) - blocking == pytest.approx(
        1e-4 + 4 * 5e-6, abs=1e-9)
    assert _decode_step(4, mask_apply="per_row", pinned_mask=True, **LAUNCH) == pytest.approx(
        _decode_step(4, mask_apply="per_row", pinned_mask=True), abs=1e-9)
    with pytest.raises(ValueError, match="sample_launch_s"):
        policy("vllm", overlap=True, **LAUNCH)


def test_each_rows_launches_follow_its_copy():
    # a blocking copy: every row's apply and write-back launches after the forward, the first row's too
    row = 4e-5
    blocking = _decode_step(4, mask_apply="per_row", pinned_mask=False)
    assert _decode_step(4, mask_apply="per_row", pinned_mask=False, row_launch_s=row) - blocking == pytest.approx(
        4 * row, abs=1e-9)
    # a non-blocking one: beside the forward, until the host path outlasts it
    assert _decode_step(4, mask_apply="per_row", pinned_mask=True, row_launch_s=row) == pytest.approx(
        _decode_step(4, mask_apply="per_row", pinned_mask=True), abs=1e-9)
    assert _decode_step(4, mask_apply="per_row", pinned_mask=True, row_launch_s=0.003) == pytest.approx(
        4 * FILL_S + 4 * 0.003 + 4 * (COPY_S + APPLY_S), abs=1e-9)
    with pytest.raises(ValueError, match="row_launch_s"):
        policy("vllm", row_launch_s=row)
