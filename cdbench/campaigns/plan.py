"""A campaign's runs: every (cell, seed, arm, copy), its folder, what it waits for, and its configuration.

A run's configuration is the campaign's base config, then the campaign's ``set``, the cell's config axes, the
seed (``seed`` and ``workload.seed``: the campaign seed plus the arm's ``seed_offset``), the arm's mode, and
the arm's ``set``. Strings in the two ``set`` mappings may refer to cell variables and to other arms' runs
(``${load}``, ``${hybrid.folder}``, ``${capacity.request_throughput}``); a string that starts with ``=`` is
then evaluated as arithmetic (``+ - * / **``, ``round``, ``min``, ``max`` and ``round_sig(x, digits)``).

>>> evaluate("= 0.5 * 24.517831139113227", "rate")
12.258915569556613
>>> evaluate("= round_sig(0.5 * 24.517831139113227, 4)", "rate")
12.26
"""

from __future__ import annotations

import ast
import itertools
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdbench.campaigns.spec import REFERENCE, CampaignSpec, reference_parts
from cdbench.results.config_files import ConfigError, apply_overrides
from cdbench.results.run_folder import LIVE_FILE
from cdbench.results.sweep import folder_safe


@dataclass(frozen=True, slots=True)
class Cell:
    """One combination of the campaign's axes (only an arm's ``over`` axes, for that arm)."""

    values: tuple[tuple[str, Any], ...]

    @property
    def name(self) -> str:
        keys = [k for k, _ in self.values]
        return folder_safe(",".join(f"{axis_label(k, keys)}={_text(v)}" for k, v in self.values)) or "all"

    def only(self, axes: list[str] | None) -> Cell:
        return self if axes is None else Cell(tuple((k, v) for k, v in self.values if k in axes))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)


def _text(value: Any) -> str:
    """A cell value as a folder name shows it (booleans as YAML writes them, a list's items joined by +)."""
    if isinstance(value, list):
        return "+".join(_text(item) for item in value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def axis_label(axis: str, axes: list[str]) -> str:
    """An axis's short name: its last part (``policy`` for ``policy.name``), or all of it where that is ambiguous.

    >>> axis_label("policy.name", ["backend.name", "policy.name", "load"])
    'policy'
    """
    parts = axis.split(".")
    leaf = parts[-2] if len(parts) > 1 and parts[-1] == "name" else parts[-1]
    return leaf if sum(axis_label(a, []) == leaf for a in axes if a != axis) == 0 else axis


@dataclass(frozen=True, slots=True)
class PlannedRun:
    """One run of the campaign. ``run_id`` is its folder relative to the campaign folder (and its id in a pack)."""

    run_id: str
    arm: str
    copy: int
    seed: int  # the campaign seed (the run's workload seed adds the arm's seed_offset)
    cell: Cell  # projected onto the arm's axes
    depends: tuple[str, ...]  # run ids this run's configuration refers to
    waits_for: tuple[str, ...] = ()  # run ids that must have ended first, whatever their outcome


def cells(spec: CampaignSpec) -> list[Cell]:
    """Every cell, in the file's order (the product of the axes, or the listed cells)."""
    if isinstance(spec.cells, list):  # an entry's list values are its own axes' values (their product)
        out = []
        for entry in spec.cells:
            axes = list(entry)
            values = [v if isinstance(v, list) else [v] for v in entry.values()]
            out += [Cell(tuple(zip(axes, combo))) for combo in itertools.product(*values)]
        return out or [Cell(())]
    axes = list(spec.cells)
    return [Cell(tuple(zip(axes, combo))) for combo in itertools.product(*(spec.cells[a] for a in axes))]


def run_id(spec: CampaignSpec, arm: str, cell: Cell, seed: int, copy: int = 1) -> str:
    """The folder of one run under the campaign folder (the arm's or else the campaign's ``layout``)."""
    projected = cell.only(spec.arms[arm].over)
    fields = {axis_label(k, spec.axes): folder_safe(_text(v)) for k, v in cell.values}
    try:
        return (spec.arms[arm].layout or spec.layout).format(cell=projected.name, seed=seed, arm=arm, copy=copy,
                                  copy_letter=chr(ord("a") + copy - 1),
                                  copy_suffix=f"-{chr(ord('a') + copy - 1)}" if spec.arms[arm].copies > 1 else "",
                                  **fields)
    except (KeyError, IndexError, ValueError) as err:
        raise ConfigError(f"campaign {spec.name}: layout {spec.layout!r} cannot be filled: {err}") from None


def plan_runs(spec: CampaignSpec) -> list[PlannedRun]:
    """Every run, cell by cell (so that a cell's chain of runs finishes before the next cell's starts)."""
    runs: dict[str, PlannedRun] = {}
    for cell, seed in itertools.product(cells(spec), spec.seeds):
        for arm_name in _arm_order(spec):
            arm = spec.arms[arm_name]
            if not spec.runs_in(arm_name, cell.as_dict()):
                continue
            depends = tuple(run_id(spec, dep, cell, seed, copy) for dep, copy in spec.run_dependencies(arm_name))
            for copy in range(1, arm.copies + 1):
                rid = run_id(spec, arm_name, cell, seed, copy)
                waits = tuple(run_id(spec, after, cell, seed, c) for after, c in spec.run_waits(arm_name, copy)
                              if spec.runs_in(after, cell.as_dict()))
                run = PlannedRun(rid, arm_name, copy, seed, cell.only(arm.over), depends, waits)
                if rid in runs and runs[rid] != run:
                    raise ConfigError(f"campaign {spec.name}: two runs would share the folder {rid}; the layout "
                                      "must tell every arm, copy, cell and seed apart")
                runs.setdefault(rid, run)
    return list(runs.values())


def _arm_order(spec: CampaignSpec) -> list[str]:
    """Arms with the ones others refer to first (the file's order otherwise)."""
    order: list[str] = []

    def visit(arm: str) -> None:
        if arm not in order:
            for dep in spec.arm_dependencies(arm):
                visit(dep)
            order.append(arm)

    for arm in spec.arms:
        visit(arm)
    return order


ArmLookup = Callable[[str, str], Any]
"""(run id, field) -> ``folder`` (absolute path), a ``live.json`` value (``live.<path>``) or a ``summary.json``
value of that finished run."""


def run_config(spec: CampaignSpec, base: Mapping[str, Any], run: PlannedRun, lookup: ArmLookup,
               campaign_folder: Path | None = None) -> dict[str, Any]:
    """The configuration mapping of ``run`` (its references resolved through ``lookup``; ``${campaign_folder}``
    is ``campaign_folder``, absolute)."""
    arm = spec.arms[run.arm]
    # an arm over fewer axes sees only its own axes' variables (its run serves every cell sharing them)
    variables = {k: v for k, v in run.cell.values if "." not in k}
    if campaign_folder is not None:
        variables["campaign_folder"] = str(Path(campaign_folder).resolve())
    workload_seed = run.seed + arm.seed_offset
    where = f"campaign {spec.name}, run {run.run_id}"

    def resolve_all(overrides: Mapping[str, Any], scope: str) -> dict[str, Any]:
        arm_runs = {(dep, copy): run_id(spec, dep, run.cell, run.seed, copy)
                    for dep, copy in spec.run_dependencies(run.arm)}
        return {key: resolve(value, {**variables, "seed": run.seed, "copy": run.copy}, arm_runs, lookup,
                             f"{where}: {scope}.{key}")
                for key, value in overrides.items()}

    tree = apply_overrides(base, resolve_all(spec.set, "set"))
    tree = apply_overrides(tree, {k: v for k, v in run.cell.values if "." in k})
    tree = apply_overrides(tree, {"seed": workload_seed, "workload.seed": workload_seed, "mode": arm.mode})
    return apply_overrides(tree, resolve_all(arm.set, f"arms.{run.arm}.set"))


def resolve(value: Any, variables: Mapping[str, Any], arm_runs: Mapping[tuple[str, int], str], lookup: ArmLookup,
            where: str) -> Any:
    """``value`` with its ``${...}`` references filled in, evaluated when it starts with ``=`` (``arm_runs``:
    (arm, copy) -> run id)."""
    if not isinstance(value, str) or ("${" not in value and not value.startswith("=")):
        return value

    def one(match: re.Match[str]) -> Any:
        name, copy, field = reference_parts(match)
        if field is None:
            if name not in variables:
                raise ConfigError(f"{where}: ${{{name}}} is not a variable of this cell")
            return variables[name]
        return lookup(arm_runs[name, copy], field)

    whole = REFERENCE.fullmatch(value)
    if whole:  # a lone reference keeps its value's type
        return one(whole)
    text = REFERENCE.sub(lambda m: repr(one(m)) if value.startswith("=") else str(one(m)), value)
    return evaluate(text, where) if text.startswith("=") else text


_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def round_sig(x: float, digits: int) -> float:
    """``x`` to ``digits`` significant digits (as ``f"{x:.{digits}g}"`` writes it)."""
    return float(f"{x:.{int(digits)}g}")


_FUNCTIONS: dict[str, Callable[..., Any]] = {"round": round, "min": min, "max": max, "round_sig": round_sig}


def evaluate(text: str, where: str) -> Any:
    """Arithmetic after the leading ``=``: numbers, + - * / // **, parentheses and a few functions."""
    source = text[1:].strip()

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.operand))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords):
            return _FUNCTIONS[node.func.id](*(walk(arg) for arg in node.args))
        raise ConfigError(f"{where}: {source!r} is not arithmetic on numbers (only + - * / // **, parentheses, "
                          f"{', '.join(_FUNCTIONS)})")

    try:
        result = walk(ast.parse(source, mode="eval").body)
    except (SyntaxError, ZeroDivisionError, TypeError, OverflowError) as err:
        raise ConfigError(f"{where}: {source!r} cannot be evaluated: {err}") from None
    if isinstance(result, float) and not math.isfinite(result):
        raise ConfigError(f"{where}: {source!r} is not a finite number")
    return result


def _at(data: Any, path: list[str]) -> Any:
    """The value at a dotted path into nested mappings; ``KeyError`` naming the first missing part."""
    for part in path:
        if not isinstance(data, Mapping) or part not in data:
            raise KeyError(part)
        data = data[part]
    return data


def folder_lookup(out: Path) -> ArmLookup:
    """Look references up in the run folders under ``out``: ``folder``, ``live.<path>`` (a value of the run's
    ``live.json``, e.g. ``live.ranks.all_gather_s.p50``), or else a ``summary.json`` value (a dotted path
    descends into its mappings)."""
    import json

    def lookup(rid: str, field: str) -> Any:
        folder = (Path(out) / rid).resolve()
        if field == "folder":
            return str(folder)
        if not (folder / "summary.json").is_file():
            raise ConfigError(f"run {rid} has not finished (no summary.json), so ${{...{field}}} has no value")
        parts = field.split(".")
        name, path = (LIVE_FILE, parts[1:]) if parts[0] == "live" and len(parts) > 1 else ("summary.json", parts)
        if not (folder / name).is_file():
            raise ConfigError(f"run {rid} has no {name} (only live runs write one), so ${{...{field}}} has no value")
        try:
            return _at(json.loads((folder / name).read_text()), path)
        except KeyError as missing:
            raise ConfigError(f"run {rid}'s {name} has no {'.'.join(path)!r} (no {missing})") from None

    return lookup
