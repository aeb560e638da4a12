"""The registry of published results: its schema, and loading it with one-line errors.

An entry's arms are run configurations: ``config`` is the part both share (a
:class:`~cdbench.harness.config.RunConfig` mapping) and ``arms.base`` /
``arms.treatment`` are dotted overrides of it (``scheduler.overlap: true``),
as ``cdbench run --set`` takes them. ``${registry_folder}`` in a string value
is the registry file's folder (for model spec files kept beside it).

>>> reg = load_registry()
>>> entry = reg.entry("vllm-24300")
>>> entry.published.metric, round(entry.published.effect, 3)
('request_throughput', 0.315)
"""

from __future__ import annotations

import datetime
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    ValidationError,
    field_validator,
    model_validator,
)

from cdbench.results.config_files import ConfigError, read_yaml_mapping

#: summary.json fields an entry may compare (throughputs and latencies of the serving benchmark)
METRICS = ("request_throughput", "output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms",
           "median_ttft_ms", "mean_itl_ms", "mean_e2el_ms")


class RegistryError(ConfigError):
    """A registry that cannot be used; one line naming the entry, the field and the reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Source(_Strict):
    """Where the result was published."""

    kind: Literal["pull_request", "issue", "blog", "readme"]
    url: HttpUrl
    title: str = Field(min_length=1)
    date: str = Field(pattern=r"^\d{4}-\d{2}(-\d{2})?$", description="YYYY-MM or YYYY-MM-DD")

    @field_validator("date", mode="before")
    @classmethod
    def _iso(cls, value: Any) -> Any:
        return value.isoformat() if isinstance(value, datetime.date) else value  # YAML reads 2025-09-05 as a date


class Setup(_Strict):
    """What the source states about the setup (``None``: not stated)."""

    engine: Literal["vllm", "sglang", "llguidance"]
    version: str = Field(min_length=1, description="engine version, commit or era as the source gives it")
    model: str | None = None
    gpu: str | None = None
    workload: str = Field(min_length=1)
    load: str = Field(min_length=1)
    change: str = Field(min_length=1, description="what differs between the two arms")


class Published(_Strict):
    """The published numbers: ``metric`` of the base and treatment arms, in ``unit``."""

    metric: Literal[METRICS]  # type: ignore[valid-type]
    base: float = Field(gt=0)
    treatment: float = Field(gt=0)
    unit: str = Field(min_length=1)
    note: str | None = None

    @property
    def effect(self) -> float:
        """Relative change of the metric from base to treatment."""
        return self.treatment / self.base - 1.0


class Arms(_Strict):
    base: dict[str, Any] = Field(default_factory=dict)
    treatment: dict[str, Any] = Field(default_factory=dict)


class Entry(_Strict):
    """One public A/B comparison and its cdbench mirror."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")
    title: str = Field(min_length=1)
    source: Source
    setup: Setup
    published: Published
    unstated: list[str] = Field(default_factory=list, description="what the source leaves unstated")
    assumed: list[str] = Field(default_factory=list, description="what the mirror assumes for the unstated")
    reproducible: bool = Field(description="False: the source leaves unstated what the effect hangs on")
    lacks: str | None = Field(None, description="the mechanism cdbench lacks that this result depends on, if known")
    config: dict[str, Any]
    arms: Arms
    small_requests: int = Field(40, ge=1, description="workload.num_requests at --scale small")

    @model_validator(mode="after")
    def _check(self) -> Entry:
        if not self.reproducible and not self.unstated:
            raise ValueError("an entry marked not reproducible names what its source leaves unstated (unstated)")
        if self.config.get("mode", "model") != "model":
            raise ValueError("the arms run in model mode (deterministic): leave config.mode out or set it to model")
        return self


class Registry(_Strict):
    """The registry file: the verdict's tolerances and the entries."""

    rel_tolerance: float = Field(0.3, gt=0, description="reproduced: same sign and |predicted/published - 1| within this")
    null_tolerance: float = Field(0.05, gt=0, description="a published 'no change' (|effect| under 1 %) is "
                                  "reproduced when |predicted effect| is within this")
    entries: list[Entry] = Field(min_length=1)
    folder: Path = Field(Path("."), exclude=True)

    @model_validator(mode="after")
    def _unique(self) -> Registry:
        seen: set[str] = set()
        for e in self.entries:
            if e.id in seen:
                raise ValueError(f"entry id {e.id!r} appears twice")
            seen.add(e.id)
        return self

    def entry(self, entry_id: str) -> Entry:
        for e in self.entries:
            if e.id == entry_id:
                return e
        raise RegistryError(f"no registry entry {entry_id!r}; known: {', '.join(e.id for e in self.entries)}")


def builtin_registry_path() -> Path:
    """The registry shipped with cdbench."""
    return Path(str(resources.files("cdbench.published") / "registry.yaml"))


def _where(err: ValidationError, data: dict[str, Any]) -> str:
    first = err.errors()[0]
    loc = list(first["loc"])
    label = ""
    if len(loc) >= 2 and loc[0] == "entries" and isinstance(loc[1], int):
        entries = data.get("entries") or []
        eid = entries[loc[1]].get("id") if loc[1] < len(entries) and isinstance(entries[loc[1]], dict) else None
        label = f"entry {eid!r}" if eid else f"entry #{loc[1] + 1}"
        loc = loc[2:]
    field = ".".join(str(p) for p in loc)
    where = ", ".join(p for p in (label, f"field {field!r}" if field else "") if p)
    return f"{where}: {first['msg']}" if where else first["msg"]


def parse_registry(data: dict[str, Any], folder: Path = Path(".")) -> Registry:
    """Validate a registry mapping; a mistake is a :class:`RegistryError` naming the entry and field."""
    try:
        return Registry.model_validate({**data, "folder": folder})
    except ValidationError as err:
        raise RegistryError(f"registry: {_where(err, data)}") from None


def load_registry(path: str | Path | None = None) -> Registry:
    """Read and validate a registry file (default: the shipped one)."""
    path = Path(path) if path is not None else builtin_registry_path()
    try:
        data = read_yaml_mapping(path, "registry file")
    except ConfigError as err:
        raise RegistryError(str(err)) from None
    try:
        return parse_registry(data, path.parent.resolve())
    except RegistryError as err:
        raise RegistryError(f"{path}: {err}") from None
