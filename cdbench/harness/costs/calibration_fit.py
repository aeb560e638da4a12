"""Fit the forward model's parameters to measured step times (CPU only: numpy and scipy).

The objective is the relative error of each shape, ``predicted / measured - 1``,
minimised in the least-squares sense (scipy's bounded trust-region solver) from
a few starting points, the best kept; then refined on the sum of the errors'
eighth powers, which trades a little of the median for a lower worst shape
(the acceptance bar is on every shape), and the refinement is kept only when
it brings the worst error lower and within :data:`MAX_ERROR_BAR`. A refinement
that still misses the bar buys nothing and costs the shapes a run meets most:
the MoE's refined fit (worst 10.6 % against 13.0 %) priced its own 1-2-row decode
shapes 3-5 % short and live runs' decode steps 2.9-4.6 % off on average, the
least-squares fit 1.1-2.3 % (``reports/calibration/README.md``). Every measured shape is reported with its fitted
error (:attr:`ForwardCalibration.fit`); :func:`holdout_errors` fits on part of
the shapes and prices the rest (the fit's out-of-sample error).

Draft shapes (the MTP head's passes, ``mtp_drafts`` > 0) take no part in the
step fit: once it is made, :func:`fit_draft` fits the head's own term to them
alone (a per-pass cost and a scale on the passes' roofline price at the step
fit's efficiencies, linear least squares on the relative errors, both >= 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import least_squares, lsq_linear

from cdbench.harness.costs.calibration import (
    CalibrationError,
    ForwardCalibration,
    ForwardMeasurement,
    MtpDraftFit,
    ShapeFit,
)
from cdbench.harness.costs.forward import ForwardCostModel, ForwardParams, PeakTimes
from cdbench.harness.costs.hardware import GPUSpec, ModelSpec

_REFINE_POWER = 8
#: the calibration's acceptance bar on every measured shape's relative error (issue 29)
MAX_ERROR_BAR = 0.10
# Parameter vector: four efficiencies, the sharpness, then the fixed and per-token costs in
# microseconds and nanoseconds so every entry is of order one for the solver.
# Then the decode-attention occupancy (rows, sharpness) and the several-token steps' slower weight read
# in per cent; the two several-chunk terms, solved only when a measured step has several chunks: the
# per-chunk cost in microseconds and the mixed step's per-row cost in nanoseconds; the decode rows'
# per-layer cost in microseconds, solved where prefill-only steps and steps with decode rows were both
# measured; the two all-reduce terms, solved only for tp > 1: the latency in microseconds, the per-token
# time in nanoseconds; solved only for a MoE: a prefill chunk's routing skew (1 otherwise: uniform
# routing); the prefill chunks' attention occupancy in thousands of query rows, solved where a
# measured chunk follows a cached prefix; last, solved only for a MoE with measured steps on both sides of its
# grouped GEMM's tile switch: the experts' extra FLOP cost at the small tile (a share of their FLOPs, at most
# 2: three times the large tile's). Terms not solved stay 0.
_LOWER = np.array([0.05, 0.05, 0.05, 0.05, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0,
                   0.0])
_UPPER = np.array([1.5, 1.5, 1.5, 1.5, 64.0, 1e5, 1e4, 1e5, 1024.0, 64.0, 100.0, 1e3, 1e5, 1e3, 500.0, 1e3, 64.0,
                   1e3, 2.0])
_STARTS = (
    np.array([0.6, 0.8, 0.5, 0.7, 4.0, 200.0, 10.0, 100.0, 8.0, 4.0, 5.0, 10.0, 100.0, 10.0, 20.0, 30.0, 2.0, 8.0,
              0.5]),
    np.array([0.8, 0.9, 0.3, 0.5, 2.0, 1000.0, 1.0, 10.0, 32.0, 2.0, 0.0, 1.0, 10.0, 30.0, 40.0, 20.0, 4.0, 16.0,
              1.0]),
    np.array([0.4, 0.6, 0.8, 0.9, 8.0, 50.0, 50.0, 500.0, 2.0, 8.0, 20.0, 30.0, 500.0, 1.0, 10.0, 50.0, 8.0, 2.0,
              0.25]),
)
_BASE_TERMS = 11
_SEVERAL_CHUNK_TERMS = (11, 12)
_DECODE_LAYER_TERMS = (13,)
_TP_TERMS = (14, 15)
_MOE_TERM = 16
_CHUNK_OCCUPANCY_TERM = 17
_SMALL_TILE_TERM = 18


def _params(x: np.ndarray, tp: int = 1, moe: bool = False) -> ForwardParams:
    return ForwardParams(compute_efficiency=x[0], memory_efficiency=x[1], attention_efficiency=x[2],
                         kv_memory_efficiency=x[3], linear_sharpness=x[4], step_overhead_s=x[5] * 1e-6,
                         token_layer_s=x[6] * 1e-9, row_layer_s=x[7] * 1e-9, attention_rows=x[8],
                         attention_sharpness=x[9], multi_token_read=x[10] * 1e-2, chunk_layer_s=x[11] * 1e-6,
                         mixed_row_layer_s=x[12] * 1e-9, decode_layer_s=x[13] * 1e-6,
                         all_reduce_s=x[14] * 1e-6 if tp > 1 else None,
                         all_reduce_token_s=x[15] * 1e-9, chunk_routing_skew=x[16] if moe else 1.0,
                         chunk_attention_rows=x[17] * 1e3, expert_small_tile_cost=x[18] if moe else 0.0)


def peak_times(forward: ForwardCostModel, rows: Sequence[ForwardMeasurement]) -> PeakTimes:
    """The measured shapes' parts at the datasheet peaks, as arrays."""
    def column(values: list[float]) -> np.ndarray:
        return np.asarray(values, dtype=np.float64)

    return forward.peak_times(column([r.prefill_tokens for r in rows]), column([r.prefill_pairs for r in rows]),
                              column([r.decode_rows for r in rows]), column([r.decode_kv_tokens for r in rows]),
                              column([r.prefill_chunks for r in rows]))


def fit_calibration(rows: Sequence[ForwardMeasurement], model: str | ModelSpec, gpu: str | GPUSpec, *, measurements: str,
                    command: str, all_reduce_token_s: float | None = None,
                    all_reduce_runs: Sequence[str] = ()) -> ForwardCalibration:
    """Fit :class:`ForwardCalibration` to ``rows`` (all of one model and one device): the step terms to the
    step shapes, then the MTP head's draft term to the draft shapes (:func:`fit_draft`) where there are any.

    ``all_reduce_token_s`` (tp > 1): the all-reduce's per-token time as measured (``all_reduce_runs``: where),
    held at that value; without it the fit solves it with the rest.
    """
    if not rows:
        raise CalibrationError("no measurements to fit")
    # the step terms see the step shapes only (``rows`` from here on); the draft shapes are fitted after them
    everything, rows = rows, [r for r in rows if not r.mtp_drafts]
    drafts = [r for r in everything if r.mtp_drafts]
    if not rows:
        raise CalibrationError(f"the {len(drafts)} measurements are all draft shapes: the draft term is fitted "
                               "beside step shapes (measure a step grid too)")
    ranks = {r.tp for r in everything}
    if len(ranks) != 1:
        raise CalibrationError(f"measurements mix tensor-parallel sizes: {', '.join(map(str, sorted(ranks)))}")
    tp = ranks.pop()
    forward = ForwardCostModel(model, gpu, tp=tp, forward_calibration="none")
    names = {r.model for r in everything}
    if names != {forward.model.name}:
        raise CalibrationError(f"measurements are of {', '.join(sorted(names))}, not {forward.model.name}")
    devices = {r.gpu_device for r in everything}
    if len(devices) != 1:
        raise CalibrationError(f"measurements come from several devices: {', '.join(sorted(devices))}")
    attention = {r.decode_attention for r in rows}
    if len(attention) != 1:
        raise CalibrationError(f"measurements mix decode attention paths: {', '.join(sorted(attention))}")
    idles = {r.idle_s for r in everything}
    if len(idles) != 1:
        raise CalibrationError(f"measurements mix idle gaps before their repetitions: {sorted(idles)} s")
    written = {r.contexts_written for r in rows}  # (a draft shape's passes write their own keys: never a prefill's)
    if len(written) != 1:
        raise CalibrationError("measurements mix written and unwritten contexts")
    if all_reduce_token_s is not None and tp == 1:
        raise CalibrationError("a measured all-reduce prices tensor-parallel steps; these measurements are of one GPU")
    peak = peak_times(forward, rows)
    measured = np.asarray([r.median_s for r in rows])

    # with one chunk a step, the per-chunk and mixed per-row costs are not told apart from the rest: they stay 0,
    # out of the solved vector; so do the decode rows' per-layer cost without both prefill-only steps and steps
    # with decode rows (it would be the step overhead again) and the chunks' attention occupancy without a chunk
    # after a cached prefix (the only attention long enough to show it); the all-reduce terms for tp > 1 only
    free = list(range(_BASE_TERMS))
    if max(r.prefill_chunks for r in rows) >= 2:
        free += _SEVERAL_CHUNK_TERMS
    if any(r.decode_rows for r in rows) and any(r.prefill_chunks and not r.decode_rows for r in rows):
        free += _DECODE_LAYER_TERMS
    if tp > 1:
        free += _TP_TERMS if all_reduce_token_s is None else _TP_TERMS[:-1]
    if any(r.prefill_chunks and r.prefill_cached for r in rows):
        free.append(_CHUNK_OCCUPANCY_TERM)
    fixed = np.zeros(len(_LOWER))
    if all_reduce_token_s is not None:
        fixed[_TP_TERMS[-1]] = all_reduce_token_s * 1e9

    def solve(free: list[int], moe: bool, extra_starts: Sequence[np.ndarray] = ()) -> np.ndarray:
        """The best full parameter vector solving the ``free`` terms (least squares, then the refinement)."""
        lower, upper = _LOWER[free], _UPPER[free]

        def full(x: np.ndarray) -> np.ndarray:
            vector = fixed.copy()
            vector[free] = x
            return vector

        def residuals(x: np.ndarray) -> np.ndarray:
            return forward.price(peak, _params(full(x), tp, moe)) / measured - 1.0

        starts = [start[free] for start in _STARTS] + [start[free] for start in extra_starts]
        best = min((least_squares(residuals, start, bounds=(lower, upper), x_scale="jac", max_nfev=4000)
                    for start in starts), key=lambda result: result.cost).x

        def high_power(x: np.ndarray) -> np.ndarray:
            r = residuals(x)
            return np.sign(r) * np.abs(r) ** (_REFINE_POWER / 2)

        refined = least_squares(high_power, best, bounds=(lower, upper), x_scale="jac", max_nfev=4000).x
        worst = np.abs(residuals(refined)).max()
        if worst < np.abs(residuals(best)).max() and worst <= MAX_ERROR_BAR:
            best = refined
        return full(best)

    best = solve(free, moe=False)
    moe = forward.model.is_moe
    tile_terms: list[int] = []
    if moe:
        # the routing skew starts also from the fit without it (skew 1: the same prices), so the fit with it
        # never ends at a higher least-squares cost than the one without
        uniform = best.copy()
        uniform[_MOE_TERM] = 1.0
        # the small tile's cost is told from the rest only by steps on both sides of the switch (tile_terms)
        small_tile = peak.small_tile_flops_s > 0
        if small_tile.any() and not small_tile.all():
            tile_terms.append(_SMALL_TILE_TERM)
        best = solve([*free, _MOE_TERM, *tile_terms], moe=True, extra_starts=[uniform])
    params = _params(best, tp, moe)
    cal = ForwardCalibration(
        model=forward.model.name, gpu=forward.gpu.name, gpu_device=devices.pop(),
        compute_efficiency=params.compute_efficiency, memory_efficiency=params.memory_efficiency,
        attention_efficiency=params.attention_efficiency, kv_memory_efficiency=params.kv_memory_efficiency,
        linear_sharpness=params.linear_sharpness, step_overhead_s=params.step_overhead_s,
        token_layer_s=params.token_layer_s, row_layer_s=params.row_layer_s,
        attention_rows=params.attention_rows, attention_sharpness=params.attention_sharpness,
        multi_token_read=params.multi_token_read, chunk_attention_rows=params.chunk_attention_rows,
        chunk_layer_s=params.chunk_layer_s,
        mixed_row_layer_s=params.mixed_row_layer_s, decode_layer_s=params.decode_layer_s,
        all_reduce_s=params.all_reduce_s, all_reduce_token_s=params.all_reduce_token_s,
        chunk_routing_skew=params.chunk_routing_skew if moe else None,
        expert_small_tile_cost=params.expert_small_tile_cost if tile_terms else None,
        all_reduce_runs=list(all_reduce_runs), measurements=measurements, command=command, torch_version=rows[0].torch_version,
        decode_attention=attention.pop(), tp=tp, idle_s=idles.pop(), contexts_written=written.pop(), fit=[],
    )
    if drafts:
        steps_only = ForwardCostModel(forward.model, forward.gpu, tp=tp, forward_calibration=cal)
        cal = cal.model_copy(update={"mtp_draft": fit_draft(drafts, steps_only)})
    fitted = ForwardCostModel(forward.model, forward.gpu, tp=tp, forward_calibration=cal)
    predicted = price_rows(fitted, everything)
    return cal.model_copy(update={"fit": [ShapeFit(shape=r.label, measured_s=r.median_s, predicted_s=float(p))
                                          for r, p in zip(everything, predicted, strict=True)]})


def fit_draft(rows: Sequence[ForwardMeasurement], forward: ForwardCostModel) -> MtpDraftFit:
    """The MTP head's draft term fitted to draft shapes ``rows``, priced by ``forward`` (the step fit, without a
    draft term): each pass ``pass_s + roof_scale·roof``, the pair minimising the squared relative errors."""
    if forward.model.mtp_layers == 0:
        raise CalibrationError(f"draft shapes measured for {forward.model.name}, which has no MTP layer")
    measured = np.asarray([r.median_s for r in rows])
    passes = np.asarray([r.mtp_drafts for r in rows], dtype=np.float64)
    roof = np.asarray([forward.mtp_roof_s(r.decode_rows, r.mtp_drafts, r.decode_kv_tokens) for r in rows])
    # the fixed cost in milliseconds, so both columns are of order one for the solver
    design = np.column_stack([passes * 1e-3, roof]) / measured[:, None]
    solved = lsq_linear(design, np.ones(len(rows)), bounds=(0.0, np.inf), method="bvls").x
    return MtpDraftFit(pass_s=float(solved[0]) * 1e-3, roof_scale=float(solved[1]))


def price_rows(forward: ForwardCostModel, rows: Sequence[ForwardMeasurement]) -> np.ndarray:
    """Seconds ``forward`` prices each of ``rows`` at: a step shape as a step, a draft shape as the head's passes."""
    prices = np.empty(len(rows))
    steps = [i for i, r in enumerate(rows) if not r.mtp_drafts]
    if steps:
        prices[steps] = forward.price(peak_times(forward, [rows[i] for i in steps]))
    for i, r in enumerate(rows):
        if r.mtp_drafts:
            prices[i] = forward.mtp_draft_s(r.decode_rows, r.mtp_drafts, r.decode_kv_tokens)
    return prices


def roofline_errors(rows: Sequence[ForwardMeasurement], model: str | ModelSpec, gpu: str | GPUSpec) -> np.ndarray:
    """Relative errors of the uncalibrated roofline on ``rows`` (for the fit tables)."""
    forward = ForwardCostModel(model, gpu, tp=rows[0].tp, forward_calibration="none")
    return price_rows(forward, rows) / np.asarray([r.median_s for r in rows]) - 1.0


def holdout_errors(rows: Sequence[ForwardMeasurement], model: str | ModelSpec, gpu: str | GPUSpec, folds: int,
                   **fit_options) -> np.ndarray:
    """Each shape's relative error when priced by a fit of the other folds: the fit's out-of-sample error, one
    value per row of ``rows``. The ``i``-th step shape is in fold ``i % folds``, and the ``j``-th draft shape in
    fold ``j % folds`` (so the step shapes' folds are the same with or without draft shapes)."""
    steps = [i for i, r in enumerate(rows) if not r.mtp_drafts]
    drafts = [i for i, r in enumerate(rows) if r.mtp_drafts]
    if not 2 <= folds <= len(steps):
        raise CalibrationError(f"hold-out folds must be between 2 and the {len(steps)} step shapes, got {folds}")
    if drafts and len(drafts) < 2:
        raise CalibrationError("holding out the one draft shape leaves none to fit the draft term")
    fold_of = np.empty(len(rows), dtype=np.int64)
    for members in (steps, drafts):
        fold_of[members] = np.arange(len(members)) % folds
    errors = np.empty(len(rows))
    for fold in range(folds):
        held = [i for i in range(len(rows)) if fold_of[i] == fold]
        cal = fit_calibration([r for i, r in enumerate(rows) if fold_of[i] != fold], model, gpu, measurements="",
                              command="", **fit_options)
        forward = ForwardCostModel(model, gpu, tp=cal.tp, forward_calibration=cal)
        errors[held] = price_rows(forward, [rows[i] for i in held]) / np.asarray([rows[i].median_s for i in held]) - 1.0
    return errors
