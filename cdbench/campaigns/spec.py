"""The campaign file: arms, cells, copies, seeds, comparisons and where the runs go (docs/campaigns.md).

Read with :func:`load_campaign`, which checks everything that can be checked before a run starts (field
types, arm and variable names in references, reference cycles, comparison arms) and reports the first
mistake in one line naming the field.

>>> spec = CampaignSpec.model_validate({"name": "t", "arms": {"a": {"mode": "model"}, "b": {"mode": "model"}},
...                                     "comparisons": [{"name": "b-vs-a", "reference": "a", "runs": ["b"]}]})
>>> spec.arms["a"].copies, spec.comparisons[0].tolerances()["median_ttft_ms"]
(1, 5.0)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cdbench.reports.fidelity import ACCEPTANCE_TOLERANCES, FIDELITY_METRICS
from cdbench.reports.gate import GateError, check_tolerance_names
from cdbench.results.config_files import read_yaml_mapping, validate_config

REFERENCE = re.compile(r"\$\{([A-Za-z_][\w-]*)(?:@([a-z]))?(?:\.([\w.]+))?\}")
"""``${name}`` (a cell variable, ``seed``, or ``copy``: the run's copy number 1, 2, ...) or ``${arm.field}`` of
that arm's first copy in the same cell and seed (``${arm@b.field}``: its copy b): ``folder``, ``live.<path>`` (a
value of its ``live.json``) or a ``summary.json`` key (a dotted path descends into a mapping)."""

NAME = r"^[A-Za-z0-9][\w.-]*$"

BARS: dict[str, dict[str, float]] = {
    "acceptance": ACCEPTANCE_TOLERANCES,
    # a shipped profile measured elsewhere is held to a looser bar (reports/fidelity/model_vs_hybrid.md)
    "shipped": {"median_ttft_ms": 15.0, "median_tpot_ms": 15.0, "request_throughput": 15.0,
                "p99_ttft_ms": 25.0, "p99_tpot_ms": 25.0, "p99_itl_ms": 25.0},
}
"""Named bars (percent |relative error| per metric) a comparison may use."""

DEFAULT_LAYOUT = "{cell}/seed{seed}/{arm}-{copy}"


class Arm(BaseModel):
    """One kind of run: the campaign's base config with the arm's overrides, in one mode."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["model", "hybrid", "live"]
    set: dict[str, Any] = Field(default_factory=dict, description="dotted config path -> value; strings may hold "
                                "${...} references, and a string starting with '=' is arithmetic")
    copies: int = Field(1, ge=1, le=26, description="same-config, same-seed runs (the noise floor); a model "
                        "arm's copies differ only where its set uses ${copy} (its own draws: seed: '=${seed}+${copy}-1')")
    seed_offset: int = Field(0, description="this arm's workload seed is the campaign seed plus this")
    over: list[str] | None = Field(None, description="the cell axes this arm varies with (default: all); an arm "
                                   "over fewer axes runs once for all the cells that share them")
    only: dict[str, list[Any]] = Field(default_factory=dict, description="axis -> values: the arm runs only in "
                                       "the cells whose value of each named axis is one of these")
    cores: int | None = Field(None, ge=1, description="cores each run gets (default: the runner's cores_per_run)")
    lane: str | None = Field(None, description="runs of one lane go one at a time (e.g. the one GPU)")
    layout: str | None = Field(None, description="this arm's runs' folders (default: the campaign's layout)")
    later_copies_after: list[str] = Field(
        default_factory=list, description="arms whose runs of the same cell and seed this arm's copies after the "
        "first wait for (whatever their outcome), so that the copies' spread, the noise floor, spans the time "
        "those runs measured in: a host's speed drifts over minutes, which back-to-back copies understate")


class Comparison(BaseModel):
    """Runs judged against a reference run of the same cell and seed, beside a noise floor (cdbench fidelity)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME)
    reference: str = Field(description="the arm whose first copy is the reference")
    runs: list[str] = Field(min_length=1, description="arms judged: an arm's one copy, or the median of its copies' "
                            "figures (their range reported beside it)")
    noise: str | None = Field(None, description="the arm whose copies give the noise floor (first copy first)")
    bar: str | dict[str, float] = Field("acceptance", description="a named bar (acceptance, shipped) or metric -> %")
    title: str = ""

    @field_validator("bar")
    @classmethod
    def _bar(cls, bar: str | dict[str, float]) -> str | dict[str, float]:
        if isinstance(bar, str) and bar not in BARS:
            raise ValueError(f"{bar!r} is not a named bar ({', '.join(BARS)}); give one or a mapping metric: percent")
        if isinstance(bar, dict):
            try:
                check_tolerance_names(bar, FIDELITY_METRICS, "bar")
            except GateError as err:
                raise ValueError(str(err)) from None
        return bar

    def tolerances(self) -> dict[str, float]:
        return dict(BARS[self.bar]) if isinstance(self.bar, str) else dict(self.bar)


class Runner(BaseModel):
    """Where runs go: local processes (on this machine, or on a GPU host by running the campaign there)."""

    model_config = ConfigDict(extra="forbid")

    jobs: int = Field(1, ge=1, description="runs at a time")
    pin: bool = Field(False, description="pin each run to cores of its own (os.sched_setaffinity)")
    first_core: int = Field(0, ge=0, description="with pin: the first core runs may use")
    cores_per_run: int = Field(1, ge=1, description="with pin: cores each run gets unless its arm says")
    threads: int | None = Field(1, ge=1, description="OMP / MKL / Rayon threads per run (None: leave unset)")


class CampaignSpec(BaseModel):
    """A campaign file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME)
    description: str = ""
    base: str = Field("default", description="built-in config name or a run-config YAML relative to the file")
    set: dict[str, Any] = Field(default_factory=dict, description="overrides for every run")
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    cells: dict[str, list[Any]] | list[dict[str, Any]] = Field(
        default_factory=dict, description="axis -> values (their product), or a list of cells; an axis with a "
                                          "dot is a config path, one without is a variable for ${...}")
    arms: dict[str, Arm] = Field(min_length=1)
    comparisons: list[Comparison] = Field(default_factory=list)
    runner: Runner = Field(default_factory=Runner)
    layout: str = Field(DEFAULT_LAYOUT, description="a run's folder under the campaign folder: {cell}, {seed}, "
                        "{arm}, {copy} (1, 2, ...), {copy_letter} (a, b, ...), {copy_suffix} ('' for a one-copy arm, "
                        "else -a, -b, ...) and each axis by its short name")

    @field_validator("arms")
    @classmethod
    def _arm_names(cls, arms: dict[str, Arm]) -> dict[str, Arm]:
        for name in arms:
            if not re.match(NAME, name):
                raise ValueError(f"arm name {name!r} must be letters, digits, '.', '_' or '-'")
        return arms

    @field_validator("cells")
    @classmethod
    def _cells(cls, cells: dict[str, list[Any]] | list[dict[str, Any]]) -> dict[str, list[Any]] | list[dict[str, Any]]:
        if isinstance(cells, dict):
            for axis, values in cells.items():
                if not values:
                    raise ValueError(f"axis {axis!r} has no values")
        elif cells and any(set(cell) != set(cells[0]) for cell in cells):
            raise ValueError("every cell of the list must name the same axes")
        return cells

    @property
    def axes(self) -> list[str]:
        if isinstance(self.cells, dict):
            return list(self.cells)
        return list(self.cells[0]) if self.cells else []

    @model_validator(mode="after")
    def _references(self) -> CampaignSpec:
        axes = self.axes
        variables = {axis for axis in axes if "." not in axis} | {"seed", "copy", "campaign_folder"}
        for name, arm in self.arms.items():
            for axis in [*(arm.over or []), *arm.only]:
                if axis not in axes:
                    raise ValueError(f"arm {name}: over or only names {axis!r}, which is not a cell axis "
                                     f"({', '.join(axes)})")
            for key, value in arm.set.items():
                for ref, copy, field in references(value):
                    if field is None and copy > 1:
                        raise ValueError(f"arm {name}: set.{key} names a copy of ${{{ref}}}; only an arm's runs "
                                         "have copies (${arm@b.folder})")
                    if field is None and ref not in variables:
                        raise ValueError(f"arm {name}: set.{key} uses ${{{ref}}}, which is neither a cell variable "
                                         f"nor seed or copy (variables: {', '.join(sorted(variables))})")
                    if field is not None and ref not in self.arms:
                        raise ValueError(f"arm {name}: set.{key} refers to arm {ref!r}, which is not an arm")
                    if field is not None and copy > self.arms[ref].copies:
                        raise ValueError(f"arm {name}: set.{key} refers to copy {chr(ord('a') + copy - 1)} of arm "
                                         f"{ref}, which has {self.arms[ref].copies}")
                    if field is not None and not set(self.arms[ref].over or axes) <= set(arm.over or axes):
                        raise ValueError(f"arm {name}: set.{key} refers to arm {ref}, which varies with axes {name} "
                                         "does not; give it the same `over`")
        for name, arm in self.arms.items():
            for after in arm.later_copies_after:
                if after not in self.arms or after == name:
                    raise ValueError(f"arm {name}: later_copies_after names {after!r}, which is not another arm")
                if arm.copies < 2:
                    raise ValueError(f"arm {name}: later_copies_after needs copies >= 2 (copies after the first)")
                if not set(self.arms[after].over or axes) <= set(arm.over or axes):
                    raise ValueError(f"arm {name}: later_copies_after names {after}, which varies with axes "
                                     f"{name} does not; give it the same `over`")
        for cycle_start in self.arms:
            _check_cycle(self, cycle_start, [])
        checked: set[tuple[str, int]] = set()
        for name, arm in self.arms.items():
            for copy in range(1, arm.copies + 1):
                _check_run_cycle(self, (name, copy), [], checked)
        for comparison in self.comparisons:
            for arm in (comparison.reference, *comparison.runs, *([comparison.noise] if comparison.noise else [])):
                if arm not in self.arms:
                    raise ValueError(f"comparison {comparison.name}: {arm!r} is not an arm")
            if comparison.noise and self.arms[comparison.noise].copies < 2:
                raise ValueError(f"comparison {comparison.name}: noise arm {comparison.noise} needs copies >= 2 "
                                 "(the floor is a spread between same-seed runs)")
        names = [c.name for c in self.comparisons]
        if len(set(names)) != len(names):
            raise ValueError("comparison names must be unique")
        for where, layout in [("layout", self.layout),
                              *((f"arms.{n}.layout", a.layout) for n, a in self.arms.items() if a.layout)]:
            if (where == "layout" and "{arm}" not in layout) or not any(
                    c in layout for c in ("{copy}", "{copy_letter}", "{copy_suffix}")):
                raise ValueError(f"{where} must hold {'{arm} and ' if where == 'layout' else ''}one of {{copy}}, "
                                 "{copy_letter}, {copy_suffix}, so that every run gets a folder of its own")
        return self

    def runs_in(self, arm: str, cell: Mapping[str, Any]) -> bool:
        """Whether ``arm`` runs in the cell with these axis values (its ``only``)."""
        return all(cell.get(axis) in values for axis, values in self.arms[arm].only.items())

    def arm_dependencies(self, arm: str) -> list[str]:
        """The arms whose runs ``arm``'s overrides refer to."""
        return sorted({ref for ref, _ in self.run_dependencies(arm)})

    def run_dependencies(self, arm: str) -> list[tuple[str, int]]:
        """The (arm, copy) runs ``arm``'s overrides refer to (copy 1 unless a reference names another)."""
        return sorted({(ref, copy) for value in self.arms[arm].set.values() for ref, copy, field in references(value)
                       if field is not None})

    def run_waits(self, arm: str, copy: int) -> list[tuple[str, int]]:
        """The (arm, copy) runs that copy ``copy`` of ``arm`` waits for without needing them (its
        ``later_copies_after``, for copies after the first)."""
        if copy < 2:
            return []
        return [(after, c) for after in self.arms[arm].later_copies_after
                for c in range(1, self.arms[after].copies + 1)]


def references(value: Any) -> list[tuple[str, int, str | None]]:
    """The ``${...}`` references in a value: (name, copy (1 unless ``@b``... names another), field or None)."""
    if not isinstance(value, str):
        return []
    return [reference_parts(m) for m in REFERENCE.finditer(value)]


def reference_parts(match: re.Match[str]) -> tuple[str, int, str | None]:
    """One :data:`REFERENCE` match as (name, copy number, field or None)."""
    return match.group(1), ord(match.group(2)) - ord("a") + 1 if match.group(2) else 1, match.group(3)


def _check_cycle(spec: CampaignSpec, arm: str, path: list[str]) -> None:
    if arm in path:
        raise ValueError(f"arms refer to each other in a cycle: {' -> '.join([*path, arm])}")
    for dep in spec.arm_dependencies(arm):
        _check_cycle(spec, dep, [*path, arm])


def _check_run_cycle(spec: CampaignSpec, run: tuple[str, int], path: list[tuple[str, int]],
                     checked: set[tuple[str, int]]) -> None:
    """Runs that wait for each other (references and ``later_copies_after`` together) in a cycle; ``checked``:
    the runs already known to start no cycle (each run is walked from once)."""
    if run in path:
        raise ValueError("runs wait for each other in a cycle: "
                         + " -> ".join(f"{a}@{chr(ord('a') + c - 1)}" for a, c in [*path, run]))
    if run in checked:
        return
    for before in [*spec.run_dependencies(run[0]), *spec.run_waits(*run)]:
        _check_run_cycle(spec, before, [*path, run], checked)
    checked.add(run)


def load_campaign(path: Path) -> CampaignSpec:
    """Read and check a campaign file; a :class:`ConfigError` of one line naming the bad field otherwise."""
    path = Path(path)
    return validate_config(CampaignSpec, read_yaml_mapping(path, "campaign file"), source=f"campaign file {path}")
