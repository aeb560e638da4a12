"""Where ``cdbench profile``'s items and instances come from: :mod:`cdbench.workloads`.

Corpus items, their oracle instances (valid texts, each validated) and the
spec validators all come from the workloads package; this module only shapes
them into what the profile runner needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cdbench.backends.base import ConstraintSpec
from cdbench.workloads.validate import InvalidInstance, check_instance

# Fresh draws tried per wanted instance before giving up on a spec.
DRAWS_PER_INSTANCE = 8


@dataclass(frozen=True)
class SourceItem:
    """One corpus item to profile: the corpus (file stem) it came from, its id and spec."""

    corpus: str
    item_id: str
    spec: ConstraintSpec


def validator(spec: ConstraintSpec) -> Callable[[str], bool]:
    """``is_valid(text)`` for ``spec``, from the workloads' validator."""

    def is_valid(text: str) -> bool:
        try:
            check_instance(spec, text)
        except InvalidInstance:
            return False
        return True

    return is_valid


def _draw(spec: ConstraintSpec, rng: np.random.Generator) -> str:
    if spec.kind == "json_schema":
        from cdbench.workloads.json_instances import json_instance

        schema = json.loads(spec.spec) if isinstance(spec.spec, str) else spec.spec
        # The whitespace convention every backend compiles to by default.
        return json.dumps(json_instance(schema, rng), ensure_ascii=False, separators=(", ", ": "))
    if spec.kind == "regex":
        from cdbench.workloads.regex_instances import regex_instance

        return regex_instance(spec.spec, rng)
    if spec.kind == "choice":
        return str(spec.spec[int(rng.integers(len(spec.spec)))])
    raise ValueError(f"no instance generator for kind {spec.kind!r}")


def oracle_texts(spec: ConstraintSpec, n: int, rng: np.random.Generator) -> tuple[list[str], str]:
    """Up to ``n`` distinct valid texts of ``spec`` and, if fewer, the reason."""
    texts: list[str] = []
    reason = ""
    for _ in range(n * DRAWS_PER_INSTANCE):
        if len(texts) == n:
            break
        try:
            text = _draw(spec, rng)
            check_instance(spec, text)
        except (InvalidInstance, ValueError, RecursionError, KeyError, TypeError) as exc:
            reason = f"{type(exc).__name__}: {str(exc)[:200]}"
            if isinstance(exc, ValueError) and str(exc).startswith("no instance generator"):
                break
            continue
        if text not in texts:
            texts.append(text)
    return texts, ("" if len(texts) == n else reason or "only duplicate instances")


def load_items(corpus: str, limit: int | None) -> tuple[list[SourceItem], list[str]]:
    """The first ``limit`` items of ``corpus`` (a name or a JSONL path) and the lines skipped."""
    from cdbench.workloads.corpora import load_corpus

    loaded = load_corpus(corpus, limit=limit)
    name = Path(str(corpus)).stem
    items = [SourceItem(name, item.id, item.to_spec()) for item in loaded.items]
    return items, [str(line) for line in loaded.skipped]
