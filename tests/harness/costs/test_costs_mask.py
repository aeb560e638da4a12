"""Mask apply / copy / sample costs from the measured tables."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cdbench.harness.costs.mask import REFERENCE_TABLE, MaskCost, bitmask_bytes
from cdbench.kernels.cost_table import CopyTiming, KernelTiming, MaskCostTable


@pytest.fixture(scope="module")
def reference() -> MaskCostTable:
    return MaskCostTable.load(REFERENCE_TABLE)


def test_reference_table_holds_the_measured_points(reference: MaskCostTable) -> None:
    assert reference.gpu == "h200" and "gpu_mask_kernels.md" in reference.source
    kernels = {r.kernel for r in reference.apply}
    assert {"xgr-cuda", "xgr-triton", "ref-rw", "naive", "copy"} <= kernels
    # spot checks against the document's sparse bf16 table at B = 1024, V = 151936
    point = {r.kernel: r.us for r in reference.apply
             if (r.vocab, r.batch, r.dtype, r.density) == (151936, 1024, "bf16", "sparse")}
    assert point["xgr-triton"] == 512 and point["xgr-cuda"] == 161 and point["copy"] == 150
    pinned = {r.bytes: r.us for r in reference.copy_h2d if r.pinned}
    assert pinned[bitmask_bytes(1024, 248320)] == 576
    assert any(not r.pinned for r in reference.copy_h2d)


def test_table_points_are_reproduced(reference: MaskCostTable) -> None:
    cost = MaskCost(reference, vocab_size=151936, kernel="xgr-cuda")
    assert cost.apply_s(1024) == pytest.approx(161e-6)
    assert cost.apply_s(256) == pytest.approx(45.7e-6)
    assert cost.copy_s(1024) == pytest.approx(354e-6)
    assert cost.copy_s(1024, pinned=False) == pytest.approx(1403e-6)


def test_batch_between_points_interpolates_log_log(reference: MaskCostTable) -> None:
    cost = MaskCost(reference, vocab_size=151936)  # xgr-triton, the table's default kernel
    t = (math.log(512) - math.log(256)) / (math.log(1024) - math.log(256))
    expected = math.exp(math.log(149) + t * (math.log(512) - math.log(149))) * 1e-6
    assert cost.apply_s(512) == pytest.approx(expected)
    assert cost.apply_s(256) < cost.apply_s(512) < cost.apply_s(1024)
    assert cost.apply_s(0) == 0.0


def test_vocab_scaling_is_linear_from_the_nearest_measured_vocab(reference: MaskCostTable) -> None:
    measured = MaskCost(reference, vocab_size=248320, kernel="ref-rw")
    qwen36 = MaskCost(reference, vocab_size=248077, kernel="ref-rw")
    assert qwen36.apply_s(1024) == pytest.approx(measured.apply_s(1024) * 248077 / 248320)
    bigger = MaskCost(reference, vocab_size=2 * 248320, kernel="ref-rw")
    assert bigger.apply_s(256) == pytest.approx(2 * measured.apply_s(256))


def test_pinned_copies_beat_pageable(reference: MaskCostTable) -> None:
    cost = MaskCost(reference, vocab_size=248077)
    for rows in (1, 8, 64, 256, 1024, 4096):
        assert cost.copy_s(rows, pinned=True) < cost.copy_s(rows, pinned=False)
    # large copies run at the measured ~55 GB/s
    rows = 4096
    assert bitmask_bytes(rows, 248077) / cost.copy_s(rows) == pytest.approx(55e9, rel=0.05)


def test_costs_never_decrease_with_rows(reference: MaskCostTable) -> None:
    cost = MaskCost(reference, vocab_size=151936)
    rows = np.arange(0, 3000)
    for values in (cost.apply_s(rows), cost.copy_s(rows), cost.copy_s(rows, pinned=False), cost.sample_s(rows)):
        assert values[0] == 0.0
        assert np.all(np.diff(values) >= 0)


def test_vectorized_matches_scalar(reference: MaskCostTable) -> None:
    cost = MaskCost(reference, vocab_size=129280, dtype="fp32", density="dense", kernel="xgr-cuda")
    rows = np.array([0, 1, 3, 64, 100, 5000])
    np.testing.assert_allclose(cost.apply_s(rows), [cost.apply_s(int(r)) for r in rows])
    np.testing.assert_allclose(cost.copy_s(rows), [cost.copy_s(int(r)) for r in rows])
    np.testing.assert_allclose(cost.sample_s(rows), [cost.sample_s(int(r)) for r in rows])
    with pytest.raises(ValueError, match="rows"):
        cost.apply_s(-1)


def test_sample_model(reference: MaskCostTable) -> None:
    cost = MaskCost(reference, vocab_size=100_000, dtype="bf16")
    gpu = cost.gpu
    per_row = 100_000 * (3 * 2 + 4) / (gpu.hbm_bandwidth_Bps * gpu.memory_efficiency)
    assert cost.sample_s(10) - cost.sample_s(1) == pytest.approx(9 * per_row)
    assert cost.sample_s(0) == 0.0


def test_gpu_choice_and_scaling(tmp_path, monkeypatch) -> None:
    from cdbench.harness.costs import mask

    monkeypatch.setattr(mask, "TABLE_DIR", tmp_path)  # no measured tables: only the reference
    h200 = MaskCost.for_gpu("h200", 151936)
    assert not h200.scaled and "reference" in h200.provenance and h200.kernel == "xgr-triton"
    h100 = MaskCost.for_gpu("h100", 151936)
    assert h100.scaled and "estimated" in h100.provenance and "h100" in h100.provenance
    # the one-row (launch-latency) time stays, the bandwidth-bound rest scales with HBM bandwidth
    assert h100.apply_s(1) == pytest.approx(h200.apply_s(1))
    latency = h200.apply_s(1)
    assert h100.apply_s(1024) == pytest.approx(latency + (h200.apply_s(1024) - latency) * 4.8 / 3.35)
    assert h100.copy_s(1024) == pytest.approx(h200.copy_s(1024))  # same PCIe generation
    a100 = MaskCost.for_gpu("a100", 151936)
    latency = h200.copy_s(1)
    assert a100.copy_s(1024) == pytest.approx(latency + 2 * (h200.copy_s(1024) - latency))  # PCIe Gen4 vs Gen5


def test_measured_table_is_preferred(tmp_path, monkeypatch) -> None:
    from cdbench.harness.costs import mask

    table = MaskCostTable(
        gpu="NVIDIA H100 80GB HBM3", source="test", kernel="mine",
        apply=[KernelTiming(kernel="mine", vocab=1000, batch=b, dtype="bf16", density="sparse", us=b)
               for b in (1, 1000)],
        copy_h2d=[CopyTiming(bytes=10, pinned=True, us=1.0), CopyTiming(bytes=10, pinned=False, us=2.0)],
    )
    table.save(tmp_path / "h100_measured.json")
    monkeypatch.setattr(mask, "TABLE_DIR", tmp_path)
    cost = MaskCost.for_gpu("h100-sxm", 1000)
    assert not cost.scaled and "measured on NVIDIA H100" in cost.provenance
    assert cost.kernel == "mine"  # the table has no xgr-triton rows: its own default
    assert cost.apply_s(10) == pytest.approx(10e-6)
    (tmp_path / "h100_measured.json").write_text("{broken")
    with pytest.raises(ValueError, match="h100_measured.json"):
        MaskCost.for_gpu("h100-sxm", 1000)


def test_shipped_measured_tables_default_to_the_engines_kernel() -> None:
    for gpu in ("h100", "h200", "a100"):
        assert MaskCost.for_gpu(gpu, 151936).kernel == "xgr-triton"


def test_missing_kernel_is_a_clear_error(reference: MaskCostTable) -> None:
    with pytest.raises(KeyError, match="no 'warp-drive' rows.*xgr-cuda"):
        MaskCost(reference, 151936, kernel="warp-drive")
