"""Invalid instances for ``cdbench profile``: mutations of a valid instance, each checked invalid.

A mutation is only kept when the spec's own validator (jsonschema,
``re.fullmatch``, choice membership, a grammar parser) rejects it, so a backend
that accepts it has truly accepted an invalid output (a *false accept*).

>>> import re, numpy as np
>>> from cdbench.backends.base import ConstraintSpec
>>> spec = ConstraintSpec("regex", "[0-9]{3}")
>>> [m.label for m in mutate(spec, "123", lambda t: re.fullmatch("[0-9]{3}", t) is not None,
...                          np.random.default_rng(0), 2)]
['truncate', 'append']
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from cdbench.backends.base import ConstraintSpec

# Candidates checked per instance at most: validating big schemas is not free.
MAX_CANDIDATES = 60
_EXTRA_KEY = "cdbench_extra_key"
_ODD_CHARS = ("~", "0", "a", " ", "-", "\u00e9")


@dataclass(frozen=True)
class Mutation:
    """A mutated text and the family of change that produced it (``drop_key``, ``wrong_type``, ...)."""

    label: str
    text: str


def _paths(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    yield path, value
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, path + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, path + (index,))


def _replaced(root: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    out = copy.deepcopy(root)
    node = out
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = new
    return out


def _dropped(root: Any, path: tuple) -> Any:
    out = copy.deepcopy(root)
    node = out
    for step in path[:-1]:
        node = node[step]
    del node[path[-1]]
    return out


def _other_type(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return "text"
    if isinstance(value, (int, float)):
        return "12"
    if isinstance(value, str):
        return 12
    if isinstance(value, list):
        return {}
    return []


def _json_candidates(text: str) -> Iterator[Mutation]:
    yield Mutation("truncate", text[: max(1, len(text) // 2)])
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return
    dump = lambda v: json.dumps(v, ensure_ascii=False, separators=(", ", ": "))  # noqa: E731
    for path, node in _paths(value):
        yield Mutation("wrong_type", dump(_replaced(value, path, _other_type(node))))
        if isinstance(node, dict):
            for key in node:
                yield Mutation("drop_key", dump(_dropped(value, path + (key,))))
            yield Mutation("extra_key", dump(_replaced(value, path, {**node, _EXTRA_KEY: 1})))
        elif isinstance(node, str):
            yield Mutation("break_string", dump(_replaced(value, path, node + "~")))
            yield Mutation("break_string", dump(_replaced(value, path, "")))
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            yield Mutation("out_of_range", dump(_replaced(value, path, -(abs(node) + 10**9))))
            yield Mutation("out_of_range", dump(_replaced(value, path, abs(node) + 10**9)))
        elif isinstance(node, list):
            yield Mutation("array_length", dump(_replaced(value, path, [])))
            if node:
                yield Mutation("array_length", dump(_replaced(value, path, node + node)))


def _text_candidates(text: str, rng: np.random.Generator) -> Iterator[Mutation]:
    if text:
        yield Mutation("truncate", text[:-1])
    for char in _ODD_CHARS:
        yield Mutation("append", text + char)
    if text:
        yield Mutation("drop_first", text[1:])
        pos = int(rng.integers(len(text)))
        for char in _ODD_CHARS:
            if char != text[pos]:
                yield Mutation("replace_char", text[:pos] + char + text[pos + 1 :])
        yield Mutation("repeat", text + text)


def mutate(
    spec: ConstraintSpec,
    valid_text: str,
    is_valid: Callable[[str], bool],
    rng: np.random.Generator,
    n: int,
) -> list[Mutation]:
    """Up to ``n`` distinct invalid variants of ``valid_text``, one per family first.

    ``is_valid`` is the spec's validator; only texts it rejects are returned.
    ``rng`` orders the candidates within a family (same seed, same mutations).
    """
    if n <= 0:
        return []
    candidates = (
        _json_candidates(valid_text) if spec.kind == "json_schema" else _text_candidates(valid_text, rng)
    )
    families: dict[str, list[str]] = {}
    for mutation in candidates:
        if mutation.text != valid_text:
            families.setdefault(mutation.label, []).append(mutation.text)
    for texts in families.values():
        rng.shuffle(texts)
    chosen: list[Mutation] = []
    seen: set[str] = set()
    checked = 0
    # Round-robin over families, one invalid mutation from each per round, so a
    # handful of mutations covers several kinds of error.
    while len(chosen) < n and checked < MAX_CANDIDATES and any(families.values()):
        for label, texts in families.items():
            while texts and len(chosen) < n and checked < MAX_CANDIDATES:
                text = texts.pop()
                if text in seen:
                    continue
                seen.add(text)
                checked += 1
                if not is_valid(text):
                    chosen.append(Mutation(label, text))
                    break
    return chosen
