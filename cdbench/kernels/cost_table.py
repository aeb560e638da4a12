"""Measured GPU times of the mask kernels and the bitmask copy, as the cost model reads them.

A table is a JSON file (see :class:`MaskCostTable`); ``cdbench kernels`` writes
one from a GPU run, and the scheduler's cost model interpolates in it:
log-log in batch size, linear in vocabulary size (the kernels are
bandwidth-bound, so time scales with bytes), and linear in bytes for copies.

Built-in tables live in ``cdbench/kernels/cost_tables/<gpu>.json``.
"""

from __future__ import annotations

import bisect
import gzip
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TABLE_DIR = Path(__file__).with_name("cost_tables")
TABLE_SUFFIXES = (".json", ".json.gz")
"""A cost table file is JSON, gzipped or not (the shipped ones are: they are mostly repeated keys); where a
folder holds both for one name, the gzipped one is read."""


def table_files(folder: Path) -> dict[str, Path]:
    """The cost table files in ``folder`` by name (the file name without its suffix), sorted by name."""
    found = {path.name.removesuffix(suffix): path for suffix in TABLE_SUFFIXES for path in folder.glob(f"*{suffix}")}
    return dict(sorted(found.items()))

Dtype = Literal["fp32", "bf16", "fp16"]
Density = Literal["sparse", "dense"]


class KernelTiming(BaseModel):
    """Median GPU time of one apply-kernel configuration."""

    model_config = ConfigDict(extra="forbid")
    kernel: str = Field(description="which implementation, e.g. 'cdbench', 'xgr-cuda'")
    vocab: int
    batch: int
    dtype: Dtype
    density: Density
    us: float


class CopyTiming(BaseModel):
    """Host-to-device bitmask copy time for a payload size."""

    model_config = ConfigDict(extra="forbid")
    bytes: int
    pinned: bool
    us: float


class MaskCostTable(BaseModel):
    """Apply-kernel and copy times measured on one GPU.

    ``kernel`` names the implementation whose rows :meth:`apply_us` uses.
    """

    model_config = ConfigDict(extra="forbid")
    format_version: Literal[1] = 1
    gpu: str
    source: str = Field(description="how the numbers were obtained (command, date, versions)")
    kernel: str
    apply: list[KernelTiming]
    copy_h2d: list[CopyTiming]

    @classmethod
    def load(cls, path: str | Path) -> MaskCostTable:
        data = Path(path).read_bytes()
        return cls.model_validate_json(gzip.decompress(data) if Path(path).suffix == ".gz" else data)

    @classmethod
    def builtin(cls, gpu: str) -> MaskCostTable:
        """The shipped table for ``gpu`` (its file name under ``cost_tables/``)."""
        shipped = table_files(TABLE_DIR)
        if gpu not in shipped:
            raise FileNotFoundError(f"no mask cost table for GPU {gpu!r}; known: {', '.join(shipped)}")
        return cls.load(shipped[gpu])

    def save(self, path: str | Path) -> None:
        """Write the table as JSON at ``path``, gzipped when its name ends in ``.gz``."""
        path, text = Path(path), (self.model_dump_json(indent=1) + "\n").encode("utf-8")
        path.write_bytes(gzip.compress(text, mtime=0) if path.suffix == ".gz" else text)

    def apply_us(self, batch: int, vocab: int, dtype: Dtype = "bf16", density: Density = "sparse") -> float:
        """Time to apply a mask to ``batch`` rows of ``vocab`` logits, in µs (0 for batch 0)."""
        if batch <= 0:
            return 0.0
        rows = [r for r in self.apply if r.kernel == self.kernel and r.dtype == dtype and r.density == density]
        if not rows:
            raise KeyError(f"table {self.gpu!r} has no {self.kernel} rows for {dtype}/{density}")
        vocabs = sorted({r.vocab for r in rows})
        nearest = min(vocabs, key=lambda v: abs(v - vocab))
        points = sorted((r.batch, r.us) for r in rows if r.vocab == nearest)
        return _loglog(points, batch) * vocab / nearest

    def copy_us(self, nbytes: int, pinned: bool = True) -> float:
        """Host-to-device copy time of ``nbytes``, in µs (0 for nothing to copy)."""
        if nbytes <= 0:
            return 0.0
        points = sorted((r.bytes, r.us) for r in self.copy_h2d if r.pinned == pinned)
        if not points:
            raise KeyError(f"table {self.gpu!r} has no {'pinned' if pinned else 'pageable'} copy rows")
        return _loglog(points, nbytes)


def _loglog(points: list[tuple[int, float]], x: float) -> float:
    """Piecewise log-log interpolation; flat below the first point, proportional above the last."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1] * x / xs[-1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
