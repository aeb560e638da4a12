"""Token-length distributions (prompt, output, thinking).

>>> import numpy as np
>>> LogNormalLengths(median=200, sigma=0.5).sample(3, np.random.default_rng(0)).tolist()
[213, 187, 275]
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Lengths(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FixedLengths(_Lengths):
    """Every request gets ``value`` tokens."""

    dist: Literal["fixed"] = "fixed"
    value: int = Field(ge=0)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


class UniformLengths(_Lengths):
    """Integers drawn uniformly from ``[low, high]``."""

    dist: Literal["uniform"] = "uniform"
    low: int = Field(ge=0)
    high: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> UniformLengths:
        if self.high < self.low:
            raise ValueError(f"uniform lengths need low <= high, got {self.low} > {self.high}")
        return self

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n)


class LogNormalLengths(_Lengths):
    """``median * exp(sigma * N(0, 1))``, rounded, clipped to ``[min, max]``."""

    dist: Literal["lognormal"] = "lognormal"
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)
    min: int = Field(default=1, ge=0)
    max: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> LogNormalLengths:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"lognormal lengths need min <= max, got min {self.min} > max {self.max}")
        return self

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        values = np.rint(self.median * np.exp(self.sigma * rng.standard_normal(n))).astype(np.int64)
        return np.clip(values, self.min, self.max if self.max is not None else None)


class TraceLengths(_Lengths):
    """Lengths taken from a recorded list: in order (cycling), or sampled with replacement."""

    dist: Literal["trace"] = "trace"
    values: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    shuffle: bool = False

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        values = np.asarray(self.values, dtype=np.int64)
        if self.shuffle:
            return rng.choice(values, size=n, replace=True)
        return np.resize(values, n)


LengthDist = Annotated[FixedLengths | UniformLengths | LogNormalLengths | TraceLengths, Field(discriminator="dist")]
