"""Corpora of real constraint specs, read from JSON Lines.

One JSON object per line with ``id``, ``kind``, ``spec``, ``source``,
``license`` and, for ``ebnf``, ``dialect`` and ``start`` (the format of the
shared developer corpus). A bad line (invalid UTF-8, broken JSON, unknown
kind, a missing or empty field, a spec of the wrong shape, an id seen before)
is skipped and reported with its file and line number; the rest loads.

>>> load = load_corpus("embedded", kinds=["regex"], limit=3)
>>> len(load.items), load.items[0].kind
(3, 'regex')
>>> load.items[0].to_spec().kind
'regex'

Named corpora: ``embedded`` (a sample shipped in the package) and, when the
shared corpus folder exists (``$CDBENCH_CORPORA``, else
``$CDBENCH_SHARED/corpora``, else ``<repo>/../shared/corpora``), every
``*.jsonl`` file there by its stem. A corpus file may be gzipped (``*.jsonl.gz``, named without the suffixes).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from cdbench.backends.base import CONSTRAINT_KINDS, ConstraintSpec
from cdbench.workloads.validate import schema_error

EMBEDDED_SAMPLE = Path(__file__).parent / "data" / "embedded_sample.jsonl.gz"
CORPUS_SUFFIXES = (".jsonl", ".jsonl.gz")
_REQUIRED = ("id", "kind", "spec", "source", "license")


class UnknownCorpusError(ValueError):
    """A corpus name that is neither known nor an existing file."""


@dataclass(frozen=True)
class CorpusItem:
    """One spec of a corpus, with its provenance.

    ``extra`` keeps the other fields of the line (``lark_imports``, ``tools``,
    ``origin``, ...). ``path`` and ``line`` say where the item was read (for
    reports; not part of its identity).
    """

    id: str
    kind: str
    spec: Any
    source: str
    license: str
    dialect: str | None = None
    start: str | None = None
    library: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)
    path: str = field(default="", compare=False)
    line: int = field(default=0, compare=False)

    def to_spec(self) -> ConstraintSpec:
        """The constraint; ``ebnf`` items carry ``dialect`` and ``start`` in ``options``."""
        options: dict[str, Any] = {}
        if self.kind == "ebnf":
            options["dialect"] = self.dialect
            if self.start is not None:
                options["start"] = self.start
        return ConstraintSpec(self.kind, self.spec, options)  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        """The corpus line for this item (the inverse of parsing it)."""
        line: dict[str, Any] = {"id": self.id, "kind": self.kind}
        if self.dialect is not None:
            line["dialect"] = self.dialect
        line |= {"spec": self.spec, "source": self.source, "license": self.license}
        if self.kind == "ebnf":
            line["start"] = self.start
        if self.library:
            line["library"] = True
        return line | dict(self.extra)


@dataclass(frozen=True)
class SkippedLine:
    """A corpus line that was not loaded, and why."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class CorpusLoad:
    """Items that loaded, lines that did not, and library grammars set aside.

    ``library_ids``: Lark terminal libraries (``library: true``); they are not
    standalone grammars, so they are not workload items unless asked for.
    """

    items: list[CorpusItem]
    skipped: list[SkippedLine] = field(default_factory=list)
    library_ids: list[str] = field(default_factory=list)

    @property
    def skipped_count(self) -> int:
        return len(self.skipped)


_SPEC_TYPES: dict[str, tuple[type, ...]] = {
    "json_schema": (dict, bool), "regex": (str,), "choice": (list,), "ebnf": (str,), "structural_tag": (dict,)}


def check_spec(kind: Any, spec: Any, dialect: Any = None) -> None:
    """``ValueError`` unless ``spec`` has the shape of a ``kind`` spec (``ebnf`` also needs a ``dialect``;
    a ``json_schema`` must pass :func:`~cdbench.workloads.validate.schema_error`)."""
    if kind not in CONSTRAINT_KINDS:
        raise ValueError(f"unknown kind {kind!r} (known: {', '.join(CONSTRAINT_KINDS)})")
    expected = _SPEC_TYPES[kind]
    if not isinstance(spec, expected):
        names = " or ".join("an object" if t is dict else t.__name__ for t in expected)
        raise ValueError(f"spec of a {kind} item must be {names}, got {type(spec).__name__}")
    if kind == "choice" and not all(isinstance(c, str) for c in spec):
        raise ValueError("choice spec must be a list of strings")
    if kind == "ebnf" and dialect not in ("gbnf", "lark"):
        raise ValueError(f"ebnf item needs dialect gbnf or lark, got {dialect!r}")
    if kind == "json_schema":
        problem = schema_error(spec)
        if problem is not None:
            raise ValueError(problem)


def _text_field(obj: dict[str, Any], key: str) -> str:
    value = obj[key]
    if not isinstance(value, str) or not value:
        shown = "null" if value is None else repr(value)
        raise ValueError(f"field {key} must be a non-empty string, got {shown}")
    return value


def parse_item(obj: Any) -> CorpusItem:
    """A :class:`CorpusItem` from one parsed line; ``ValueError`` names what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"line is a JSON {type(obj).__name__}, not an object")
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    item_id = _text_field(obj, "id")
    source, license_ = _text_field(obj, "source"), _text_field(obj, "license")
    kind, spec, dialect = obj["kind"], obj["spec"], obj.get("dialect")
    check_spec(kind, spec, dialect)
    known = set(_REQUIRED) | {"dialect", "start", "library"}
    return CorpusItem(
        id=item_id,
        kind=kind,
        spec=spec,
        source=source,
        license=license_,
        dialect=dialect,
        start=obj.get("start", "root" if dialect == "gbnf" else None),
        library=bool(obj.get("library", False)),
        extra={k: v for k, v in obj.items() if k not in known},
    )


def read_corpus(
    path: str | Path,
    *,
    kinds: Iterable[str] | None = None,
    id_prefix: str | None = None,
    limit: int | None = None,
    sample: int | None = None,
    seed: int = 0,
    include_library: bool = False,
) -> CorpusLoad:
    """Load a JSONL corpus file, filtered.

    Parameters
    ----------
    kinds : keep only these kinds.
    id_prefix : keep only ids starting with this.
    sample : draw this many items without replacement (seeded), kept in file order.
    limit : keep at most this many (after sampling), the first in file order.
    include_library : keep ``library: true`` grammars as items.
    """
    path = Path(path)
    wanted = set(kinds) if kinds is not None else None
    items: list[CorpusItem] = []
    skipped: list[SkippedLine] = []
    libraries: list[str] = []
    first_line: dict[str, int] = {}
    # Bytes, decoded line by line: one line of invalid UTF-8 is a skipped line, not a failed load.
    with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                skipped.append(SkippedLine(str(path), number, f"invalid UTF-8 at byte {exc.start} of the line"))
                continue
            if not line.strip():
                continue
            try:
                item = parse_item(json.loads(line))
            except json.JSONDecodeError as exc:
                skipped.append(SkippedLine(str(path), number, f"broken JSON: {exc.msg} at column {exc.colno}"))
                continue
            except ValueError as exc:
                skipped.append(SkippedLine(str(path), number, str(exc)))
                continue
            # Ids name specs everywhere downstream (compile-cache keys, pools, traces): one id, one spec.
            if item.id in first_line:
                skipped.append(SkippedLine(str(path), number,
                                           f"duplicate id {item.id!r} (first on line {first_line[item.id]})"))
                continue
            first_line[item.id] = number
            item = replace(item, path=str(path), line=number)
            if item.library and not include_library:
                libraries.append(item.id)
                continue
            if wanted is not None and item.kind not in wanted:
                continue
            if id_prefix is not None and not item.id.startswith(id_prefix):
                continue
            items.append(item)
    if sample is not None and sample < len(items):
        chosen = np.sort(np.random.default_rng(seed).choice(len(items), size=sample, replace=False))
        items = [items[i] for i in chosen]
    if limit is not None:
        items = items[:limit]
    return CorpusLoad(items, skipped, libraries)


def shared_corpora_dir() -> Path | None:
    """The shared corpus folder, or ``None`` when it is absent."""
    explicit = os.environ.get("CDBENCH_CORPORA")
    if explicit:
        candidate = Path(explicit)
    else:
        shared = os.environ.get("CDBENCH_SHARED")
        base = Path(shared) if shared else Path(__file__).resolve().parents[2].parent / "shared"
        candidate = base / "corpora"
    return candidate if candidate.is_dir() else None


def corpus_name(path: Path) -> str:
    """A corpus file's name: its file name without ``.jsonl`` or ``.jsonl.gz``."""
    return next((path.name.removesuffix(suffix) for suffix in reversed(CORPUS_SUFFIXES)
                 if path.name.endswith(suffix)), path.stem)


def known_corpora() -> dict[str, Path]:
    """Corpus name → file: ``embedded`` and the stems of the shared folder's files."""
    known = {"embedded": EMBEDDED_SAMPLE}
    folder = shared_corpora_dir()
    if folder is not None:
        known |= {corpus_name(p): p for suffix in CORPUS_SUFFIXES for p in sorted(folder.glob(f"*{suffix}"))}
    return known


def resolve_corpus(name_or_path: str | Path) -> Path:
    """The file of a named corpus, or ``name_or_path`` itself when it is a file."""
    known = known_corpora()
    if str(name_or_path) in known:
        return known[str(name_or_path)]
    path = Path(name_or_path)
    if path.is_file():
        return path
    raise UnknownCorpusError(
        f"unknown corpus {str(name_or_path)!r}: not a file and not a known name; known: {', '.join(known)}"
    )


def load_corpus(name_or_path: str | Path, **filters: Any) -> CorpusLoad:
    """:func:`read_corpus` of a named corpus or a path."""
    return read_corpus(resolve_corpus(name_or_path), **filters)


def load_corpora(names_or_paths: Iterable[str | Path], **filters: Any) -> CorpusLoad:
    """:func:`load_corpus` of each, merged; an id already loaded from an earlier file is a skipped line."""
    merged = CorpusLoad([])
    seen: dict[str, CorpusItem] = {}
    for name in names_or_paths:
        load = load_corpus(name, **filters)
        merged.skipped += load.skipped
        merged.library_ids += load.library_ids
        for item in load.items:
            first = seen.get(item.id)
            if first is not None:
                merged.skipped.append(SkippedLine(item.path, item.line,
                                                  f"duplicate id {item.id!r} (first in {first.path}:{first.line})"))
                continue
            seen[item.id] = item
            merged.items.append(item)
    return merged
