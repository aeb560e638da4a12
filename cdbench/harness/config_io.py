"""Read a run configuration from YAML, apply dotted overrides, and explain mistakes in one line.

The configuration model itself (:class:`cdbench.harness.config.RunConfig`)
lives in ``config.py``; this module is the file and command-line side of it.

Examples
--------
>>> tree = {"workload": {"rate": 5.0}}
>>> set_dotted(tree, "workload.rate", 20.0)
>>> set_dotted(tree, "scheduler.poll_interval_s", 0.001)
>>> tree
{'workload': {'rate': 20.0}, 'scheduler': {'poll_interval_s': 0.001}}
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

ModelT = TypeVar("ModelT", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is one line naming the key and the reason."""


def builtin_config_path(name: str) -> Path:
    """The path of a YAML file shipped in ``cdbench/configs`` (``"default"``, ``"ci"``, ``"sweep_example"``)."""
    path = Path(str(resources.files("cdbench") / "configs" / f"{name}.yaml"))
    if not path.is_file():
        raise ConfigError(f"no built-in config named {name!r}")
    return path


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML file whose top level is a mapping; anything else is a :class:`ConfigError`."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys at the top level, not {type(data).__name__}")
    return data


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``dotted = "a.b.c"``, creating mappings on the way."""
    parts = dotted.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            prefix = ".".join(parts[: depth + 1])
            raise ConfigError(f"cannot set {dotted}: {prefix} is a value ({child!r}), not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(tree: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``tree`` with each ``dotted.path: value`` of ``overrides`` set; ``None`` values are skipped."""
    out = copy.deepcopy(dict(tree))
    for dotted, value in overrides.items():
        if value is not None:
            set_dotted(out, dotted, value)
    return out


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """The field names of the sub-model at ``loc`` (the parent of an unknown key)."""
    current: Any = model
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if fields is None or part not in fields:
            return None
        current = fields[part].annotation
        # Optional[Sub] / Sub | None: look through to the model.
        for arg in getattr(current, "__args__", ()) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
    fields = getattr(current, "model_fields", None)
    return sorted(fields) if fields else None


def format_validation_error(err: ValidationError, model: type[BaseModel], source: str = "config") -> str:
    """One line per problem: the dotted key, the value given and what is allowed.

    >>> from pydantic import BaseModel, ConfigDict
    >>> class Demo(BaseModel):
    ...     model_config = ConfigDict(extra="forbid")
    ...     rate: float = 1.0
    >>> try:
    ...     Demo.model_validate({"rte": 3})
    ... except ValidationError as e:
    ...     print(format_validation_error(e, Demo))
    config: unknown key 'rte' (value 3); allowed keys here: rate
    """
    lines = []
    for problem in err.errors():
        loc = tuple(problem["loc"])
        # Union members add their type name to loc; keep only real field names.
        key = ".".join(str(p) for p in loc if not (isinstance(p, str) and p[:1].isupper())) or "(top level)"
        value = problem.get("input")
        if problem["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, loc[:-1])
            hint = f"; allowed keys here: {', '.join(allowed)}" if allowed else ""
            lines.append(f"{source}: unknown key {key!r} (value {value!r}){hint}")
        elif problem["type"] == "missing":
            lines.append(f"{source}: {key} is required but missing")
        else:
            shown = repr(value) if not isinstance(value, dict) else "{...}"
            lines.append(f"{source}: {key} = {shown}: {problem['msg']}")
    return "\n".join(lines)


def validate_config(model: type[ModelT], tree: Mapping[str, Any], source: str = "config") -> ModelT:
    """``model.model_validate(tree)`` with a :class:`ConfigError` saying exactly what is wrong."""
    try:
        return model.model_validate(dict(tree))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, model, source)) from None


def dump_config(config: BaseModel, path: Path) -> None:
    """Write the resolved configuration (every default filled in) as YAML."""
    data = config.model_dump(mode="json")
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
