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

from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class _Arrivals(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    closed_loop: bool = False

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError


class PoissonArrivals(_Arrivals):
    """Exponential gaps at ``rate`` requests per second."""

    process: Literal["poisson"] = "poisson"
    rate: float = Field(gt=0)

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.cumsum(rng.exponential(1.0 / self.rate, size=n))


class GammaArrivals(_Arrivals):
    """Gamma gaps at ``rate`` with shape ``burstiness`` (vLLM's ``--burstiness``)."""

    process: Literal["gamma"] = "gamma"
    rate: float = Field(gt=0)
    burstiness: float = Field(gt=0)

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.cumsum(rng.gamma(self.burstiness, 1.0 / (self.rate * self.burstiness), size=n))


class ConstantArrivals(_Arrivals):
    """One request every ``1 / rate`` seconds, the first at ``1 / rate``."""

    process: Literal["constant"] = "constant"
    rate: float = Field(gt=0)

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.arange(1, n + 1, dtype=np.float64) / self.rate


class ClosedLoopArrivals(_Arrivals):
    """``max_concurrency`` clients, each sending its next request when the last finishes."""

    process: Literal["closed_loop"] = "closed_loop"
    closed_loop: bool = True
    max_concurrency: int = Field(gt=0)

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(n)


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
