"""``pinned_mask=False`` with the batched apply: a bitmask copied from pageable memory waits for the forward
queued before it (vLLM 0.10 / 0.11's ``apply_grammar_bitmask``), and with overlap the host that waits is the
scheduler loop when the worker shares its process. ``mask_copy_rows="batch"``: that copied array holds every
sampled row of the step once any row is structured, the apply still the structured rows."""

from __future__ import annotations

import pytest
from scheduler_helpers import req, sim

from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.model import FixedGrammarCosts
from cdbench.harness.policies import policy

FORWARD_S, FILL_S, COPY_S, APPLY_S, SCHEDULE_S = 0.010, 0.001, 3e-5, 1e-5, 0.002
GPU = FixedGpuCosts(forward_base_s=FORWARD_S, copy_row_s=COPY_S, apply_row_s=APPLY_S)
GRAMMAR = FixedGrammarCosts(compile_time_s=0.0, fill_time_s=FILL_S, accept_time_s=0.0, rollback_time_s=0.0)
# only the batch's forming costs host time, so the step's parts can be read off
HOST = dict(schedule_s=SCHEDULE_S, schedule_row_s=0.0, process_step_s=0.0, process_row_s=0.0, accept_row_s=0.0,
            fill_step_s=0.0, fill_row_s=0.0, launch_s=0.0, launch_prefill_s=0.0, ipc_s=0.0, ipc_byte_s=0.0,
            fill_parallel_threshold=None, cuda_graph_sizes=())


def _decode_step(rows: int, **overrides) -> float:
    """The duration of a steady decode step of ``rows`` structured rows."""
    result = sim([req(i, 0.0, out=4) for i in range(rows)], "vllm", gpu=GPU, grammar=GRAMMAR,
                 **{**HOST, **overrides})
    steps = result.steps
    decode = steps[(steps["kind"] == "decode") & (steps["grammar_rows"] == rows)]
    assert len(decode) >= 2
    return float(decode["duration_s"].iloc[1])


def test_with_overlap_a_pinned_copy_leaves_the_schedule_beside_the_forward():
    assert _decode_step(4, overlap=True) == pytest.approx(FORWARD_S + 4 * APPLY_S, abs=1e-9)


def test_with_overlap_a_pageable_copy_makes_the_loop_wait_out_the_forward():
    # the schedule no longer runs ahead: it, the forward (the fills beside it), the copy and the apply in turn
    assert _decode_step(4, overlap=True, pinned_mask=False) == pytest.approx(
        SCHEDULE_S + FORWARD_S + 4 * (COPY_S + APPLY_S), abs=1e-9)


def test_with_overlap_a_pageable_copy_in_the_workers_process_holds_only_the_gpu():
    # the multiprocess executor's worker waits for the forward; the loop schedules on beside it
    assert _decode_step(4, overlap=True, pinned_mask=False, mask_transfer="ipc") == pytest.approx(
        FORWARD_S + 4 * (COPY_S + APPLY_S), abs=1e-9)


def test_without_overlap_a_pageable_copy_runs_after_the_forward():
    pinned = _decode_step(4, overlap=False)
    assert pinned == pytest.approx(SCHEDULE_S + FORWARD_S + 4 * APPLY_S, abs=1e-9)
    assert _decode_step(4, overlap=False, pinned_mask=False) - pinned == pytest.approx(4 * COPY_S, abs=1e-9)


def test_without_overlap_the_samplers_host_work_waits_behind_a_pageable_copy():
    # the sampler's host work (sample_prep_s) follows the copy: after the forward when the copy waited for it,
    # beside it when the copy was pinned (steps priced alone and as decode runs alike)
    prep = {"sample_prep_s": 2e-4, "sample_prep_row_s": 1e-5}
    for pinned, extra in ((False, 2e-4 + 4 * 1e-5), (True, 0.0)):
        base = _decode_step(4, overlap=False, pinned_mask=pinned)
        assert _decode_step(4, overlap=False, pinned_mask=pinned, **prep) - base == pytest.approx(extra, abs=1e-9)


def _mixed_decode_step(structured: int, plain: int, **overrides) -> tuple[float, float]:
    """A steady decode step of ``structured`` structured and ``plain`` unconstrained rows: its duration and its
    copy's seconds."""
    requests = [req(i, 0.0, out=4, spec="s1" if i < structured else None) for i in range(structured + plain)]
    steps = sim(requests, "vllm", gpu=GPU, grammar=GRAMMAR, **{**HOST, **overrides}).steps
    decode = steps[(steps["kind"] == "decode") & (steps["rows"] == structured + plain)]
    assert len(decode) >= 2
    step = decode.iloc[1]
    assert step["grammar_rows"] == structured
    return float(step["duration_s"]), float(step["copy_s"])


@pytest.mark.parametrize("pinned", [True, False])
def test_a_batch_copy_carries_every_sampled_row_once_one_is_structured(pinned):
    mask = _mixed_decode_step(2, 6, overlap=False, pinned_mask=pinned)
    batch = _mixed_decode_step(2, 6, overlap=False, pinned_mask=pinned, mask_copy_rows="batch")
    assert mask[1] == pytest.approx(2 * COPY_S, abs=1e-12)
    assert batch[1] == pytest.approx(8 * COPY_S, abs=1e-12)
    # from pageable memory the copy waits for the forward, so its six more rows lengthen the step; a pinned one
    # hides under the forward
    assert batch[0] - mask[0] == pytest.approx(0.0 if pinned else 6 * COPY_S, abs=1e-9)


def test_a_batch_copy_of_an_all_structured_or_unstructured_batch_is_the_mask_copy():
    for structured, plain in ((4, 0), (0, 4)):
        assert _mixed_decode_step(structured, plain, overlap=False, pinned_mask=False, mask_copy_rows="batch") \
            == _mixed_decode_step(structured, plain, overlap=False, pinned_mask=False)


def test_the_vllm_presets_copy_as_their_versions_do():
    # 0.10.1's apply_grammar_bitmask copies an array of every logits row; the presets of other versions the mask
    assert policy("vllm-0.10").mask_copy_rows == "batch"
    assert {policy(name).mask_copy_rows for name in ("vllm", "vllm-0.6", "sglang")} == {"mask"}
    with pytest.raises(ValueError, match="per_row"):
        policy("vllm-0.6", mask_copy_rows="batch")
