"""``pinned_mask=False`` with the batched apply: a bitmask copied from pageable memory waits for the forward
queued before it (vLLM 0.10 / 0.11's ``apply_grammar_bitmask``), and with overlap the host that waits is the
scheduler loop when the worker shares its process. ``mask_copy_rows="batch"``: that copied array holds every
sampled row of the step once any row is structured, the apply still the structured rows. The model runner
builds that array after the forward's launch (``mask_build_byte_s``, ``mask_scatter_byte_s``: beside the
forward wherever the fill runs), and with overlap the loop that waited on the copy schedules the next step while
the GPU applies and samples (``sample_beside_schedule``). A pageable copy no larger than the driver stages at
once (``pageable_staged_bytes``) leaves its host free: only the GPU copies after the forward."""

from __future__ import annotations

import pytest
from scheduler_helpers import req, sim

from cdbench.harness import scheduler as scheduler_module
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


ROW_BYTES, BUILD_BYTE_S, SCATTER_BYTE_S = 1000, 2e-7, 5e-7  # 0.2 ms a copied row, 0.5 ms a structured row
BUILD = dict(mask_build_byte_s=BUILD_BYTE_S, mask_scatter_byte_s=SCATTER_BYTE_S)
BUILD_GPU = FixedGpuCosts(forward_base_s=FORWARD_S, copy_row_s=COPY_S, apply_row_s=APPLY_S, row_bytes=ROW_BYTES)


def _built_step(structured: int, plain: int, **overrides) -> tuple[float, float]:
    """A steady decode step (``_mixed_decode_step``'s) on a GPU whose bitmask rows are ROW_BYTES wide."""
    requests = [req(i, 0.0, out=4, spec="s1" if i < structured else None) for i in range(structured + plain)]
    steps = sim(requests, "vllm", gpu=BUILD_GPU, grammar=GRAMMAR, **{**HOST, **overrides}).steps
    decode = steps[(steps["kind"] == "decode") & (steps["rows"] == structured + plain)]
    assert len(decode) >= 2
    return float(decode["duration_s"].iloc[1]), float(decode["fill_s"].iloc[1])


def test_the_runners_build_is_priced_per_byte_of_the_copied_array_and_of_the_rows_scattered():
    # 2 structured rows of 8: the array of all 8 rows (batch copy) or of the 2 (mask copy), the 2 rows scattered
    for copy_rows, copied in (("batch", 8), ("mask", 2)):
        base = _built_step(2, 6, overlap=False, pinned_mask=False, mask_copy_rows=copy_rows)
        built = _built_step(2, 6, overlap=False, pinned_mask=False, mask_copy_rows=copy_rows, **BUILD)
        assert built[1] - base[1] == pytest.approx((copied * BUILD_BYTE_S + 2 * SCATTER_BYTE_S) * ROW_BYTES)


@pytest.mark.parametrize("fill_beside", [True, False])
def test_the_runners_build_runs_beside_the_forward_wherever_the_fill_runs(fill_beside):
    # 3.6 ms of build beside a 10 ms forward: hidden whether the fill ran before the launch (vLLM 0.10.1) or beside
    base = _built_step(2, 6, overlap=False, pinned_mask=False, mask_copy_rows="batch", fill_beside_forward=fill_beside)
    built = _built_step(2, 6, overlap=False, pinned_mask=False, mask_copy_rows="batch", fill_beside_forward=fill_beside,
                        **BUILD)
    assert built[0] == pytest.approx(base[0], abs=1e-12)
    # past the forward, what sticks out lengthens the step: with the fill before the launch, the build alone is
    # set against the forward; beside it, the fill and the build together
    long_build = {"mask_build_byte_s": 2e-6, "mask_scatter_byte_s": 0.0}  # 16 ms
    longer = _built_step(2, 6, overlap=False, pinned_mask=False, mask_copy_rows="batch",
                         fill_beside_forward=fill_beside, **long_build)
    behind = 0.016 - FORWARD_S + (2 * FILL_S if fill_beside else 0.0)
    assert longer[0] - base[0] == pytest.approx(behind, abs=1e-9)


def test_with_overlap_the_build_joins_the_loops_chain_beside_the_forward():
    # the previous step's processing, the fills and the build run beside the forward before the waiting copy
    base = _built_step(4, 0, overlap=True, pinned_mask=False, process_row_s=1e-3)
    assert base[0] == pytest.approx(SCHEDULE_S + FORWARD_S + 4 * (COPY_S + APPLY_S), abs=1e-9)
    long_build = {"mask_build_byte_s": 0.0, "mask_scatter_byte_s": 2e-6}  # 8 ms beside 4 ms of processing, 4 of fill
    longer = _built_step(4, 0, overlap=True, pinned_mask=False, process_row_s=1e-3, **long_build)
    assert longer[0] - base[0] == pytest.approx(0.004 + 4 * FILL_S + 0.008 - FORWARD_S, abs=1e-9)


SAMPLE_S = 1e-3  # sampling a row


@pytest.mark.parametrize("schedule_s", [0.002, 0.0005])
def test_with_overlap_the_apply_and_sampling_run_beside_the_next_steps_scheduling(schedule_s):
    # the loop returns from the waiting copy, schedules and launches the next step while the GPU applies the
    # bitmask and samples: they cost the step what they outlast that
    gpu = FixedGpuCosts(forward_base_s=FORWARD_S, copy_row_s=COPY_S, apply_row_s=APPLY_S, sample_row_s=SAMPLE_S)
    requests = [req(i, 0.0, out=4) for i in range(4)]

    def step(**overrides) -> float:
        steps = sim(requests, "vllm", gpu=gpu, grammar=GRAMMAR,
                    **{**HOST, "schedule_s": schedule_s, "overlap": True, "pinned_mask": False, **overrides}).steps
        decode = steps[(steps["kind"] == "decode") & (steps["grammar_rows"] == 4)]
        return float(decode["duration_s"].iloc[1])

    tail = 4 * (APPLY_S + SAMPLE_S)
    waits = step()
    assert waits == pytest.approx(schedule_s + FORWARD_S + 4 * COPY_S + tail, abs=1e-9)
    assert waits - step(sample_beside_schedule=True) == pytest.approx(min(tail, schedule_s), abs=1e-9)
    # the multiprocess executor's worker waits on the copy, not the loop: the switch changes nothing there
    assert step(mask_transfer="ipc") == step(mask_transfer="ipc", sample_beside_schedule=True)


def test_the_vllm_0_10_preset_builds_the_runners_array_and_samples_beside_the_next_schedule():
    cfg = policy("vllm-0.10")
    assert cfg.mask_build_byte_s > 0 and cfg.mask_scatter_byte_s > 0 and cfg.sample_beside_schedule
    assert not any(policy(name).sample_beside_schedule for name in ("vllm", "vllm-0.6", "sglang"))


@pytest.mark.parametrize("alone", [False, True])
@pytest.mark.parametrize("staged_rows, holds", [(4, False), (3, True)])
def test_a_pageable_copy_the_driver_stages_leaves_the_loop_free(staged_rows, holds, alone, monkeypatch):
    # 4 structured rows of ROW_BYTES: staged up to 4 rows' bytes, so the loop schedules on beside the forward (as a
    # pinned copy's, the copy after the forward on the GPU); above it the loop waits the forward out. Steps priced
    # in a decode run and (alone) one by one
    if alone:
        monkeypatch.setattr(scheduler_module, "_MIN_RUN", 1 << 30)
    gpu = FixedGpuCosts(forward_base_s=FORWARD_S, copy_row_s=COPY_S, apply_row_s=APPLY_S, row_bytes=ROW_BYTES)
    requests = [req(i, 0.0, out=4) for i in range(4)]

    def step(**overrides) -> float:
        steps = sim(requests, "vllm", gpu=gpu, grammar=GRAMMAR, **{**HOST, "pinned_mask": False, **overrides}).steps
        decode = steps[(steps["kind"] == "decode") & (steps["grammar_rows"] == 4)]
        return float(decode["duration_s"].iloc[1])

    staged = {"pageable_staged_bytes": staged_rows * ROW_BYTES}
    waits = SCHEDULE_S + FORWARD_S + 4 * (COPY_S + APPLY_S)
    assert step(overlap=True, **staged) == pytest.approx(waits if holds else waits - SCHEDULE_S, abs=1e-9)
    # without overlap the loop waits for the tokens either way: staged or not, the same step
    assert step(overlap=False, **staged) == pytest.approx(step(overlap=False), abs=1e-12)
    assert policy("vllm-0.10").pageable_staged_bytes == 2 * 1024 * 1024
