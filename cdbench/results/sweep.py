"""Sweeps: a grid over any configuration parameters, run on local processes or a Ray cluster.

A sweep file names a base configuration, optional fixed overrides, and a grid
of dotted configuration paths with the values to try. Every combination is one
*point*; each point runs into its own folder under the sweep folder, and a
point whose folder already holds a ``summary.json`` is skipped, so an
interrupted sweep resumes where it stopped.

.. code-block:: yaml

    name: rate-by-backend
    base: default                  # a built-in config name, or a YAML path relative to this file
    overrides:
      mode: model
      workload.num_requests: 200
    grid:
      workload.rate: [2, 4, 8]
      backend.name: [xgrammar, llguidance]

Examples
--------
>>> spec = SweepSpec(grid={"workload.rate": [1, 2], "backend.name": ["xgrammar", "llguidance"]})
>>> [p.name for p in expand_grid(spec)]
['rate=1,name=xgrammar', 'rate=1,name=llguidance', 'rate=2,name=xgrammar', 'rate=2,name=llguidance']
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, field_validator

from cdbench.results.config_files import (
    ConfigError,
    apply_overrides,
    builtin_config_path,
    read_yaml_mapping,
)

if TYPE_CHECKING:
    from cdbench.harness.config import RunConfig
    from cdbench.results.run_folder import Finisher


class SweepSpec(BaseModel):
    """A sweep file. See the module docstring for the YAML form."""

    model_config = ConfigDict(extra="forbid")

    name: str = "sweep"
    base: str = Field("default", description="built-in config name or path of a run-config YAML")
    overrides: dict[str, Any] = Field(default_factory=dict, description="dotted path → value, applied to every point")
    grid: dict[str, list[Any]] = Field(description="dotted path → values to try; the grid is their product")

    @field_validator("grid")
    @classmethod
    def _non_empty(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if not grid:
            raise ValueError("the grid needs at least one parameter")
        for key, values in grid.items():
            if not values:
                raise ValueError(f"grid parameter {key!r} has no values")
        return grid


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One combination of grid values."""

    index: int
    name: str  # also the point's folder name
    values: Mapping[str, Any]  # dotted path → value


@dataclass(frozen=True, slots=True)
class PointOutcome:
    """What happened to one point: ran, skipped (already done) or failed (with the one-line reason)."""

    point: SweepPoint
    folder: Path
    status: str  # "done" | "skipped" | "failed"
    error: str | None = None


def _short_key(dotted: str, all_keys: list[str]) -> str:
    leaf = dotted.rsplit(".", 1)[-1]
    clash = sum(k.rsplit(".", 1)[-1] == leaf for k in all_keys) > 1
    return dotted if clash else leaf


def folder_safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,+-]", "_", text)


def expand_grid(spec: SweepSpec) -> list[SweepPoint]:
    """Every combination of the grid, in the order the grid lists its parameters and values."""
    keys = list(spec.grid)
    points = []
    for index, combo in enumerate(itertools.product(*(spec.grid[k] for k in keys))):
        name = ",".join(f"{_short_key(k, keys)}={v}" for k, v in zip(keys, combo))
        points.append(SweepPoint(index, folder_safe(name), dict(zip(keys, combo))))
    return points


def load_sweep(path: Path) -> tuple[SweepSpec, dict[str, Any]]:
    """Read a sweep file and its base configuration (as a mapping, overrides applied)."""
    from cdbench.results.config_files import validate_config

    path = Path(path)
    spec = validate_config(SweepSpec, read_yaml_mapping(path, "sweep file"), source=f"sweep file {path}")
    return spec, apply_overrides(base_config(spec.base, path), spec.overrides)


def base_config(base: str, relative_to: Path) -> dict[str, Any]:
    """The configuration mapping a sweep or campaign file names as its ``base``: a built-in config name, or a
    YAML path (relative paths are relative to the file ``relative_to``)."""
    base_path = Path(base)
    if not base_path.suffix:
        base_path = builtin_config_path(base)
    elif not base_path.is_absolute():
        base_path = Path(relative_to).parent / base_path
    return read_yaml_mapping(base_path)


def point_config(base: Mapping[str, Any], point: SweepPoint) -> dict[str, Any]:
    """The configuration mapping of one point: ``base`` with the point's values set."""
    return apply_overrides(base, point.values)


def _why_no_effect(key: str, config: RunConfig) -> str | None:
    """Why grid parameter ``key`` cannot change this point's results (``None`` when it can)."""
    model, costs = config.mode == "model", config.costs
    if key == "backend.name" and model and costs.fixed_grammar is not None:
        return "model mode with costs.fixed_grammar: grammar costs are those constants whatever the backend"
    if key == "backend.name" and model and costs.grammar_profile is not None:
        return "model mode with costs.grammar_profile: that profile is used whatever the backend"
    if key.startswith("backend.options") and model:
        return "model mode draws grammar costs from a profile; backend options matter in hybrid mode only"
    if key.startswith("costs.grammar_profile") and not model:
        return "hybrid mode times the real backend; grammar profiles matter in model mode only"
    if key.startswith("costs.grammar_profile") and costs.fixed_grammar is not None:
        return "costs.fixed_grammar replaces the profile"
    if key.startswith("costs.fixed_grammar") and not model:
        return "hybrid mode times the real backend; costs.fixed_grammar matters in model mode only"
    return None


def ineffective_parameters(spec: SweepSpec, configs: Sequence[RunConfig]) -> list[str]:
    """One warning per grid parameter that changes nothing at any point (given how the points get their
    grammar costs), so such a sweep is not mistaken for a measured comparison."""
    warnings = []
    for key in spec.grid:
        reasons = [_why_no_effect(key, config) for config in configs]
        if configs and all(reasons):
            warnings.append(f"grid parameter {key} has no effect here ({reasons[0]}); its points differ only in name")
    return warnings


def is_finished(folder: Path) -> bool:
    """A point is finished when its folder holds a summary (written last by a run)."""
    return (folder / "summary.json").is_file()


def run_point(config_tree: dict[str, Any], folder: str, finish: Finisher | None = None) -> str | None:
    """Run one point into ``folder`` (``finish`` as in :func:`~cdbench.results.run_folder.save_run`);
    returns ``None`` on success or a one-line error.

    A module-level function so process pools and Ray can ship it by reference.
    """
    from cdbench.results.run_config import validate_run_config
    from cdbench.results.run_folder import record_run

    try:
        config = validate_run_config(config_tree, source=f"sweep point {Path(folder).name}")
        record_run(config, Path(folder), finish=finish)
        return None
    except ConfigError as err:
        return str(err)
    except Exception as err:  # a failing point must not end the sweep
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "error.log").write_text(traceback.format_exc())
        return f"{str(err) or type(err).__name__} (details in {Path(folder) / 'error.log'})"


PointRunner = Callable[[dict[str, Any], str], "str | None"]
"""Runs one point's configuration into a folder; returns ``None`` or a one-line error. Must be picklable."""


def _local_results(
    jobs: list[tuple[SweepPoint, dict[str, Any], Path]], workers: int, runner: PointRunner
) -> Iterator[tuple[SweepPoint, Path, str | None]]:
    if workers <= 1:
        for point, tree, folder in jobs:
            yield point, folder, runner(tree, str(folder))
        return
    # spawn, not fork: the parent may hold torch / grammar-engine threads that fork would copy mid-lock.
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        pending: dict[Future[str | None], tuple[SweepPoint, Path]] = {
            pool.submit(runner, tree, str(folder)): (point, folder) for point, tree, folder in jobs
        }
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                point, folder = pending.pop(future)
                try:
                    yield point, folder, future.result()
                except Exception as err:  # a worker that died (e.g. killed for memory)
                    yield point, folder, f"worker failed: {str(err) or type(err).__name__}"


def _ray_results(
    jobs: list[tuple[SweepPoint, dict[str, Any], Path]], address: str, runner: PointRunner
) -> Iterator[tuple[SweepPoint, Path, str | None]]:
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs the optional extra: pip install 'cdbench[ray]'") from None
    if not ray.is_initialized():
        if address == "local":
            # Local workers import exactly what this process can (editable checkouts, user backends).
            env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
            ray.init(runtime_env=env, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    remote = ray.remote(runner)
    refs = {remote.remote(tree, str(folder)): (point, folder) for point, tree, folder in jobs}
    while refs:
        ready, _ = ray.wait(list(refs), num_returns=1)
        point, folder = refs.pop(ready[0])
        try:
            yield point, folder, ray.get(ready[0])
        except Exception as err:  # a task that crashed its worker
            yield point, folder, f"ray task failed: {str(err) or type(err).__name__}"


def run_sweep(
    spec: SweepSpec,
    base: Mapping[str, Any],
    out_dir: Path,
    workers: int = 1,
    ray_address: str | None = None,
    on_outcome: Callable[[PointOutcome], None] | None = None,
    runner: PointRunner = run_point,
) -> list[PointOutcome]:
    """Run every unfinished point of the grid into ``out_dir/<point name>``.

    Points run on ``workers`` local processes, or on Ray when ``ray_address``
    is given (``"local"`` starts a local Ray instance; otherwise a cluster
    address such as ``"ray://head:10001"`` or ``"auto"``). A point whose folder
    already holds a summary is skipped. A failing point is recorded and the
    others still run. ``on_outcome`` is called as each point ends (progress bars).
    ``runner`` runs one point (default :func:`run_point`: simulate and save).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(spec.model_dump(mode="json"), indent=2))
    outcomes: list[PointOutcome] = []
    jobs = []
    for point in expand_grid(spec):
        folder = out_dir / point.name
        if is_finished(folder):
            outcome = PointOutcome(point, folder, "skipped")
            outcomes.append(outcome)
            if on_outcome:
                on_outcome(outcome)
        else:
            jobs.append((point, point_config(base, point), folder))
    results = _ray_results(jobs, ray_address, runner) if ray_address else _local_results(jobs, workers, runner)
    for point, folder, error in results:
        outcome = PointOutcome(point, folder, "failed" if error else "done", error)
        outcomes.append(outcome)
        if on_outcome:
            on_outcome(outcome)
    outcomes.sort(key=lambda o: o.point.index)
    return outcomes


def grid_columns(spec: SweepSpec) -> list[str]:
    """The column names of the grid parameters in :func:`sweep_table` (leaf names unless they clash)."""
    return [_short_key(k, list(spec.grid)) for k in spec.grid]


def sweep_table(spec: SweepSpec, outcomes: list[PointOutcome]) -> pd.DataFrame:
    """One row a point: its grid values, status, and the numeric summary metrics of finished points."""
    rows = []
    for outcome in outcomes:
        # Lists and mappings (e.g. workload.corpus: [a, b]) become text, so the table can group by them.
        row: dict[str, Any] = {
            _short_key(k, list(spec.grid)): v if isinstance(v, int | float | str | bool) or v is None else json.dumps(v)
            for k, v in outcome.point.values.items()
        }
        row["point"] = outcome.point.name
        row["status"] = outcome.status
        summary_path = outcome.folder / "summary.json"
        if outcome.status != "failed" and summary_path.is_file():
            summary = json.loads(summary_path.read_text())
            row.update({k: v for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)})
        else:
            row["error"] = outcome.error
        rows.append(row)
    return pd.DataFrame(rows)
