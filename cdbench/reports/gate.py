"""Regression gate: compare a run's summary with a stored baseline.

Every metric has a direction (:class:`Direction`), inferred from its name:
latencies, waits, aborts and rollbacks should go down; throughputs, goodput,
hit rates and validity should go up. A change in the bad direction larger than
the metric's tolerance (in percent of the baseline) is a regression. Metrics
with no known direction are reported but never fail the gate.

Examples
--------
>>> baseline = Baseline(metrics={"mean_ttft_ms": 100.0, "request_throughput": 10.0})
>>> result = evaluate_gate({"mean_ttft_ms": 103.0, "request_throughput": 10.0}, baseline,
...                        tolerances={"mean_ttft_ms": 5.0})
>>> result.passed
True
>>> evaluate_gate({"mean_ttft_ms": 120.0, "request_throughput": 10.0}, baseline).passed
False
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cdbench._files import read_user_text


class Direction(str, Enum):
    """Which way a metric should move."""

    LOWER_IS_BETTER = "lower"
    HIGHER_IS_BETTER = "higher"
    INFORMATIONAL = "info"


class Verdict(str, Enum):
    """The outcome for one metric."""

    OK = "ok"
    IMPROVED = "improved"
    REGRESSED = "regressed"
    MISSING = "missing"  # in the baseline, not in the run: treated as a regression
    NEW = "new"  # in the run, not in the baseline: reported only
    INFO = "info"  # no direction: reported only


# Checked in order; the first pattern that matches a metric name decides.
# Rates of bad things (abort_rate, rollback_rate) are matched before the
# generic "_rate" of good things (cache_hit_rate, validity_rate).
_DIRECTION_RULES: tuple[tuple[re.Pattern[str], Direction], ...] = tuple(
    (re.compile(pattern), direction)
    for pattern, direction in [
        (r"(abort|timeout|fail|error|invalid|rollback|rolled_back|skew|wait|exposed|skipped|bad_|duplicate)",
         Direction.LOWER_IS_BETTER),
        (r"(throughput|goodput|hit_rate|validity|valid_rate|hidden|completed|jump_forward)", Direction.HIGHER_IS_BETTER),
        (r"(_ms|_s|_us|ttft|tpot|itl|e2el|latency|duration|share|compile)$", Direction.LOWER_IS_BETTER),
        (r"(ttft|tpot|itl|e2el|latency|compile_time|mask_time)", Direction.LOWER_IS_BETTER),
    ]
)


def metric_direction(name: str) -> Direction:
    """The direction of metric ``name``, inferred from its name.

    >>> metric_direction("p99_tpot_ms").value, metric_direction("output_throughput").value
    ('lower', 'higher')
    >>> metric_direction("num_prompts").value
    'info'
    """
    lowered = name.lower()
    for pattern, direction in _DIRECTION_RULES:
        if pattern.search(lowered):
            return direction
    return Direction.INFORMATIONAL


class GateError(ValueError):
    """A baseline file or tolerance that cannot be used."""


SUMMARY_FILE = "summary.json"
"""The file of a run folder that holds its metrics (see :mod:`cdbench.results.run_folder`)."""


def is_run_summary(path: Path) -> bool:
    """Whether ``path`` names a run rather than a baseline file: a folder, or a file named ``summary.json``."""
    return Path(path).is_dir() or Path(path).name == SUMMARY_FILE


class Baseline(BaseModel):
    """A stored reference: metric values plus per-metric tolerances.

    Parameters
    ----------
    metrics : metric name → baseline value (the numeric fields of a ``summary.json``).
    tolerances_pct : metric name → allowed change in the bad direction, in percent.
    default_tolerance_pct : the tolerance of metrics not listed in ``tolerances_pct``.
    source : free text saying which run and config produced the baseline.
    """

    model_config = ConfigDict(extra="forbid")

    metrics: dict[str, float]
    tolerances_pct: dict[str, float] = Field(default_factory=dict)
    default_tolerance_pct: float = 1.0
    source: str = ""

    @classmethod
    def load(cls, path: Path) -> Baseline:
        """Read a baseline: a baseline JSON file, or a run folder (or its ``summary.json``), whose numeric
        metrics become the baseline with the default tolerance. A missing or malformed one raises
        :class:`GateError`."""
        path = Path(path)
        if is_run_summary(path):
            return cls.of_run(path)
        text = read_user_text(path, "baseline file", "JSON", GateError)
        try:
            return cls.model_validate_json(text)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "(top level)"
            raise GateError(f"baseline file {path}: {where}: {first['msg']}") from None

    @classmethod
    def of_run(cls, path: Path) -> Baseline:
        """The baseline of a saved run: ``path`` is its folder or its ``summary.json``."""
        summary_path = Path(path) / SUMMARY_FILE if Path(path).is_dir() else Path(path)
        if Path(path).is_dir() and not summary_path.is_file():
            raise GateError(f"baseline {path} is a folder but not a cdbench run folder (no {SUMMARY_FILE})")
        text = read_user_text(summary_path, "baseline run summary", "JSON", GateError)
        try:
            summary = json.loads(text)
        except json.JSONDecodeError as err:
            raise GateError(f"baseline run summary {summary_path} is not valid JSON: {err}") from None
        if not isinstance(summary, dict):
            raise GateError(f"baseline run summary {summary_path} must hold a mapping of metrics")
        return cls(metrics=numeric_metrics(summary), source=f"run {path}")

    def save(self, path: Path) -> None:
        """Write the baseline as JSON; a path that cannot be written raises :class:`GateError`."""
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(self.model_dump(), indent=2, sort_keys=True) + "\n")
        except OSError as err:
            raise GateError(f"baseline file {path} cannot be written: {err.strerror or err}") from None


@dataclass(frozen=True, slots=True)
class MetricCheck:
    """One row of the gate table."""

    metric: str
    direction: Direction
    baseline: float | None
    current: float | None
    change_pct: float | None
    tolerance_pct: float
    verdict: Verdict


@dataclass(frozen=True, slots=True)
class GateResult:
    """Every metric's check; ``passed`` is False when any metric regressed or is missing."""

    checks: tuple[MetricCheck, ...]

    @property
    def regressions(self) -> tuple[MetricCheck, ...]:
        return tuple(c for c in self.checks if c.verdict in (Verdict.REGRESSED, Verdict.MISSING))

    @property
    def passed(self) -> bool:
        return not self.regressions


def parse_tolerances(items: list[str]) -> dict[str, float]:
    """Parse ``METRIC=PCT`` strings, as given on the command line.

    >>> parse_tolerances(["mean_ttft_ms=5", "request_throughput=2.5"])
    {'mean_ttft_ms': 5.0, 'request_throughput': 2.5}
    """
    parsed: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise GateError(f"tolerance {item!r} is not METRIC=PCT (e.g. mean_ttft_ms=5)")
        try:
            pct = float(value.rstrip("%"))
        except ValueError:
            raise GateError(f"tolerance {item!r}: {value!r} is not a number") from None
        if pct < 0 or math.isnan(pct):
            raise GateError(f"tolerance {item!r}: the percentage must be >= 0")
        parsed[name.strip()] = pct
    return parsed


def numeric_metrics(summary: Mapping[str, object]) -> dict[str, float]:
    """The finite numeric fields of a summary; nested mappings become ``outer.inner`` names.

    Booleans, strings, ``None`` and NaN are dropped.

    >>> numeric_metrics({"completed": 9, "aborts_by_reason": {"compile_error": 1}, "backend": "x"})
    {'completed': 9.0, 'aborts_by_reason.compile_error': 1.0}
    """
    out: dict[str, float] = {}
    for name, value in summary.items():
        if isinstance(value, Mapping):
            out.update({f"{name}.{k}": v for k, v in numeric_metrics(value).items()})
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def _change_pct(baseline: float, current: float) -> float:
    if baseline == current:
        return 0.0
    if baseline == 0.0:
        return math.copysign(math.inf, current)
    return (current - baseline) / abs(baseline) * 100.0


def check_tolerance_names(tolerances: Mapping[str, float], known: Collection[str], origin: str) -> None:
    """Raise :class:`GateError` when ``tolerances`` name a metric not in ``known`` (a typo would otherwise
    leave the real metric at the default tolerance without a word), suggesting the closest names.

    >>> check_tolerance_names({"p99_tft_ms": 5}, ["p99_ttft_ms", "p99_tpot_ms"], "--tolerance")
    Traceback (most recent call last):
    ...
    cdbench.reports.gate.GateError: --tolerance names a metric neither the run nor the baseline has: 'p99_tft_ms' (did you mean p99_ttft_ms, p99_tpot_ms?)
    """
    unknown = sorted(set(tolerances) - set(known))
    if not unknown:
        return
    names = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=3)
        names.append(f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    plural = "metrics" if len(unknown) > 1 else "a metric"
    raise GateError(f"{origin} names {plural} neither the run nor the baseline has: {'; '.join(names)}")


def evaluate_gate(
    current: Mapping[str, float],
    baseline: Baseline,
    tolerances: Mapping[str, float] | None = None,
) -> GateResult:
    """Check every metric of ``baseline`` (and any new one in ``current``).

    ``tolerances`` (percent) override the baseline's own per-metric tolerances. A tolerance
    (either kind) for a metric that neither has raises :class:`GateError`.
    """
    known = set(baseline.metrics) | set(current)
    check_tolerance_names(baseline.tolerances_pct, known, "the baseline's tolerances_pct")
    check_tolerance_names(tolerances or {}, known, "--tolerance")
    merged = {**baseline.tolerances_pct, **(tolerances or {})}
    checks: list[MetricCheck] = []
    for name in sorted(set(baseline.metrics) | set(current)):
        direction = metric_direction(name)
        tol = merged.get(name, baseline.default_tolerance_pct)
        base = baseline.metrics.get(name)
        cur = current.get(name)
        if base is None:
            checks.append(MetricCheck(name, direction, None, cur, None, tol, Verdict.NEW))
            continue
        if cur is None:
            checks.append(MetricCheck(name, direction, base, None, None, tol, Verdict.MISSING))
            continue
        change = _change_pct(base, cur)
        if direction is Direction.INFORMATIONAL:
            verdict = Verdict.INFO
        else:
            worse = change if direction is Direction.LOWER_IS_BETTER else -change
            if worse > tol:
                verdict = Verdict.REGRESSED
            elif worse < -tol:
                verdict = Verdict.IMPROVED
            else:
                verdict = Verdict.OK
        checks.append(MetricCheck(name, direction, base, cur, change, tol, verdict))
    return GateResult(tuple(checks))
