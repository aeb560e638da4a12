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
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from cdbench._files import read_user_text

ModelT = TypeVar("ModelT", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is one line naming the key and the reason."""


def builtin_config_path(name: str) -> Path:
    """The path of a YAML file shipped in ``cdbench/configs`` (``"default"``, ``"ci"``, ``"slow_grammars"``, ``"sweep_example"``)."""
    path = Path(str(resources.files("cdbench") / "configs" / f"{name}.yaml"))
    if not path.is_file():
        raise ConfigError(f"no built-in config named {name!r}")
    return path


def read_yaml_mapping(path: Path, what: str = "config file") -> dict[str, Any]:
    """Read a YAML file whose top level is a mapping; anything else is a :class:`ConfigError` naming ``what``."""
    path = Path(path)
    text = read_user_text(path, what, "YAML", ConfigError)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{what} {path} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a mapping of keys at the top level, not {type(data).__name__}")
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


@dataclass
class _Where:
    """What an error location points at: the dotted key a user wrote, and the model(s) that can hold it there.

    Several ``models`` mean a union not yet narrowed; ``discriminator`` is the
    key that chooses among them (``process`` for ``workload.arrival``).
    """

    path: list[str]
    models: list[type[BaseModel]]
    discriminator: str | None = None
    tag: str | None = None  # the discriminator value that chose the model, when one did


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold, through ``Optional``, unions, ``Annotated`` and containers."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) is Annotated:
        return _models_in(get_args(annotation)[0])
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _tags(models: list[type[BaseModel]], discriminator: str) -> dict[str, type[BaseModel]]:
    """Discriminator value → model, from each model's ``Literal`` annotation of the discriminator field."""
    out: dict[str, type[BaseModel]] = {}
    for model in models:
        field = model.model_fields.get(discriminator)
        for value in get_args(field.annotation) if field is not None else ():
            out[str(value)] = model
    return out


# Labels pydantic puts in an error location for a non-model union member (``int``, ``literal['a']``, ...).
_SCALAR_LABELS = frozenset({"int", "float", "str", "bool", "none", "dict", "list", "tuple"})


def _locate(model: type[BaseModel], loc: tuple[Any, ...]) -> _Where:
    """Follow pydantic's error location through ``model``, dropping the union labels pydantic inserts
    (a discriminator value such as ``poisson``, or a member's type name) that are not keys of the file."""
    where = _Where([], [model])
    for part in loc:
        if len(where.models) == 1 and part in where.models[0].model_fields:
            field = where.models[0].model_fields[part]
            where = _Where([*where.path, str(part)], _models_in(field.annotation), field.discriminator
                           if isinstance(field.discriminator, str) else None)
            continue
        tagged = _tags(where.models, where.discriminator) if where.discriminator else {}
        named = {m.__name__: m for m in where.models}
        if str(part) in tagged:
            where = _Where(where.path, [tagged[str(part)]], where.discriminator, str(part))
        elif str(part) in named:
            where = _Where(where.path, [named[str(part)]])
        elif isinstance(part, str) and (part[:1].isupper() or "[" in part or part in _SCALAR_LABELS):
            continue
        else:
            where = _Where([*where.path, str(part)], where.models)  # a list index or a mapping key
    return where


def _dotted(parts: list[str]) -> str:
    return ".".join(parts) or "(top level)"


def _shown(value: Any) -> str:
    return repr(value) if not isinstance(value, dict) else "{" + ", ".join(map(str, value)) + "}"


def format_validation_error(err: ValidationError, model: type[BaseModel], source: str = "config") -> str:
    """One line per problem: the dotted key, the value given and what is allowed.

    An unknown key close to a required one that is missing (a typo) is one
    line suggesting the right name, not two.

    >>> from pydantic import BaseModel, ConfigDict
    >>> class Demo(BaseModel):
    ...     model_config = ConfigDict(extra="forbid")
    ...     rate: float
    ...     seed: int = 0
    >>> try:
    ...     Demo.model_validate({"rte": 3})
    ... except ValidationError as e:
    ...     print(format_validation_error(e, Demo))
    config: unknown key 'rte' (value 3); allowed keys here: rate, seed; did you mean 'rate'?
    """
    problems = err.errors()
    explained: set[str] = set()
    lines: list[tuple[str | None, str]] = []  # (the key when the line says it is missing, the line)
    for problem in problems:
        loc = tuple(problem["loc"])
        value = problem.get("input")
        kind = problem["type"]
        if kind == "extra_forbidden":
            where = _locate(model, loc[:-1])
            key = _dotted([*where.path, str(loc[-1])])
            allowed = sorted(where.models[0].model_fields) if len(where.models) == 1 else []
            line = f"{source}: unknown key {key!r} (value {_shown(value)})"
            if allowed:
                chosen = f" ({where.discriminator}: {where.tag})" if where.tag else ""
                line += f"; allowed keys here{chosen}: {', '.join(allowed)}"
                close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
                if close:
                    line += f"; did you mean {close[0]!r}?"
                    explained.add(_dotted([*where.path, close[0]]))
            lines.append((None, line))
            continue
        where = _locate(model, loc)
        key = _dotted(where.path)
        if kind in ("union_tag_not_found", "union_tag_invalid") and where.discriminator:
            choices = ", ".join(_tags(where.models, where.discriminator))
            if kind == "union_tag_not_found":
                lines.append((None, f"{source}: {key} needs '{where.discriminator}' to say which kind it is "
                                    f"(one of: {choices}); given {_shown(value)}"))
            else:
                tag = value.get(where.discriminator) if isinstance(value, dict) else value
                lines.append((None, f"{source}: {key}.{where.discriminator} = {tag!r}: must be one of {choices}"))
        elif kind == "missing":
            lines.append((key, f"{source}: {key} is required but missing"))
        else:
            # A validator's own message (ValueError) reads better without pydantic's "Value error, " prefix.
            error = problem.get("ctx", {}).get("error")
            message = str(error) if kind == "value_error" and error is not None else problem["msg"]
            lines.append((None, f"{source}: {key} = {_shown(value)}: {message}"))
    # A required key reported missing because it was misspelt is already named by its unknown-key line.
    return "\n".join(line for missing, line in lines if missing not in explained)


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
