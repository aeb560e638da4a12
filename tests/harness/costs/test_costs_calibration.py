"""Forward calibrations: the shipped fits meet the bar, the fit reproduces them, the model picks them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from cdbench.harness.costs.calibration import (
    CALIBRATION_DIR,
    CalibrationError,
    ForwardCalibration,
    read_measurements,
    shipped_calibration_path,
    write_measurements,
)
from cdbench.harness.costs.calibration_fit import fit_calibration
from cdbench.harness.costs.forward import ForwardConfig, ForwardCostModel, attention_pairs

REPO = Path(__file__).resolve().parents[3]
SHIPPED = sorted(CALIBRATION_DIR.glob("*.json"))


def test_shipped_for_both_models_on_both_gpus() -> None:
    names = {p.name for p in SHIPPED}
    assert names >= {f"{m}__{g}.json" for m in ("llama-3.1-8b", "qwen3-8b") for g in ("h100-sxm", "h200")}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_fit_meets_the_bar_on_its_measurements(path: Path) -> None:
    cal = ForwardCalibration.load(path)
    rows = read_measurements(REPO / cal.measurements)
    assert [r.label for r in rows] == [s.shape for s in cal.fit]
    assert len(cal.fit) >= 70
    assert cal.max_abs_error <= 0.10
    assert cal.median_abs_error <= 0.05
    # The model as the simulator builds it predicts what the fit table says.
    fwd = ForwardCostModel(cal.model, cal.gpu, tp=cal.tp)
    assert fwd.calibration_source == path.name
    for row, shape in zip(rows, cal.fit, strict=True):
        predicted = fwd.step_s(row.prefill_tokens, row.prefill_pairs, row.decode_rows, row.decode_kv_tokens,
                               row.prefill_chunks) if not row.mtp_drafts else fwd.mtp_draft_s(
            row.decode_rows, row.mtp_drafts, row.decode_kv_tokens)
        assert predicted == pytest.approx(shape.predicted_s, rel=1e-9)
        assert shape.measured_s == row.median_s


def test_refit_of_stored_measurements_reproduces_the_shipped_calibration() -> None:
    shipped = ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h200"))
    rows = read_measurements(REPO / shipped.measurements)
    refit = fit_calibration(rows, "qwen3-8b", "h200", measurements=shipped.measurements, command="test")
    for old, new in zip(shipped.fit, refit.fit, strict=True):
        assert new.predicted_s == pytest.approx(old.predicted_s, rel=1e-3)


def test_roofline_stays_available_and_is_named() -> None:
    calibrated = ForwardCostModel("llama-3.1-8b", "h100")
    roofline = ForwardCostModel("llama-3.1-8b", "h100", forward_calibration="none")
    assert calibrated.calibration_source == "llama-3.1-8b__h100-sxm.json"
    assert roofline.calibration_source == "none"
    assert calibrated.step_s(decode_rows=1, decode_kv_tokens=1000) != roofline.step_s(decode_rows=1,
                                                                                      decode_kv_tokens=1000)
    # No shipped fit for this GPU, or for this many tensor-parallel ranks: the roofline, said so.
    assert ForwardCostModel("llama-3.1-8b", "a100").calibration_source == "none"
    assert ForwardCostModel("llama-3.1-8b", "h100", tp=4).calibration_source == "none"
    assert ForwardConfig(model="qwen3-8b", gpu="h200").build().calibration_source == "qwen3-8b__h200.json"
    explicit = ForwardCostModel("qwen3-8b", "h200", forward_calibration=shipped_calibration_path("qwen3-8b", "h200"))
    assert explicit.step_s(decode_rows=8, decode_kv_tokens=8000) == ForwardCostModel("qwen3-8b", "h200").step_s(
        decode_rows=8, decode_kv_tokens=8000)


def test_a_calibration_for_another_model_or_a_bad_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="is for llama-3.1-8b on h100-sxm at tp=1, not qwen3-8b on h100-sxm"):
        ForwardCostModel("qwen3-8b", "h100", forward_calibration=shipped_calibration_path("llama-3.1-8b", "h100-sxm"))
    # a one-GPU fit does not price tensor-parallel steps (they add all-reduces), nor the reverse
    with pytest.raises(CalibrationError, match="at tp=1, not qwen3-8b on h200 at tp=2"):
        ForwardCostModel("qwen3-8b", "h200", tp=2, forward_calibration=shipped_calibration_path("qwen3-8b", "h200"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "x"}')
    with pytest.raises(CalibrationError, match="bad.json: invalid forward calibration field"):
        ForwardCalibration.load(bad)


def test_bad_measurement_rows_are_named(tmp_path: Path) -> None:
    source = (REPO / "reports/calibration/llama-3.1-8b__h100-sxm.csv").read_text().splitlines()
    header, first = source[0], source[1].split(",")
    first[header.split(",").index("p90_s")] = "-1"
    path = tmp_path / "m.csv"
    path.write_text("\n".join([header, ",".join(first)]) + "\n")
    with pytest.raises(CalibrationError, match=r"m.csv:2: time '-1' is not positive"):
        read_measurements(path)
    path.write_text("model,kind\nx,decode\n")
    with pytest.raises(CalibrationError, match="lacks columns"):
        read_measurements(path)


def test_the_decode_attention_path_is_recorded_and_never_mixed(tmp_path: Path) -> None:
    import csv
    import dataclasses

    shipped = ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h200"))
    per_row = read_measurements(REPO / shipped.measurements)
    assert {r.decode_attention for r in per_row} == {"per_row"} and shipped.decode_attention == "per_row"
    # a file measured before the column existed was measured with dense attention
    path = tmp_path / "m.csv"
    write_measurements(per_row, path)
    with path.open() as fh:
        table = list(csv.reader(fh))
    column = table[0].index("decode_attention")
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows([row[:column] + row[column + 1:] for row in table])
    dense = read_measurements(path)
    assert dense == [dataclasses.replace(r, decode_attention="dense") for r in per_row]
    cal = fit_calibration(dense, "qwen3-8b", "h200", measurements=str(path), command="test")
    assert cal.decode_attention == "dense"
    with pytest.raises(CalibrationError, match="mix decode attention paths: dense, per_row"):
        fit_calibration(dense[:5] + per_row[5:], "qwen3-8b", "h200", measurements="x", command="test")


def test_a_step_of_several_tokens_reads_the_weights_at_the_matrix_kernels_rate() -> None:
    shipped = ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h200"))
    assert shipped.multi_token_read > 0 and shipped.multi_token_s == 0
    without = shipped.model_copy(update={"multi_token_read": 0.0})
    fitted, plain = (ForwardCostModel("qwen3-8b", "h200", forward_calibration=c) for c in (shipped, without))
    one, two = dict(decode_rows=1, decode_kv_tokens=700), dict(decode_rows=2, decode_kv_tokens=1400)
    assert fitted.step_s(**one) == plain.step_s(**one)
    # two tokens read the weights in 1 + multi_token_read times one token's read, and pay nearly all of it
    read = plain.breakdown(**two).linear_memory_s
    assert read == plain.breakdown(**one).linear_memory_s > 0
    assert fitted.breakdown(**two).linear_memory_s == pytest.approx(read * (1 + shipped.multi_token_read), rel=1e-12)
    assert fitted.step_s(**two) - plain.step_s(**two) == pytest.approx(shipped.multi_token_read * read, rel=0.02)
    # a long prefill runs at the compute roof, which hides the slower read
    long = dict(prefill_tokens=8192, prefill_context_tokens=float(attention_pairs(8192, 0)), prefill_chunks=1)
    assert 0 < fitted.step_s(**long) - plain.step_s(**long) < 0.05 * shipped.multi_token_read * read
    arrays = fitted.step_s_array([0, 0, 8192], [0, 0, long["prefill_context_tokens"]], [1, 2, 0], [700, 1400, 0],
                                 [0, 0, 1])
    assert arrays.tolist() == pytest.approx([fitted.step_s(**one), fitted.step_s(**two), fitted.step_s(**long)],
                                            rel=1e-12)
    # a fit made before the term added a constant to every step of two or more tokens, and is priced so
    older = ForwardCostModel("qwen3-8b", "h200", forward_calibration=without.model_copy(
        update={"multi_token_s": 3e-4}))
    assert older.step_s(**one) == plain.step_s(**one)
    for shape in (two, long):
        assert older.step_s(**shape) - plain.step_s(**shape) == pytest.approx(3e-4, rel=1e-9)
    # calibrations written before either term existed load as without them
    bare = ForwardCalibration.model_validate(shipped.model_dump(exclude={"multi_token_s", "multi_token_read"}))
    assert bare.multi_token_s == bare.multi_token_read == 0.0


_ROWS_APART = {"qwen3-8b__h200__tp2": "the TP=2 fit, timed after an idle gap, prices 1-row decode -3.0 % and 2-row "
                                    "-5.3 % (2.4 points apart): the form prices few-row TP decode low"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=_ROWS_APART[p.stem]))
                                  if p.stem in _ROWS_APART else p for p in SHIPPED], ids=lambda p: p.stem)
def test_shipped_fit_prices_one_and_two_decode_rows_alike(path: Path) -> None:
    """One- and two-row decode steps (what each data-parallel rank runs under light load) are priced with the same
    bias within 2 points: the step to matrix kernels is priced as measured (a constant for every step of two or
    more tokens, fitted to prefill steps too, had qwen3-8b on the H200 at -3.6 % for one row, +4.3 % for two)."""
    cal = ForwardCalibration.load(path)

    def bias(rows: int) -> float:
        errors = [s.error for s in cal.fit if not s.is_draft and "+" not in s.shape
                  and s.shape.startswith(f"decode {rows}x") and int(s.shape.split("x")[1]) <= 2048]
        assert len(errors) == 4
        return float(np.mean(errors))

    assert abs(bias(2) - bias(1)) < 0.02


def test_the_fit_recovers_a_known_several_token_read_and_chunk_occupancy() -> None:
    import dataclasses

    truth = ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h200")).model_copy(
        update={"multi_token_read": 0.08, "chunk_attention_rows": 6000.0})
    model = ForwardCostModel("qwen3-8b", "h200", forward_calibration=truth)
    rows = read_measurements(REPO / truth.measurements)
    exact = [dataclasses.replace(r, median_s=model.step_s(r.prefill_tokens, r.prefill_pairs, r.decode_rows,
                                                          r.decode_kv_tokens, r.prefill_chunks)) for r in rows]
    cal = fit_calibration(exact, "qwen3-8b", "h200", measurements="x", command="test")
    assert cal.max_abs_error < 0.005
    assert cal.multi_token_read == pytest.approx(0.08, rel=0.1)
    assert cal.chunk_attention_rows == pytest.approx(6000.0, rel=0.1)
    assert cal.multi_token_s == 0  # no longer fitted
    # without a chunk after a cached prefix the occupancy is not fitted
    fresh = fit_calibration([r for r in exact if not r.prefill_cached], "qwen3-8b", "h200", measurements="x",
                            command="test")
    assert fresh.chunk_attention_rows == 0


def test_a_short_chunk_after_a_long_prefix_attends_at_the_gpus_partial_occupancy() -> None:
    shipped = ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h200"))
    rows_needed = shipped.chunk_attention_rows
    assert 64 * 32 < rows_needed < 1024 * 32  # between a 64-token chunk's query rows and a 1,024-token one's
    fitted = ForwardCostModel("qwen3-8b", "h200", forward_calibration=shipped)
    plain = ForwardCostModel("qwen3-8b", "h200", forward_calibration=shipped.model_copy(
        update={"chunk_attention_rows": 0.0}))
    short = dict(prefill_tokens=64, prefill_context_tokens=float(attention_pairs(64, 2048)), prefill_chunks=1)
    pairs_s = plain.breakdown(**short).prefill_attention_s
    assert fitted.breakdown(**short).prefill_attention_s == pytest.approx(pairs_s * rows_needed / (64 * 32), rel=1e-12)
    assert fitted.step_s(**short) - plain.step_s(**short) == pytest.approx(
        pairs_s * (rows_needed / (64 * 32) - 1), rel=1e-9)
    # the same tokens in two chunks: each chunk has half the rows
    two = dict(short, prefill_context_tokens=2 * float(attention_pairs(32, 2048)), prefill_chunks=2)
    assert fitted.breakdown(**two).prefill_attention_s == pytest.approx(
        plain.breakdown(**two).prefill_attention_s * rows_needed / (32 * 32), rel=1e-12)
    # a long chunk fills the GPU, and a decode-only step has no chunk
    long = dict(prefill_tokens=1024, prefill_context_tokens=float(attention_pairs(1024, 2048)), prefill_chunks=1)
    decode = dict(decode_rows=8, decode_kv_tokens=8000)
    assert fitted.step_s(**long) == plain.step_s(**long) and fitted.step_s(**decode) == plain.step_s(**decode)
    # beside decode rows the chunk's rows are its own tokens' (the decode rows attend apart)
    mixed = dict(short, **decode)
    assert fitted.step_s(**mixed) - plain.step_s(**mixed) == pytest.approx(
        fitted.step_s(**short) - plain.step_s(**short), rel=1e-9)
    assert fitted.step_s_array([64, 1024], [short["prefill_context_tokens"], long["prefill_context_tokens"]], [0, 0],
                               [0, 0], [1, 1]).tolist() == pytest.approx([fitted.step_s(**short),
                                                                          fitted.step_s(**long)], rel=1e-12)
    # at TP=2 a rank runs half the query heads, so the same chunk has half the rows
    tp2 = _tp2()
    half = ForwardCostModel("qwen3-8b", "h200", tp=2, forward_calibration=tp2)
    half_plain = ForwardCostModel("qwen3-8b", "h200", tp=2, forward_calibration=tp2.model_copy(
        update={"chunk_attention_rows": 0.0}))
    assert half.breakdown(**short).prefill_attention_s == pytest.approx(
        half_plain.breakdown(**short).prefill_attention_s * tp2.chunk_attention_rows / (64 * 16), rel=1e-12)
    # a hybrid's linear-attention layers run no flash attention: only its full-attention pairs are scaled
    hybrid = ForwardCostModel("qwen3.5-35b-a3b", "h200", forward_calibration="none")
    params = hybrid.params
    peak = hybrid.peak_times(64, float(attention_pairs(64, 2048)), 0, 0, 1)
    assert peak.prefill_state_s > 0
    import dataclasses

    _, _, scaled, _, _, _ = hybrid._parts(peak, dataclasses.replace(params, chunk_attention_rows=64 * 16 * 3))
    _, _, alone, _, _, _ = hybrid._parts(peak, params)
    assert scaled - alone == pytest.approx(2 * peak.prefill_attention_s / params.attention_efficiency, rel=1e-12)
    # calibrations written before the term existed load as without it
    assert ForwardCalibration.model_validate(shipped.model_dump(exclude={"chunk_attention_rows"})
                                             ).chunk_attention_rows == 0.0


def test_each_prefill_chunk_pays_its_own_kernels_in_every_layer() -> None:
    shipped = ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h100-sxm"))
    # shorter chunks also attend at a lower occupancy: held apart here (its own test)
    priced = shipped.model_copy(update={"chunk_layer_s": 2e-5, "chunk_attention_rows": 0.0})
    forward = ForwardCostModel("qwen3-8b", "h100-sxm", forward_calibration=priced)
    layers = forward.model.n_layers
    shape = dict(prefill_tokens=1024, prefill_context_tokens=40_000, decode_rows=8, decode_kv_tokens=8000)
    assert forward.step_s(**shape, prefill_chunks=4) - forward.step_s(**shape, prefill_chunks=1) == pytest.approx(
        3 * layers * 2e-5, rel=1e-9)
    assert forward.step_s_array([1024, 1024], [40_000] * 2, [8, 8], [8000] * 2, [1, 4]).tolist() == pytest.approx(
        [forward.step_s(**shape, prefill_chunks=1), forward.step_s(**shape, prefill_chunks=4)])
    # the scheduler's GPU costs count the step's chunks
    from cdbench.harness.costs.gpu import RooflineGpuCosts
    from cdbench.harness.costs.mask import MaskCost

    gpu = RooflineGpuCosts(forward, MaskCost.for_gpu("h100-sxm", 151_936))
    one, four = np.array([1024]), np.array([256] * 4)
    assert gpu.forward_s(four, np.zeros(4), 0, 0) - forward.step_s(
        1024, float(attention_pairs(four, np.zeros(4)).sum()), 0, 0, 1) == pytest.approx(3 * layers * 2e-5, rel=1e-6)
    assert gpu.forward_s(one, np.zeros(1), 0, 0) == forward.step_s(1024, float(attention_pairs(one, np.zeros(1))[0]),
                                                                     0, 0, 1)
    # calibrations written before the term existed load as without it
    assert ForwardCalibration.model_validate(shipped.model_dump(exclude={"chunk_layer_s"})).chunk_layer_s == 0.0


def test_decode_rows_beside_prefill_chunks_pay_the_mixed_row_cost() -> None:
    shipped = ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h100-sxm"))
    without = ForwardCostModel("qwen3-8b", "h100-sxm", forward_calibration=shipped.model_copy(
        update={"mixed_row_layer_s": 0.0}))
    with_term = ForwardCostModel("qwen3-8b", "h100-sxm", forward_calibration=shipped.model_copy(
        update={"mixed_row_layer_s": 3e-7}))
    layers = with_term.model.n_layers
    mixed = dict(prefill_tokens=512, prefill_context_tokens=float(attention_pairs(512, 0)), decode_rows=64,
                 decode_kv_tokens=64 * 1024, prefill_chunks=2)
    assert with_term.step_s(**mixed) - without.step_s(**mixed) == pytest.approx(64 * layers * 3e-7, rel=1e-9)
    # a decode-only step and a prefill-only step do not pay it
    assert with_term.step_s(decode_rows=64, decode_kv_tokens=64 * 1024) == without.step_s(
        decode_rows=64, decode_kv_tokens=64 * 1024)
    assert with_term.step_s(512, mixed["prefill_context_tokens"], prefill_chunks=2) == without.step_s(
        512, mixed["prefill_context_tokens"], prefill_chunks=2)
    # arrays price each step by its own chunk count
    assert with_term.step_s_array([512, 512], [mixed["prefill_context_tokens"]] * 2, [64, 64], [65536] * 2,
                                  [0, 2]).tolist() == pytest.approx(
        [with_term.step_s(512, mixed["prefill_context_tokens"], 64, 65536, 0), with_term.step_s(**mixed)])
    # calibrations written before the term existed load as without it
    assert ForwardCalibration.model_validate(
        shipped.model_dump(exclude={"mixed_row_layer_s"})).mixed_row_layer_s == 0.0


@pytest.mark.parametrize(("term", "value"), [("chunk_layer_s", 1.5e-5), ("mixed_row_layer_s", 4e-7)])
def test_the_fit_recovers_a_known_several_chunk_term(term: str, value: float) -> None:
    import dataclasses

    from cdbench.harness.live.measure import chunk_grid

    truth = ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h100-sxm")).model_copy(
        update={term: value})
    model = ForwardCostModel("qwen3-8b", "h100-sxm", forward_calibration=truth)
    rows = [r for r in read_measurements(REPO / truth.measurements) if r.prefill_chunks <= 1]
    several = [dataclasses.replace(rows[0], kind="mixed" if s.rows else "prefill", decode_rows=s.rows,
                                   decode_kv=s.kv, prefill_chunks=s.chunks, prefill_new=s.new, prefill_cached=0)
               for s in chunk_grid()]

    def exact(measured):
        return [dataclasses.replace(r, median_s=model.step_s(r.prefill_tokens, r.prefill_pairs, r.decode_rows,
                                                             r.decode_kv_tokens, r.prefill_chunks)) for r in measured]

    cal = fit_calibration(exact(rows + several), "qwen3-8b", "h100-sxm", measurements="x", command="test")
    assert cal.max_abs_error < 0.005
    assert getattr(cal, term) == pytest.approx(value, rel=0.15)
    # one chunk a step: neither several-chunk term is fitted
    one_chunk = fit_calibration(exact(rows), "qwen3-8b", "h100-sxm", measurements="x", command="test")
    assert one_chunk.chunk_layer_s == 0 and one_chunk.mixed_row_layer_s == 0


def test_the_default_grid_holds_mixed_steps_of_a_few_decode_rows() -> None:
    from cdbench.harness.live.measure import chunk_grid, default_grid, few_rows_grid

    grid, few = default_grid(), few_rows_grid()
    assert len(set(grid)) == len(grid) == 98
    assert set(few) <= set(grid) and set(chunk_grid()) <= set(grid)
    assert {(s.kind, s.chunks, s.cached) for s in few} == {("mixed", 1, 0)}
    assert {s.rows for s in few} == {1, 2, 4} and {s.new for s in few} == {256, 512, 1024}
    # every shipped calibration was measured over the whole grid
    for model, gpu in (("qwen3-8b", "h100-sxm"), ("llama-3.1-8b", "h100-sxm"), ("qwen3-8b", "h200"),
                       ("llama-3.1-8b", "h200")):
        cal = ForwardCalibration.load(shipped_calibration_path(model, gpu))
        assert len(cal.fit) == len(grid)


def _tp2() -> ForwardCalibration:
    return ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h200", 2))


def test_tensor_parallel_all_reduces_wait_out_their_latency_then_their_bytes() -> None:
    """Each of a tp step's 2·n_layers all-reduces costs max(latency, tokens·per-token time), the fitted values."""
    shipped = _tp2()
    assert shipped.all_reduce_s > 0 and shipped.all_reduce_token_s > 0 and shipped.all_reduce_runs
    fitted = ForwardCostModel("qwen3-8b", "h200", tp=2, forward_calibration=shipped)
    free = ForwardCostModel("qwen3-8b", "h200", tp=2, forward_calibration=shipped.model_copy(
        update={"all_reduce_s": 0.0, "all_reduce_token_s": 0.0}))
    all_reduces = 2 * fitted.model.n_layers
    corner = shipped.all_reduce_s / shipped.all_reduce_token_s  # tokens where the bytes take over
    for tokens in (1, 64, int(corner) - 8):  # latency-bound: the same for any step below the corner
        shape = dict(decode_rows=tokens, decode_kv_tokens=tokens * 512)
        assert fitted.step_s(**shape) - free.step_s(**shape) == pytest.approx(all_reduces * shipped.all_reduce_s,
                                                                              rel=1e-9)
    long = dict(prefill_tokens=4096, prefill_context_tokens=float(attention_pairs(4096, 0)), prefill_chunks=1)
    assert fitted.step_s(**long) - free.step_s(**long) == pytest.approx(
        all_reduces * 4096 * shipped.all_reduce_token_s, rel=1e-9)
    assert fitted.breakdown(**long).communication_s == pytest.approx(all_reduces * 4096 * shipped.all_reduce_token_s)
    # a tp fit made before the terms existed (no all_reduce_s) prices the GPU spec's all-reduces, as it was fitted
    older = shipped.model_dump(exclude={"all_reduce_s", "all_reduce_token_s", "all_reduce_runs"})
    old = ForwardCostModel("qwen3-8b", "h200", tp=2, forward_calibration=ForwardCalibration.model_validate(older))
    roofline = ForwardCostModel("qwen3-8b", "h200", tp=2, forward_calibration="none")
    assert old.breakdown(**long).communication_s == roofline.breakdown(**long).communication_s > 0


def test_a_step_with_decode_rows_pays_their_attention_kernels_in_every_layer() -> None:
    shipped = _tp2()
    assert shipped.decode_layer_s > 0
    with_term = ForwardCostModel("qwen3-8b", "h200", tp=2, forward_calibration=shipped)
    without = ForwardCostModel("qwen3-8b", "h200", tp=2, forward_calibration=shipped.model_copy(
        update={"decode_layer_s": 0.0}))
    layers = with_term.model.n_layers
    prefill = dict(prefill_tokens=256, prefill_context_tokens=float(attention_pairs(256, 0)), prefill_chunks=1)
    for shape in (dict(decode_rows=4, decode_kv_tokens=4096), dict(prefill, decode_rows=2, decode_kv_tokens=2048)):
        assert with_term.step_s(**shape) - without.step_s(**shape) == pytest.approx(layers * shipped.decode_layer_s,
                                                                                    rel=1e-9)
    assert with_term.step_s(**prefill) == without.step_s(**prefill)
    assert with_term.step_s_array([0, 256], [0, prefill["prefill_context_tokens"]], [4, 0], [4096, 0],
                                  [0, 1]).tolist() == pytest.approx(
        [with_term.step_s(decode_rows=4, decode_kv_tokens=4096), with_term.step_s(**prefill)])


@pytest.mark.parametrize("tp", [1, 2])
def test_the_fit_prices_small_decode_steps_closer_with_the_decode_term(tp: int) -> None:
    """The few-row decode steps (what a TP=2 run or a data-parallel rank under capacity decodes) are priced with
    less bias by the shipped fit than by a fit of the same measurements without the decode rows' per-layer term."""
    cal = ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h200", tp))

    def small_bias(fit: ForwardCalibration) -> float:
        small = [s.error for s in fit.fit if s.shape.startswith("decode") and "+" not in s.shape
                 and int(s.shape.split()[1].split("x")[0]) <= 16 and int(s.shape.split("x")[1]) <= 2048]
        assert len(small) == 20
        return abs(float(np.mean(small)))

    rows = read_measurements(REPO / cal.measurements)
    import cdbench.harness.costs.calibration_fit as fitting

    options = dict(all_reduce_token_s=cal.all_reduce_token_s) if tp > 1 else {}
    with pytest.MonkeyPatch.context() as patch:  # every term solved but the decode rows' one (0)
        patch.setattr(fitting, "_DECODE_LAYER_TERMS", ())
        # refined as the shipped fit was (without the term its refined worst shape misses the bar, so the rule
        # would keep its least-squares fit: another procedure, not the term's effect)
        patch.setattr(fitting, "MAX_ERROR_BAR", np.inf)
        without = fit_calibration(rows, "qwen3-8b", "h200", measurements="x", command="t", **options)
    assert without.decode_layer_s == 0 and cal.decode_layer_s > 0
    assert small_bias(cal) < small_bias(without)


def test_the_tp_fit_recovers_known_collective_and_decode_terms() -> None:
    import dataclasses

    truth = _tp2().model_copy(update={"decode_layer_s": 3e-5, "all_reduce_s": 3e-5, "step_overhead_s": 1e-3})
    model = ForwardCostModel("qwen3-8b", "h200", tp=2, forward_calibration=truth)
    rows = [dataclasses.replace(r, median_s=model.step_s(r.prefill_tokens, r.prefill_pairs, r.decode_rows,
                                                         r.decode_kv_tokens, r.prefill_chunks))
            for r in read_measurements(REPO / truth.measurements)]
    cal = fit_calibration(rows, "qwen3-8b", "h200", measurements="x", command="test",
                          all_reduce_token_s=truth.all_reduce_token_s, all_reduce_runs=["measured"])
    assert cal.max_abs_error < 0.01
    assert cal.all_reduce_token_s == truth.all_reduce_token_s and cal.all_reduce_runs == ["measured"]
    assert cal.decode_layer_s == pytest.approx(3e-5, rel=0.15)
    assert cal.all_reduce_s == pytest.approx(3e-5, rel=0.15)
    # without a measured per-token time the fit solves it too
    free = fit_calibration(rows, "qwen3-8b", "h200", measurements="x", command="test")
    assert free.max_abs_error < 0.02 and free.all_reduce_s is not None and not free.all_reduce_runs


def test_one_gpu_fits_solve_no_all_reduce_term_and_the_decode_term_only_beside_prefill_steps() -> None:
    rows = read_measurements(REPO / "reports/calibration/qwen3-8b__h200.csv")
    cal = fit_calibration(rows[:60], "qwen3-8b", "h200", measurements="x", command="test")
    assert cal.all_reduce_s is None and cal.all_reduce_token_s == 0 and cal.decode_layer_s > 0
    # decode steps alone: the decode rows' per-layer cost is the step overhead again, not solved
    assert {r.kind for r in rows[:50]} == {"decode"}
    assert fit_calibration(rows[:50], "qwen3-8b", "h200", measurements="x", command="test").decode_layer_s == 0
    with pytest.raises(CalibrationError, match="measured all-reduce prices tensor-parallel steps"):
        fit_calibration(rows, "qwen3-8b", "h200", measurements="x", command="test", all_reduce_token_s=3e-8)


def test_held_out_shapes_are_priced_by_a_fit_of_the_others() -> None:
    from cdbench.harness.costs.calibration_fit import holdout_errors

    cal = _tp2()
    rows = read_measurements(REPO / cal.measurements)
    options = dict(all_reduce_token_s=cal.all_reduce_token_s)
    held = holdout_errors(rows, "qwen3-8b", "h200", 4, **options)
    assert held.shape == (len(rows),)
    # a held-out shape is priced by a fit that did not see it: not the full fit's error, and worse at the worst
    fitted = np.array([s.error for s in cal.fit])
    assert not np.allclose(held, fitted) and np.abs(held).max() > np.abs(fitted).max()
    assert np.median(np.abs(held)) < 0.05
    fold = fit_calibration([r for i, r in enumerate(rows) if i % 4 != 1], "qwen3-8b", "h200", measurements="x",
                           command="t", **options)
    forward = ForwardCostModel("qwen3-8b", "h200", tp=2, forward_calibration=fold)
    r = rows[1]
    assert held[1] == pytest.approx(forward.step_s(r.prefill_tokens, r.prefill_pairs, r.decode_rows,
                                                   r.decode_kv_tokens, r.prefill_chunks) / r.median_s - 1, rel=1e-9)
    with pytest.raises(CalibrationError, match="hold-out folds must be between 2 and the 98 step shapes, got 1"):
        holdout_errors(rows, "qwen3-8b", "h200", 1)


# ---- the MTP head's draft shapes ------------------------------------------------------------------------------

HYBRID = "qwen3.5-35b-a3b"


def _draft_rows(forward: ForwardCostModel, like) -> list:
    """The draft grid's shapes, each timed at exactly ``forward``'s price (rows as a GPU run writes them)."""
    from cdbench.harness.live.measure import draft_grid

    return [dataclasses.replace(like, kind="draft", decode_rows=s.rows, decode_kv=s.kv, prefill_chunks=0,
                                prefill_new=0, prefill_cached=0, mtp_drafts=s.drafts,
                                median_s=forward.mtp_draft_s(s.rows, s.drafts, s.rows * s.kv)) for s in draft_grid()]


def test_measurement_files_round_trip_with_and_without_the_draft_column(tmp_path: Path) -> None:
    import csv

    shipped = read_measurements(REPO / f"reports/calibration/{HYBRID}__h200.csv")
    assert sorted({r.mtp_drafts for r in shipped}) == [0, 1, 3] and sum(r.kind == "draft" for r in shipped) == 18
    steps = [r for r in shipped if r.kind != "draft"]
    drafts = _draft_rows(ForwardCostModel(HYBRID, "h200"), steps[0])
    path = tmp_path / "m.csv"
    write_measurements(steps + drafts, path)
    back = read_measurements(path)
    assert back == steps + drafts and [r.kind for r in back[-2:]] == ["draft", "draft"]
    assert back[-1].label == "draft 128x1024 k3" and back[-1].mtp_drafts == 3
    with path.open() as fh:
        table = list(csv.reader(fh))
    column = table[0].index("mtp_drafts")
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows([row[:column] + row[column + 1:] for row in table[:len(steps) + 1]])
    assert read_measurements(path) == steps


def test_the_step_fit_ignores_draft_shapes_and_the_draft_term_is_recovered() -> None:
    from cdbench.harness.costs.calibration import MtpDraftFit

    steps = [r for r in read_measurements(REPO / f"reports/calibration/{HYBRID}__h200.csv") if r.kind != "draft"]
    plain = fit_calibration(steps, HYBRID, "h200", measurements="x", command="test")
    assert plain.mtp_draft is None
    truth = plain.model_copy(update={"mtp_draft": MtpDraftFit(pass_s=4e-4, roof_scale=1.7)})
    drafts = _draft_rows(ForwardCostModel(HYBRID, "h200", forward_calibration=truth), steps[0])
    # draft shapes among the steps, as the default grid of a model with an MTP head measures them
    mixed = steps[:40] + drafts + steps[40:]
    cal = fit_calibration(mixed, HYBRID, "h200", measurements="x", command="test")
    assert cal.model_dump(exclude={"mtp_draft", "fit"}) == plain.model_dump(exclude={"mtp_draft", "fit"})
    assert cal.mtp_draft.pass_s == pytest.approx(4e-4, rel=1e-6)
    assert cal.mtp_draft.roof_scale == pytest.approx(1.7, rel=1e-6)
    # every shape in the fit table, in the measured order, the draft shapes exactly priced
    assert [s.shape for s in cal.fit] == [r.label for r in mixed]
    assert [s for s in cal.fit if not s.is_draft] == plain.fit
    assert max(abs(s.error) for s in cal.fit if s.is_draft) < 1e-9
    with pytest.raises(CalibrationError, match="all draft shapes: the draft term is fitted beside step shapes"):
        fit_calibration(drafts, HYBRID, "h200", measurements="x", command="test")
    with pytest.raises(CalibrationError, match="qwen3-8b, which has no MTP layer"):
        dense = read_measurements(REPO / "reports/calibration/qwen3-8b__h200.csv")[:30]
        fit_calibration(dense + [dataclasses.replace(r, model="qwen3-8b", idle_s=dense[0].idle_s) for r in drafts[:2]],
                        "qwen3-8b", "h200", measurements="x", command="test")


def test_the_head_is_priced_by_the_fitted_draft_term_and_by_the_roofline_without_one() -> None:
    from cdbench.harness.costs.calibration import MtpDraftFit
    from cdbench.harness.costs.forward_speed import ForwardSpeed

    shipped = ForwardCalibration.load(shipped_calibration_path(HYBRID, "h200"))
    assert shipped.mtp_draft is not None and shipped.mtp_draft.roof_scale > 0  # its draft shapes were measured
    shipped = shipped.model_copy(update={"mtp_draft": None})  # without the term: the head's passes are the roofline's
    plain = ForwardCostModel(HYBRID, "h200", forward_calibration=shipped)
    roof = plain.mtp_roof_s(16, 3, 16 * 4096)
    assert plain.mtp_draft_s(16, 3, 16 * 4096) == roof > 0
    fitted = shipped.model_copy(update={"mtp_draft": MtpDraftFit(pass_s=3e-4, roof_scale=2.5)})
    model = ForwardCostModel(HYBRID, "h200", forward_calibration=fitted)
    assert model.mtp_draft_s(16, 3, 16 * 4096) == pytest.approx(3 * 3e-4 + 2.5 * roof, rel=1e-12)
    assert model.mtp_draft_s(0, 3) == 0.0 == model.mtp_draft_s(16, 0)
    # the steps are the step fit's either way; the host's decode speed scales the passes
    assert model.step_s(decode_rows=8, decode_kv_tokens=8000) == plain.step_s(decode_rows=8, decode_kv_tokens=8000)
    slow = ForwardCostModel(HYBRID, "h200", speed=ForwardSpeed.given(1.25), forward_calibration=fitted)
    assert slow.mtp_draft_s(4, 2, 4000) == pytest.approx(1.25 * model.mtp_draft_s(4, 2, 4000), rel=1e-12)


def test_draft_shapes_are_held_out_in_their_own_folds() -> None:
    from cdbench.harness.costs.calibration import MtpDraftFit
    from cdbench.harness.costs.calibration_fit import holdout_errors

    spec = ForwardCostModel("qwen3-8b", "h200").model.model_copy(update={"mtp_layers": 1})
    steps = read_measurements(REPO / "reports/calibration/qwen3-8b__h200.csv")
    plain = fit_calibration(steps, spec, "h200", measurements="x", command="test")
    truth = plain.model_copy(update={"mtp_draft": MtpDraftFit(pass_s=2e-4, roof_scale=1.3)})
    drafts = _draft_rows(ForwardCostModel(spec, "h200", forward_calibration=truth), steps[0])
    held = holdout_errors(steps + drafts, spec, "h200", 4)
    # the step shapes' folds (and so their held-out errors) are what they are without draft shapes
    assert held[:len(steps)].tolist() == holdout_errors(steps, spec, "h200", 4).tolist()
    # exact draft times: a fit of three quarters of them prices the rest exactly
    assert np.abs(held[len(steps):]).max() < 1e-9
    with pytest.raises(CalibrationError, match="holding out the one draft shape"):
        holdout_errors(steps + drafts[:1], spec, "h200", 4)


def test_a_refinement_that_still_misses_the_bar_is_not_kept() -> None:
    """The eighth-power refinement lowers the worst shape at some cost to the rest; it is kept only when the worst
    shape then meets the bar, otherwise the least-squares fit (lower errors on the other shapes) is."""
    import cdbench.harness.costs.calibration_fit as fitting

    shipped = ForwardCalibration.load(shipped_calibration_path("qwen3-8b", "h200"))
    rows = read_measurements(REPO / shipped.measurements)
    refined = fit_calibration(rows, "qwen3-8b", "h200", measurements="x", command="t")
    with pytest.MonkeyPatch.context() as patch:  # a bar no fit of these shapes meets
        patch.setattr(fitting, "MAX_ERROR_BAR", 1e-3)
        least_squares = fit_calibration(rows, "qwen3-8b", "h200", measurements="x", command="t")

    def errors(cal: ForwardCalibration) -> np.ndarray:
        return np.array([s.error for s in cal.fit])

    assert refined.max_abs_error < least_squares.max_abs_error and refined.max_abs_error <= fitting.MAX_ERROR_BAR
    assert (errors(least_squares) ** 2).sum() < (errors(refined) ** 2).sum()
