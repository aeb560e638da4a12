"""How fast a host's GPU runs the forward against its calibration: ``costs.forward_speed``.

A forward calibration (:mod:`.calibration`) is fitted on one lent host; another host of the same GPU kind
runs the same steps a few per cent faster or slower. :class:`ForwardSpeed` is that factor, the measured
forward time over the calibrated price of the same step: the forward model multiplies each step's whole
price by it (1.04: this host's forwards take 4 % longer than the calibration's), decode-only steps by
``decode`` and steps with prefill chunks by ``prefill``. It is given as a number, or fitted
(:func:`fit_speed`) from per-step ratios:

- a live run's steps (``live-run:<ref>``, fitted by :mod:`cdbench.results.live_forward_speed`): every
  step that ran a forward, its measured ``forward_s`` over the model's price of its shape; a decode-only
  step priced padded to the policy's CUDA-graph size, as model mode prices it; a step with prefill chunks
  priced with the prompts the requests table says it admitted, each a whole chunk with nothing cached (a
  step whose admitted prompts do not add up to its prefill tokens, a chunked or recomputed prompt, is left
  out and counted);
- a probe (``probe:<file>``, written by ``cdbench calibrate --probe``): some of the calibration's own
  shapes timed on this host as the calibration timed them, each over the time the calibration's host
  measured (:class:`ForwardProbe`).

The statistic is the median of the ratios, its spread the half-width of their interquartile range. The
two kinds of step get a speed each when their medians differ by more than the larger of their spreads;
otherwise both take the median over all steps (so a difference within the steps' own scatter does not
split them). Given each prefill step's tokens, the steps with prefill chunks are also binned by tokens
(bins :data:`PREFILL_BIN_FACTOR` times wide, at least :data:`MIN_PREFILL_BIN` steps each): when the bins'
medians range wider than the largest bin's spread (the calibration prices prompts of some sizes off by
more than a step's own scatter), ``prefill_by_tokens`` holds ``(tokens, speed)`` points and a step with
prefill chunks runs at the speed interpolated at its prefill tokens (in log tokens, flat beyond the
points) instead of ``prefill``.

>>> ForwardSpeed.given(1.04).describe()
'1.04 (given)'
>>> fit_speed([1.05] * 12, [0.98] * 3, "live-run:x").describe()
'decode 1.05, prefill 0.98, fitted from live-run:x: 12 decode steps (spread ±0.0%), 3 with prefill (spread ±0.0%)'
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cdbench._files import read_probe_file
from cdbench.harness.costs.calibration import ForwardCalibration, ForwardMeasurement

PROBE_PREFIX = "probe:"
MIN_STEPS = 10
"""Fewest priced steps a fit of a live run takes: fewer say nothing about a host's speed."""
MIN_PROBE_SHAPES = 4
"""Fewest shapes a probe fits (each the median of many timed repetitions)."""
PREFILL_BIN_FACTOR = 2.0
"""Width of a bin of prefill steps by tokens (its last token count over its first)."""
MIN_PREFILL_BIN = 20
"""Fewest steps with prefill chunks a bin of ``prefill_by_tokens`` takes."""
RUN_SPEED_SIGMA = 0.0045
"""The forward speed's spread from one run to the next on one host (a lognormal sigma): the decode speeds
fitted from 15 pairs of live copies made back to back (TP=2, DP=2, MoE, hybrid, MTP on H200s; log ratio's
standard deviation 0.0064 a pair), reports/fidelity/live_vs_model.md, "A run's forward speed drawn"."""


class ForwardSpeedError(ValueError):
    """A forward speed that cannot be fitted or read (the message names the source and the reason)."""


class ForwardSpeed(BaseModel):
    """Measured over calibrated forward time, by kind of step, and where it came from.

    ``source`` is ``given``, ``live-run:<ref>`` or ``probe:<file>``; the counts and spreads are those
    of the fit (0 and None for a given number).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    decode: float = Field(gt=0, description="decode-only steps' measured / calibrated forward")
    prefill: float = Field(gt=0, description="steps with prefill chunks' measured / calibrated forward")
    source: str = Field("given", description="given, live-run:<ref> or probe:<file>")
    decode_steps: int = Field(0, ge=0, description="decode-only steps fitted")
    prefill_steps: int = Field(0, ge=0, description="steps with prefill chunks fitted")
    left_out_steps: int = Field(0, ge=0, description="steps with prefill chunks whose shape is unknown")
    decode_spread: float | None = Field(None, ge=0, description="half the decode ratios' interquartile range")
    prefill_spread: float | None = Field(None, ge=0, description="half the prefill ratios' interquartile range")
    prefill_by_tokens: tuple[tuple[float, float], ...] | None = Field(
        None, description="(prefill tokens, speed) points a step with prefill chunks takes its speed from, in "
        "place of prefill (interpolated in log tokens, flat beyond)")

    def prefill_at(self, tokens):
        """The speed of steps with prefill chunks of ``tokens`` prefill tokens (a number or an array).

        >>> ForwardSpeed(decode=1.0, prefill=1.0, prefill_by_tokens=((256, 1.06), (1024, 0.96))).prefill_at(
        ...     [128, 512, 4096]).round(3).tolist()
        [1.06, 1.01, 0.96]
        """
        if not self.prefill_by_tokens:
            return np.full(np.shape(tokens), self.prefill)
        points = np.asarray(self.prefill_by_tokens, np.float64)
        return np.interp(np.log(np.maximum(np.asarray(tokens, np.float64), 1.0)), np.log(points[:, 0]), points[:, 1])

    @classmethod
    def given(cls, value: float) -> ForwardSpeed:
        return cls(decode=value, prefill=value)

    def scaled(self, factor: float, note: str) -> ForwardSpeed:
        """This speed times ``factor`` on every kind of step, ``note`` added to its source.

        >>> ForwardSpeed.given(1.02).scaled(1.01, "x1.01 drawn").describe()
        '1.03 (given, x1.01 drawn)'
        """
        points = None if not self.prefill_by_tokens else tuple((t, r * factor) for t, r in self.prefill_by_tokens)
        return self.model_copy(update={"decode": self.decode * factor, "prefill": self.prefill * factor,
                                       "prefill_by_tokens": points, "source": f"{self.source}, {note}"})

    @property
    def is_one(self) -> bool:
        return self.decode == 1.0 and self.prefill == 1.0

    def describe(self) -> str:
        """One line: the speed and its origin."""
        speed = (f"{self.decode:.4g}" if self.decode == self.prefill
                 else f"decode {self.decode:.4g}, prefill {self.prefill:.4g}")
        if self.source.startswith("given"):
            return f"{speed} ({self.source})"
        counts = f"{self.decode_steps} decode steps (spread {_pct(self.decode_spread)})"
        if self.prefill_steps:
            counts += f", {self.prefill_steps} with prefill (spread {_pct(self.prefill_spread)})"
        if self.left_out_steps:
            counts += f", {self.left_out_steps} left out"
        if self.prefill_by_tokens:
            speed += ", prefill by tokens " + " ".join(f"{t:.0f}:{r:.3g}" for t, r in self.prefill_by_tokens)
        return f"{speed}, fitted from {self.source}: {counts}"


def _pct(spread: float | None) -> str:
    return "-" if spread is None else f"±{spread:.1%}"


def _median_spread(ratios: np.ndarray) -> tuple[float, float]:
    q1, median, q3 = np.percentile(ratios, [25, 50, 75])
    return float(median), float(q3 - q1) / 2.0


def prefill_by_tokens(ratios: np.ndarray, tokens: np.ndarray) -> tuple[tuple[float, float], ...] | None:
    """``(tokens, speed)`` points of steps with prefill chunks binned by their prefill tokens (module doc):
    each bin's geometric-mean tokens and median ratio; ``None`` when fewer than two bins are full or their
    medians lie within the largest bin's spread.

    >>> rng = np.random.default_rng(0)
    >>> tokens = np.exp(rng.uniform(np.log(200), np.log(3000), 400))
    >>> ratios = np.where(tokens < 512, 1.06, 0.96) * rng.normal(1.0, 0.005, 400)
    >>> [(round(t, -1), round(r, 2)) for t, r in prefill_by_tokens(ratios, tokens)]
    [(230.0, 1.06), (360.0, 1.06), (740.0, 0.96), (1490.0, 0.96), (2480.0, 0.96)]
    >>> prefill_by_tokens(rng.normal(1.0, 0.02, 400), tokens) is None
    True
    """
    bins = np.floor(np.log(tokens) / np.log(PREFILL_BIN_FACTOR)).astype(np.int64)
    points, spreads = [], []
    for b in np.unique(bins):
        inside = bins == b
        if inside.sum() >= MIN_PREFILL_BIN:
            median, spread = _median_spread(ratios[inside])
            points.append((float(f"{np.exp(np.log(tokens[inside]).mean()):.4g}"), float(f"{median:.4g}")))
            spreads.append(spread)
    if len(points) < 2:
        return None
    medians = [r for _, r in points]
    return tuple(points) if max(medians) - min(medians) > max(spreads) else None


def fit_speed(decode_ratios: Sequence[float], prefill_ratios: Sequence[float], source: str,
              left_out: int = 0, min_ratios: int = MIN_STEPS,
              prefill_tokens: Sequence[float] | None = None) -> ForwardSpeed:
    """The speed from per-step measured / priced ratios of decode-only steps and steps with prefill chunks
    (module doc for the rule), with ``prefill_tokens`` (each prefill ratio's step's prefill tokens) a speed by
    tokens too; :class:`ForwardSpeedError` naming ``source`` when there are fewer than ``min_ratios``."""
    dec, pre = np.asarray(decode_ratios, float), np.asarray(prefill_ratios, float)
    if len(dec) + len(pre) < min_ratios:
        raise ForwardSpeedError(f"{source}: {len(dec) + len(pre)} priced forward steps; a fit needs {min_ratios}")
    counts = dict(source=source, decode_steps=len(dec), prefill_steps=len(pre), left_out_steps=left_out)
    if prefill_tokens is not None and len(pre):
        if len(prefill_tokens) != len(pre):
            raise ValueError(f"{len(prefill_tokens)} prefill token counts for {len(pre)} prefill ratios")
        counts["prefill_by_tokens"] = prefill_by_tokens(pre, np.asarray(prefill_tokens, float))
    d_med, d_spread = _median_spread(dec) if len(dec) else (None, None)
    p_med, p_spread = _median_spread(pre) if len(pre) else (None, None)
    if d_med is not None and p_med is not None and abs(d_med - p_med) > max(d_spread, p_spread):
        return ForwardSpeed(decode=d_med, prefill=p_med, decode_spread=d_spread, prefill_spread=p_spread,
                            **counts)
    both, _ = _median_spread(np.concatenate([dec, pre]))
    return ForwardSpeed(decode=both, prefill=both, decode_spread=d_spread, prefill_spread=p_spread, **counts)


def read_probe(path: str | Path, priced: tuple[str, str, int]) -> ForwardSpeed:
    """The speed a probe file (``cdbench calibrate --probe``) holds, its source naming the file;
    :class:`ForwardSpeedError` when it is no probe or probed another (model, GPU, TP) than ``priced``."""
    path = Path(path)
    probe = read_probe_file(path, ForwardProbe, f"{PROBE_PREFIX}{path}", "forward probe", ForwardSpeedError)
    probed = (probe.model, probe.gpu, probe.tp)
    if probed != priced:
        raise ForwardSpeedError(f"{PROBE_PREFIX}{path} probed {probed[0]} on {probed[1]} at tp={probed[2]}; this "
                                f"run prices {priced[0]} on {priced[1]} at tp={priced[2]}")
    return probe.speed.model_copy(update={"source": f"{PROBE_PREFIX}{path}"})


class ForwardProbe(BaseModel):
    """A probe's file: some of a calibration's own shapes timed again on a host, each against the time the
    calibration's host measured for it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str
    gpu: str
    tp: int = 1
    calibration: str = Field(description="the calibration whose measurements the shapes are timed against")
    device: str = Field(description="the device the shapes ran on")
    shapes: list[str]
    ratios: list[float] = Field(description="each shape's time here over the calibration host's")
    speed: ForwardSpeed

    @classmethod
    def of(cls, calibration: ForwardCalibration, source: str, measured: Sequence[ForwardMeasurement],
           path: str | Path) -> ForwardProbe:
        """The probe of ``measured`` (shapes of ``calibration``, named ``source``) written to ``path``: the
        ratios fitted as a live run's steps are (:func:`fit_speed`, one ratio a shape, decode-only shapes
        apart from those with prefill chunks)."""
        there = {shape.shape: shape.measured_s for shape in calibration.fit}
        missing = [m.label for m in measured if m.label not in there]
        if missing:
            raise ForwardSpeedError(f"{source} measured no {', '.join(missing)}: the probe times its shapes only")
        ratios = [m.median_s / there[m.label] for m in measured]
        decode = [r for m, r in zip(measured, ratios, strict=True) if not m.prefill_chunks]
        prefill = [r for m, r in zip(measured, ratios, strict=True) if m.prefill_chunks]
        speed = fit_speed(decode, prefill, f"{PROBE_PREFIX}{path}", min_ratios=MIN_PROBE_SHAPES)
        return cls(model=calibration.model, gpu=calibration.gpu, tp=calibration.tp, calibration=source,
                   device=measured[0].gpu_device, shapes=[m.label for m in measured], ratios=ratios, speed=speed)


__all__ = ["MIN_PREFILL_BIN", "MIN_PROBE_SHAPES", "MIN_STEPS", "PREFILL_BIN_FACTOR", "PROBE_PREFIX", "RUN_SPEED_SIGMA",
           "ForwardProbe",
           "ForwardSpeed", "ForwardSpeedError", "fit_speed", "prefill_by_tokens", "read_probe"]
