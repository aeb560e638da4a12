"""GPU-side costs of a constrained step: apply the bitmask, copy it to the GPU, sample.

Apply and copy times come from a measured :class:`~cdbench.kernels.cost_table.MaskCostTable`
(interpolated log-log in rows, linear in vocabulary size). Sampling has no
table yet and uses a simple bandwidth model (see :meth:`MaskCost.sample_s`).

:meth:`MaskCost.for_gpu` picks the table: a measured table for that GPU when
one ships in ``cdbench/kernels/cost_tables/``, otherwise the H200 reference
table scaled by the ratio of HBM bandwidths (apply) and of PCIe bandwidths
(copy). Only the part above the one-row time is scaled: small batches are
bound by launch latency, which does not follow bandwidth, large ones by bytes.
(Checked against the first H100 sweep's table, ``reports/kernels/h100-run1`` at 660c660, 1 to 1024
rows: within 10 % for a device copy, 13 % for xgrammar's CUDA kernel, 26 %
for its Triton kernel; the host-to-device copy of that host was up to 25 %
slower than the estimate.) The choice is recorded in
:attr:`MaskCost.provenance` so reports can state it.

Examples
--------
>>> cost = MaskCost.for_gpu("h200", vocab_size=151936)
>>> round(cost.apply_s(1024) * 1e6)   # µs, xgrammar's default Triton kernel, bf16 (measured H200 table)
515
>>> cost.copy_s(0)
0.0
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cdbench.harness.costs.hardware import GPUSpec, normalize_name, resolve_gpu
from cdbench.kernels.cost_table import TABLE_DIR, Density, Dtype, MaskCostTable, table_files

REFERENCE_TABLE = TABLE_DIR / "h200_reference.json.gz"
REFERENCE_GPU = "h200"
# xgrammar's apply_token_bitmask_inplace on CUDA picks its Triton kernel; SGLang
# runs an equivalent Triton kernel and vLLM's V1 runner calls xgrammar's.
DEFAULT_KERNEL = "xgr-triton"
SAMPLE_LAUNCH_S = 10e-6  # a few small kernel launches (softmax, sampling) per step
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_INITIAL_ROWS = 1024


def bitmask_bytes(rows: int, vocab_size: int) -> int:
    """Bytes of an int32 bitmask of ``rows`` rows over ``vocab_size`` tokens."""
    return rows * ((vocab_size + 31) // 32) * 4


class MaskCost:
    """Per-step GPU time of the mask and the sampler, as a function of the number of rows.

    Methods take an int or a numpy integer array of row counts and return
    seconds (a float or an array). Values are tabulated once per row count, so
    calls cost an array lookup.

    Parameters
    ----------
    table : measured apply and copy times.
    vocab_size : logits row width.
    dtype, density : which apply rows of the table to use (logits dtype; mask
        density, ``sparse`` ≈ a few % allowed, typical of grammar masks).
    kernel : apply implementation in the table; default ``table.kernel``.
    gpu : the GPU whose HBM bandwidth prices sampling; default the table's GPU.
    apply_scale, copy_scale : multiply the table's apply / copy times above
        their one-row (latency) value; used when a table measured on another
        GPU stands in.
    provenance : how the numbers were obtained, for reports.
    """

    def __init__(
        self,
        table: MaskCostTable,
        vocab_size: int,
        dtype: Dtype = "bf16",
        density: Density = "sparse",
        kernel: str | None = None,
        gpu: str | GPUSpec | None = None,
        apply_scale: float = 1.0,
        copy_scale: float = 1.0,
        provenance: str | None = None,
    ) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        kernel = kernel or table.kernel
        rows = [r for r in table.apply if r.kernel == kernel and r.dtype == dtype and r.density == density]
        if not rows:
            kernels = sorted({r.kernel for r in table.apply})
            raise KeyError(f"mask cost table {table.gpu!r} has no {kernel!r} rows for {dtype}/{density}; "
                           f"kernels: {', '.join(kernels)}")
        # A table holding only the rows in use keeps each interpolation cheap.
        self.table = table.model_copy(update={"kernel": kernel, "apply": rows})
        self.vocab_size, self.dtype, self.density, self.kernel = vocab_size, dtype, density, kernel
        self.gpu = resolve_gpu(gpu or table.gpu)
        self.apply_scale, self.copy_scale = apply_scale, copy_scale
        self.provenance = provenance or f"{table.gpu}: {table.source}"
        row_bytes = vocab_size * (3 * _DTYPE_BYTES[dtype] + 4)  # see sample_s
        self._sample_s_per_row = row_bytes / (self.gpu.hbm_bandwidth_Bps * self.gpu.memory_efficiency)
        self._apply = self._copy_pinned = self._copy_pageable = np.zeros(0)
        self._grow(_INITIAL_ROWS)

    @classmethod
    def for_gpu(
        cls,
        gpu: str | GPUSpec,
        vocab_size: int,
        dtype: Dtype = "bf16",
        density: Density = "sparse",
        kernel: str | None = None,
    ) -> MaskCost:
        """The mask cost on ``gpu``: its own measured table, else the H200 reference scaled.

        ``kernel`` defaults to :data:`DEFAULT_KERNEL` (what SGLang and vLLM run
        today) when the table has it, else to the table's own default.
        """
        spec = resolve_gpu(gpu)
        measured = find_measured_table(spec)
        if measured is not None:
            path, table = measured
            return cls(table, vocab_size, dtype, density, kernel or _default_kernel(table), spec,
                       provenance=f"measured on {table.gpu} ({path.name}): {table.source}")
        table = MaskCostTable.load(REFERENCE_TABLE)
        kernel = kernel or _default_kernel(table)
        ref = resolve_gpu(REFERENCE_GPU)
        if spec.name == ref.name:
            return cls(table, vocab_size, dtype, density, kernel, spec,
                       provenance=f"H200 reference table ({REFERENCE_TABLE.name})")
        apply_scale = ref.hbm_bandwidth_Bps / spec.hbm_bandwidth_Bps
        copy_scale = ref.pcie_bandwidth_Bps / spec.pcie_bandwidth_Bps
        note = (f"estimated: no table measured on {spec.name}; H200 reference table ({REFERENCE_TABLE.name}) "
                f"scaled x{apply_scale:.2f} (HBM bandwidth ratio) for apply and x{copy_scale:.2f} "
                f"(PCIe bandwidth ratio) for the host-to-device copy")
        return cls(table, vocab_size, dtype, density, kernel, spec, apply_scale, copy_scale, note)

    @property
    def scaled(self) -> bool:
        """True when the numbers are another GPU's, scaled by bandwidth ratios."""
        return self.apply_scale != 1.0 or self.copy_scale != 1.0

    def _grow(self, rows: int) -> None:
        n = max(rows + 1, 2 * len(self._apply))
        counts = range(len(self._apply), n)
        nbytes = [bitmask_bytes(r, self.vocab_size) for r in counts]
        v, dt, de = self.vocab_size, self.dtype, self.density
        one_row = bitmask_bytes(1, v)
        new_apply = _scale_above([self.table.apply_us(r, v, dt, de) for r in counts],
                                 self.table.apply_us(1, v, dt, de), self.apply_scale)
        new_pinned = _scale_above([self.table.copy_us(b, pinned=True) for b in nbytes],
                                  self.table.copy_us(one_row, pinned=True), self.copy_scale)
        new_pageable = _scale_above([self.table.copy_us(b, pinned=False) for b in nbytes],
                                    self.table.copy_us(one_row, pinned=False), self.copy_scale)
        # Small-size measurements are noisy (launch and VM effects); more rows never cost less.
        self._apply = np.maximum.accumulate(np.concatenate([self._apply, 1e-6 * new_apply]))
        self._copy_pinned = np.maximum.accumulate(np.concatenate([self._copy_pinned, 1e-6 * new_pinned]))
        self._copy_pageable = np.maximum.accumulate(np.concatenate([self._copy_pageable, 1e-6 * new_pageable]))

    def _lookup(self, lut_name: str, rows):
        scalar = np.ndim(rows) == 0
        top = int(rows) if scalar else int(np.max(rows, initial=0))
        bottom = top if scalar else int(np.min(rows, initial=0))
        if bottom < 0:
            raise ValueError(f"rows must be >= 0, got {bottom}")
        if top >= len(self._apply):
            self._grow(top)
        lut = getattr(self, lut_name)
        return float(lut[rows]) if scalar else lut[rows]

    def apply_s(self, rows):
        """Seconds to apply the bitmask to ``rows`` logits rows (0 for 0 rows)."""
        return self._lookup("_apply", rows)

    def copy_s(self, rows, pinned: bool = True):
        """Seconds to copy a ``rows``-row bitmask host to device (``rows·ceil(V/32)·4`` bytes)."""
        return self._lookup("_copy_pinned" if pinned else "_copy_pageable", rows)

    def sample_s(self, rows):
        """Seconds to sample ``rows`` rows: a fixed launch plus bytes at achievable HBM bandwidth.

        A softmax sampler passes over each logits row about three times (max,
        sum of exponentials, draw) and writes fp32 probabilities once, so a row
        moves ``V·(3·elem + 4)`` bytes. This is a floor-like model, not a
        measurement; top-k/top-p sorting would cost more.
        """
        rows_arr = np.asarray(rows)
        if np.any(rows_arr < 0):
            raise ValueError(f"rows must be >= 0, got {rows}")
        cost = np.where(rows_arr > 0, SAMPLE_LAUNCH_S + self._sample_s_per_row * rows_arr, 0.0)
        return cost if np.ndim(rows) else float(cost)


def _default_kernel(table: MaskCostTable) -> str:
    return DEFAULT_KERNEL if any(r.kernel == DEFAULT_KERNEL for r in table.apply) else table.kernel


def _scale_above(us: list[float], latency_us: float, scale: float) -> np.ndarray:
    """Scale times above the one-row latency by ``scale``; 0 (no rows) stays 0."""
    arr = np.asarray(us, dtype=np.float64)
    return np.where(arr > 0, latency_us + (arr - latency_us) * scale, 0.0)


def find_measured_table(gpu: GPUSpec) -> tuple[Path, MaskCostTable] | None:
    """A shipped table measured on ``gpu`` (matched by file stem or its ``gpu`` field), if any.

    The H200 reference table is never returned here. A table file that does not
    load raises an error naming it.
    """
    names = {gpu.name, *gpu.aliases}
    family = gpu.name.split("-")[0]  # "h100" matches "nvidia-h100-80gb-hbm3"
    for name, path in table_files(TABLE_DIR).items():
        if path == REFERENCE_TABLE:
            continue
        try:
            table = MaskCostTable.load(path)
        except ValueError as exc:
            raise ValueError(f"mask cost table {path} does not load: {exc}") from exc
        for label in (normalize_name(name), normalize_name(table.gpu)):
            if label in names or family in label.split("-"):
                return path, table
    return None
