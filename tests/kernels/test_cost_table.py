"""MaskCostTable: writer/reader round trip, interpolation of apply_us and copy_us, the shipped GPU tables."""

from __future__ import annotations

import math

import pytest

from cdbench.kernels.bench import BenchEnv, CopyResult, KernelResult
from cdbench.kernels.bench_report import build_cost_table
from cdbench.kernels.cost_table import (
    CopyTiming,
    KernelTiming,
    MaskCostTable,
    table_files,
)


def _result(variant, batch, us, timing="event", vocab=1000, dtype="bf16", density="sparse", kind="apply"):
    return KernelResult(vocab=vocab, batch=batch, dtype=dtype, density=density, variant=variant, kind=kind,
                        timing=timing, median_us=us, q20_us=us, q80_us=us, floor_us=1.0, exact=True)


ENV = BenchEnv(device="cuda", gpu="Test GPU", copy_gbs=1000.0, versions={"torch": "x"}, command="cdbench kernels",
               date="2026-01-01 00:00 UTC", seed=0)


def test_build_save_load_round_trip(tmp_path):
    results = [
        _result("cdbench", 1, 9.0), _result("cdbench", 1, 2.0, timing="graph"),
        _result("cdbench", 64, 20.0), _result("xgr-cuda", 64, 25.0),
        _result("cdbench-argmax", 64, 5.0, kind="argmax"),  # not an apply kernel: left out
        _result("cdbench", 256, None),  # failed measurement: left out
    ]
    copies = [CopyResult(4096, True, 10.0, 9.0, 11.0), CopyResult(4096, False, 20.0, 19.0, 21.0)]
    table = build_cost_table(results, copies, ENV, "testgpu")
    path = tmp_path / "testgpu.json"
    table.save(path)
    loaded = MaskCostTable.load(path)
    assert loaded == table
    zipped = tmp_path / "testgpu.json.gz"  # a name ending .gz is written gzipped and read back the same
    table.save(zipped)
    assert zipped.read_bytes()[:2] == b"\x1f\x8b" and MaskCostTable.load(zipped) == table
    assert table_files(tmp_path) == {"testgpu": zipped}  # one name: the gzipped file wins
    assert loaded.kernel == "cdbench" and loaded.gpu == "testgpu"
    by_key = {(r.kernel, r.batch): r.us for r in loaded.apply}
    assert by_key == {("cdbench", 1): 2.0, ("cdbench", 64): 20.0, ("xgr-cuda", 64): 25.0}  # graph time wins
    assert "graph replay per call where measured (B <= 1)" in loaded.source
    assert {(c.bytes, c.pinned, c.us) for c in loaded.copy_h2d} == {(4096, True, 10.0), (4096, False, 20.0)}


def _table() -> MaskCostTable:
    apply = [KernelTiming(kernel="cdbench", vocab=1000, batch=b, dtype="bf16", density="sparse", us=us)
             for b, us in ((1, 2.0), (64, 20.0), (1024, 200.0))]
    apply.append(KernelTiming(kernel="xgr-cuda", vocab=1000, batch=64, dtype="bf16", density="sparse", us=99.0))
    copies = [CopyTiming(bytes=1000, pinned=True, us=10.0), CopyTiming(bytes=100000, pinned=True, us=100.0),
              CopyTiming(bytes=1000, pinned=False, us=30.0)]
    return MaskCostTable(gpu="t", source="test", kernel="cdbench", apply=apply, copy_h2d=copies)


def test_apply_us_interpolates_log_log_and_scales_with_vocab():
    table = _table()
    assert table.apply_us(0, 1000) == 0.0
    assert table.apply_us(64, 1000) == pytest.approx(20.0)
    assert table.apply_us(1, 1000) == pytest.approx(2.0)
    assert table.apply_us(8, 1000) == pytest.approx(math.exp(math.log(2) + 0.5 * math.log(10)))  # halfway in log B
    assert table.apply_us(2048, 1000) == pytest.approx(400.0)  # proportional past the last point
    assert table.apply_us(64, 2000) == pytest.approx(40.0)  # linear in vocabulary
    with pytest.raises(KeyError, match="fp32/sparse"):
        table.apply_us(64, 1000, dtype="fp32")


def test_copy_us_interpolates_and_separates_pinned_from_pageable():
    table = _table()
    assert table.copy_us(0) == 0.0
    assert table.copy_us(10000) == pytest.approx(math.sqrt(10.0 * 100.0))
    assert table.copy_us(500) == pytest.approx(10.0)  # flat below the smallest payload
    assert table.copy_us(1000, pinned=False) == pytest.approx(30.0)


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_shipped_table_is_measured_and_complete(gpu):
    table = MaskCostTable.builtin(gpu)
    assert table.kernel == "cdbench" and gpu.upper() in table.source
    kernels = {r.kernel for r in table.apply}
    assert {"cdbench", "xgr-triton", "xgr-cuda", "naive", "copy"} <= kernels
    for dtype in ("fp32", "bf16"):
        for density in ("sparse", "dense"):
            assert {r.batch for r in table.apply if r.kernel == "cdbench" and r.dtype == dtype
                    and r.density == density} == {1, 8, 64, 256, 1024}
    assert {c.pinned for c in table.copy_h2d} == {True, False}
    # Pinned copies are faster than pageable ones at every measured size.
    pinned = {c.bytes: c.us for c in table.copy_h2d if c.pinned}
    pageable = {c.bytes: c.us for c in table.copy_h2d if not c.pinned}
    assert all(pinned[b] < pageable[b] for b in pinned)
