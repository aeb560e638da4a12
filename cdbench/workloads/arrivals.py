"""Arrival processes: when each request reaches the scheduler.

>>> import numpy as np
>>> PoissonArrivals(rate=2.0).times(3, np.random.default_rng(0)).round(3).tolist()
[0.34, 0.85, 0.86]

Gamma arrivals follow vLLM's serving benchmark: inter-arrival gaps are
Gamma(shape = burstiness, scale = 1 / (rate * burstiness)); burstiness 1 is
Poisson, lower is burstier. Closed-loop arrivals are decided by the scheduler:
every request arrives at 0 and at most ``max_concurrency`` run at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class _Arrivals(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    closed_loop: bool = False

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def chunks(self, n: int, rng: np.random.Generator, size: int) -> Iterator[np.ndarray]:
        """:meth:`times` of ``n`` requests in consecutive pieces of ``size`` (the last shorter), value for value."""
        times = self.times(n, rng)
        for start in range(0, n, size):
            yield times[start:start + size]


class _GapArrivals(_Arrivals):
    """Arrivals as the running sum of random gaps, drawn a chunk at a time."""

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.cumsum(self.gaps(n, rng))

    def chunks(self, n: int, rng: np.random.Generator, size: int) -> Iterator[np.ndarray]:
        last = np.zeros(1)
        for start in range(0, n, size):
            # the running sum carried on from the last time, added in the same order as one cumsum of all
            times = np.cumsum(np.concatenate((last, self.gaps(min(size, n - start), rng))))[1:]
            if len(times):
                last = times[-1:]
            yield times


class PoissonArrivals(_GapArrivals):
    """Exponential gaps at ``rate`` requests per second."""

    process: Literal["poisson"] = "poisson"
    rate: float = Field(gt=0)

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.exponential(1.0 / self.rate, size=n)


class GammaArrivals(_GapArrivals):
    """Gamma gaps at ``rate`` with shape ``burstiness`` (vLLM's ``--burstiness``)."""

    process: Literal["gamma"] = "gamma"
    rate: float = Field(gt=0)
    burstiness: float = Field(gt=0)

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.gamma(self.burstiness, 1.0 / (self.rate * self.burstiness), size=n)


class ConstantArrivals(_Arrivals):
    """One request every ``1 / rate`` seconds, the first at ``1 / rate``."""

    process: Literal["constant"] = "constant"
    rate: float = Field(gt=0)

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.arange(1, n + 1, dtype=np.float64) / self.rate

    def chunks(self, n: int, rng: np.random.Generator, size: int) -> Iterator[np.ndarray]:
        for start in range(0, n, size):
            yield np.arange(start + 1, min(start + size, n) + 1, dtype=np.float64) / self.rate


class ClosedLoopArrivals(_Arrivals):
    """``max_concurrency`` clients, each sending its next request when the last finishes."""

    process: Literal["closed_loop"] = "closed_loop"
    closed_loop: bool = True
    max_concurrency: int = Field(gt=0)

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(n)

    def chunks(self, n: int, rng: np.random.Generator, size: int) -> Iterator[np.ndarray]:
        for start in range(0, n, size):
            yield np.zeros(min(size, n - start))


class ReplayArrivals(_Arrivals):
    """Recorded arrival times (seconds, finite, >= 0), sorted; requests beyond the list are an error."""

    process: Literal["replay"] = "replay"
    timestamps: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(min_length=1)

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if n > len(self.timestamps):
            raise ValueError(f"replay has {len(self.timestamps)} timestamps for {n} requests")
        return np.sort(np.asarray(self.timestamps[:n], dtype=np.float64))


ArrivalProcess = Annotated[
    PoissonArrivals | GammaArrivals | ConstantArrivals | ClosedLoopArrivals | ReplayArrivals,
    Field(discriminator="process"),
]
