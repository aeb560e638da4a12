"""Run a registry entry's two arms in ``model`` mode and judge cdbench's effect against the published one.

>>> verdict(0.315, 0.30, reproducible=True)
'reproduced'
>>> verdict(0.315, 0.10, reproducible=True), verdict(0.315, -0.3, reproducible=True)
('missed', 'missed')
>>> verdict(0.0, 0.03, reproducible=True), verdict(0.315, 0.30, reproducible=False)
('reproduced', 'not reproducible')
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from fnmatch import fnmatchcase
from typing import Any, Literal

from pydantic import ValidationError

from cdbench.published.registry import Entry, Registry, RegistryError
from cdbench.results.config_files import apply_overrides

Scale = Literal["full", "small"]
Verdict = Literal["reproduced", "missed", "not reproducible"]

NULL_EFFECT = 0.01
"""A published effect smaller than this (1 %) is a claim of no change."""


def verdict(published: float, predicted: float, reproducible: bool, rel_tolerance: float = 0.3,
            null_tolerance: float = 0.05) -> Verdict:
    """``reproduced``: same sign and size within ``rel_tolerance`` of the published effect (a
    published no-change: ``|predicted|`` within ``null_tolerance``); ``missed`` otherwise;
    ``not reproducible`` where the source leaves unstated what the effect hangs on."""
    if not reproducible:
        return "not reproducible"
    if abs(published) < NULL_EFFECT:
        return "reproduced" if abs(predicted) <= null_tolerance else "missed"
    same_sign = math.copysign(1.0, published) == math.copysign(1.0, predicted)
    return "reproduced" if same_sign and abs(predicted / published - 1.0) <= rel_tolerance else "missed"


def _substitute(value: Any, variables: dict[str, str]) -> Any:
    if isinstance(value, str):
        for name, text in variables.items():
            value = value.replace("${" + name + "}", text)
        return value
    if isinstance(value, dict):
        return {k: _substitute(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, variables) for v in value]
    return value


def arm_config(registry: Registry, entry: Entry, arm: Literal["base", "treatment"], scale: Scale = "full",
               extra: Mapping[str, Any] | None = None):
    """The :class:`~cdbench.harness.config.RunConfig` of one arm of ``entry`` (``small``: at most
    ``entry.small_requests`` requests), with ``extra`` dotted overrides set over the arm's (a sweep's). A
    configuration that does not validate is a :class:`RegistryError` naming the entry, the arm and the key."""
    from cdbench.harness.config import RunConfig

    overrides = getattr(entry.arms, arm)
    tree = apply_overrides({"mode": "model", **entry.config}, overrides)
    if extra:
        tree = apply_overrides(tree, extra)
    tree = _substitute(tree, {"registry_folder": str(registry.folder)})
    if scale == "small":
        workload = tree.setdefault("workload", {})
        workload["num_requests"] = min(int(workload.get("num_requests") or entry.small_requests),
                                       entry.small_requests)
    try:
        return RunConfig.model_validate(tree)
    except (ValidationError, ValueError) as err:
        if isinstance(err, ValidationError):
            first = err.errors()[0]
            why = f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
        else:
            why = str(err)
        raise RegistryError(f"entry {entry.id!r}, arm {arm}: {why}") from None


@dataclass(frozen=True)
class EntryResult:
    """One entry's published effect beside cdbench's, and the verdict."""

    id: str
    engine: str
    metric: str
    published_base: float
    published_treatment: float
    published_effect: float
    predicted_base: float
    predicted_treatment: float
    predicted_effect: float
    verdict: Verdict
    reason: str
    requests: int

    @property
    def ratio(self) -> float | None:
        """cdbench's effect over the published one (``None`` for a published no-change)."""
        return None if abs(self.published_effect) < NULL_EFFECT else self.predicted_effect / self.published_effect

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


def _reason(entry: Entry, judged: Verdict) -> str:
    if judged == "reproduced":
        return ""
    if judged == "not reproducible":
        return "unstated: " + "; ".join(entry.unstated) + (f". cdbench lacks: {entry.lacks}" if entry.lacks else "")
    return entry.lacks or "no mechanism named yet"


def run_entry(registry: Registry, entry: Entry, scale: Scale = "full", extra: Mapping[str, Any] | None = None,
              runs: dict[str, Any] | None = None) -> EntryResult:
    """Run both arms of ``entry`` (with ``extra`` overrides: :func:`arm_config`) and compare their effect on its
    metric with the published one. ``runs``: summaries by configuration, shared between calls, so that an arm
    configured as one already run is not run again (model mode's virtual time makes it the same run)."""
    from cdbench.harness.run import run

    metric = entry.published.metric
    values = []
    requests = 0
    for arm in ("base", "treatment"):
        config = arm_config(registry, entry, arm, scale, extra)
        requests = config.workload.num_requests or 0
        key = config.model_dump_json()
        summary = runs.get(key) if runs is not None else None
        if summary is None:
            summary = run(config).summary
            if runs is not None:
                runs[key] = summary
        values.append(float(getattr(summary, metric)))
    predicted = values[1] / values[0] - 1.0 if values[0] else math.nan
    published = entry.published.effect
    judged = verdict(published, predicted, entry.reproducible, registry.rel_tolerance, registry.null_tolerance)
    return EntryResult(entry.id, entry.setup.engine, metric, entry.published.base, entry.published.treatment,
                       published, values[0], values[1], predicted, judged, _reason(entry, judged), requests)


def run_registry(registry: Registry, entry_ids: list[str] | None = None, scale: Scale = "full",
                 progress: Callable[[str], None] | None = None,
                 done: Callable[[], None] | None = None) -> list[EntryResult]:
    """Run the entries named (default: all), in registry order; ``progress`` is called with each
    entry's id before it runs, ``done`` after."""
    entries = [registry.entry(i) for i in entry_ids] if entry_ids else list(registry.entries)
    results = []
    for entry in entries:
        if progress is not None:
            progress(entry.id)
        results.append(run_entry(registry, entry, scale))
        if done is not None:
            done()
    return results


@dataclass(frozen=True)
class SweepPoint:
    """The entries' results with the swept key set to ``value``."""

    value: Any
    results: list[EntryResult]

    @property
    def reproduced(self) -> int:
        """How many of the entries are reproduced at this value."""
        return sum(r.verdict == "reproduced" for r in self.results)


def match_entries(registry: Registry, patterns: Sequence[str]) -> list[Entry]:
    """The entries whose id matches any of ``patterns`` (an id, or a shell pattern such as ``vllm-26866-*``), in
    registry order; a pattern that matches none is a :class:`RegistryError`."""
    for pattern in patterns:
        if not any(fnmatchcase(e.id, pattern) for e in registry.entries):
            registry.entry(pattern)  # (raises, listing the known ids)
    return [e for e in registry.entries if any(fnmatchcase(e.id, p) for p in patterns)]


def sweep_registry(registry: Registry, patterns: Sequence[str], key: str, values: Sequence[Any],
                   fixed: Mapping[str, Any] | None = None, scale: Scale = "full",
                   progress: Callable[[str], None] | None = None) -> list[SweepPoint]:
    """Every entry matching ``patterns`` (:func:`match_entries`) run with the dotted ``key`` set to each of
    ``values`` in both arms, over the arms' own overrides and ``fixed`` ones: a sensitivity sweep over one input
    the sources leave unstated. ``progress`` is called with each value (as text) before its runs."""
    entries = match_entries(registry, patterns)
    runs: dict[str, Any] = {}
    points = []
    for value in values:
        if progress is not None:
            progress(str(value))
        extra = {**(fixed or {}), key: value}
        points.append(SweepPoint(value, [run_entry(registry, e, scale, extra, runs) for e in entries]))
    return points
