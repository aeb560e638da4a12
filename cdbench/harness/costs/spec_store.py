"""The spec-cost store: each spec's measured grammar costs, content-addressed and shared between runs.

``model`` mode prices a spec with what its backend measurably cost on it, so before a run every
distinct spec of the workload needs a measurement for its (backend, backend version, vocabulary,
backend options, spec) — :func:`spec_digest` hashes exactly these. A measurement also records the
host it ran on (:class:`~cdbench.harness.costs.host.HostInfo`), so one spec may hold entries of
several hosts side by side::

    <root>/<digest[:2]>/<digest>/<host id>.json      one SpecCostEntry
    <root>/sequences/<digest[:2]>/<digest>/<host id>.json      one SequenceEntry (a run's compiles in order)
    <root>/batch_fills/<digest[:2]>/<digest>/<host id>.json    one BatchFillEntry (a run's fills, interleaved)

Entries are written atomically (a temporary file renamed into place), so runs that measure at the
same time share the store safely: the last writer of an identical key wins, and a reader never sees
half a file. Nothing is ever keyed by a spec id or a corpus name: the same schema in two corpora is
one entry, and two corpora that reuse an id for different schemas are two.

>>> from cdbench.backends.base import ConstraintSpec
>>> a = spec_digest("xgrammar", "0.2.8", "qwen3.6", {}, ConstraintSpec("regex", "[ab]+"))
>>> a == spec_digest("xgrammar", "0.2.8", "qwen3.6", {}, ConstraintSpec("regex", "[ab]+"))
True
>>> a == spec_digest("xgrammar", "0.2.9", "qwen3.6", {}, ConstraintSpec("regex", "[ab]+"))
False
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cdbench.backends.base import ConstraintSpec
from cdbench.harness.costs.grammar_profile import CompileStatus, ProfileError
from cdbench.harness.costs.host import HostInfo
from cdbench.harness.costs.spec_profile import InstanceProfile, SpecProfile

METHOD = 2
"""How specs are measured (a warmed engine without the earlier specs' cached work, every 4th token
rolled back, refused texts kept: 2); bumped when that changes, so entries measured otherwise are not reused."""
SEQUENCE_METHOD = 3
"""How a run's compile sequence is measured (each spec's median over repeated sequences, each on a fresh
engine; 3: without a garbage collection between two compiles); bumped when that changes."""
BATCH_METHOD = 2
"""How a run's texts are walked in batch (2: every text of the run in arrival order, ``width`` walks
advancing together, each position's median over repeats, each repeat on freshly compiled grammars);
bumped when that changes."""
ENGINE_DISTRIBUTIONS = {"xgrammar": "xgrammar", "llguidance": "llguidance", "outlines": "outlines-core"}
"""The package whose version names each built-in engine backend's version."""


def backend_version(backend: str) -> str:
    """The version of the engine behind ``backend`` (``unversioned``: a backend of no known package)."""
    dist = ENGINE_DISTRIBUTIONS.get(backend)
    if dist is None:
        return "unversioned"
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def spec_digest(backend: str, version: str, vocab: str, options: Mapping[str, Any], spec: ConstraintSpec) -> str:
    """The store key of one spec's costs: a hash of everything that decides them but the host."""
    return _digest({"method": METHOD, "backend": backend, "version": version, "vocab": vocab,
                    "options": dict(sorted(options.items())), "spec": spec.canonical()})


def _digest(key: Mapping[str, Any]) -> str:
    text = json.dumps(key, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def instance_base(digest: str) -> str:
    """The base text a stored entry's instances are keyed under
    (:func:`~cdbench.harness.costs.spec_profile.instance_key` of it and the walked tokens)."""
    return f"spec:{digest}"


CONTENDED_PACE = 1.10
"""A measurement whose pace (:attr:`_StoreEntry.pace`) is above this was taken while other work shared the
host's cores: its timed work waited for them a tenth as long as it ran, or longer
(``reports/spec_costs/out_of_sample.md``, "Measurements that know how busy the host was")."""


BUSY_HOST_SHARE = 0.5
"""A measurement taken while the host's other CPUs (those it did not run on) were busier than this share
(:attr:`_StoreEntry.host_busy`) ran beside a busy host: slower by up to a sixth, which its ``pace`` does
not show (:class:`~.host.CoreShare`)."""


class _StoreEntry(BaseModel):
    """What every store entry is keyed and labelled by: its digest, the engine and vocabulary it measured,
    the host it ran on, when and how, and how contended the host was meanwhile (``pace``)."""

    model_config = ConfigDict(extra="forbid")
    format_version: Literal[1] = 1
    digest: str
    backend: str
    backend_version: str
    vocab: str
    host: HostInfo
    measured: str = Field(description="when and how: date, command, versions")
    pace: float | None = Field(default=None, description=(
        "how contended the host's cores were while this was measured (host.CoreShare.pace: 1.0 not at all, "
        "2.0 its timed work waited for other work as long as it ran); one figure for all that one "
        "measurement took (specs measured together, a sequence's repeats); None: not recorded"))
    host_busy: float | None = Field(default=None, description=(
        "the share of the host's other CPUs (those the measurement did not run on) busy meanwhile "
        "(host.CoreShare.host_busy); None: none, or not recorded"))

    @property
    def beside_busy_host(self) -> bool:
        """Whether the host's other CPUs were mostly busy while this was measured (``host_busy`` of
        :data:`BUSY_HOST_SHARE` or more)."""
        return self.host_busy is not None and self.host_busy >= BUSY_HOST_SHARE

    @property
    def contended(self) -> bool:
        """Whether other work shared the host's cores while this was measured (``pace`` over
        :data:`CONTENDED_PACE`)."""
        return self.pace is not None and self.pace > CONTENDED_PACE


class SpecCostEntry(_StoreEntry):
    """One spec's measured costs on one host.

    ``status``/``message``: how its measurement ended (``ok``, or the failure
    class and reason, as ``cdbench profile`` classes them); ``costs``: its
    :class:`SpecProfile` (compile time, fill curve and spread, accept and
    rollback); ``instances``: each walked text's fills by position, keyed by
    :func:`~cdbench.harness.costs.spec_profile.instance_key` of
    :func:`instance_base` and its tokens. ``label``: the spec id it was first
    measured under (for messages and held-out splits by corpus: it is not part
    of the key); ``spec``: the spec's canonical text (what a predictor of
    spec costs is fitted on).
    """

    kind: str
    label: str = ""
    spec: str = ""
    status: CompileStatus
    message: str = ""
    costs: SpecProfile
    instances: dict[str, InstanceProfile] = {}


def sequence_digest(backend: str, version: str, vocab: str, options: Mapping[str, Any],
                    specs: Sequence[ConstraintSpec]) -> str:
    """The store key of the compile times of ``specs`` compiled one after another, in this order."""
    return _digest(_run_key("sequence_method", SEQUENCE_METHOD, backend, version, vocab, options, specs))


def _run_key(method_name: str, method: int, backend: str, version: str, vocab: str, options: Mapping[str, Any],
             specs: Sequence[ConstraintSpec]) -> dict[str, Any]:
    """What keys a measurement of a run's specs (``method_name``: that measurement's method field), before
    what the measurement adds. The order of the fields is part of the digest."""
    return {"method": METHOD, method_name: method, "backend": backend, "version": version, "vocab": vocab,
            "options": dict(sorted(options.items())), "specs": [s.canonical() for s in specs]}


class SequenceEntry(_StoreEntry):
    """A run's specs compiled one after another on one engine, in the order the run first meets them,
    on one host: ``compile_s[i]`` is the ``i``-th spec's compile seconds there (``None``: it failed).

    An engine that shares work between grammars (xgrammar caches the token masks of rules that
    schemas share) compiles a spec faster after related ones: measured alone, the specs of a corpus
    whose schemas share definitions (Kubernetes objects) compile about 12 % slower at the median.
    """

    compile_s: list[float | None]


def batch_digest(backend: str, version: str, vocab: str, options: Mapping[str, Any], specs: Sequence[ConstraintSpec],
                 walks: Sequence[tuple[int, tuple[int, ...]]], width: int, gap_s: float = 0.0,
                 compiles: str = "before") -> str:
    """The store key of the fills of ``walks`` (spec index, tokens) walked ``width`` at a time, each step's
    accepts ``gap_s`` after its fills, the specs compiled ``compiles`` the walk (``before``, or ``between``
    its steps; each keyed only where not the default, so walks measured before either existed keep their
    keys)."""
    return _digest({**_run_key("batch_method", BATCH_METHOD, backend, version, vocab, options, specs),
                    "walks": [[s, list(tokens)] for s, tokens in walks], "width": width,
                    **({"gap_s": gap_s} if gap_s else {}), **({"compiles": compiles} if compiles != "before" else {})})


class BatchFillEntry(_StoreEntry):
    """A run's texts walked as its batches walk them, on one host: ``fill_s[i][p]`` is the ``i``-th
    walk's fill seconds at answer position ``p`` (median over the repeats), ``None`` where the walk
    was not timed (its spec did not compile; it stopped before ``p``); ``accept_s[i][p]`` the same
    for the accept of the walk's token at ``p``.

    ``format_version`` 2 holds the accepts; an entry of format 1 (written before accepts were timed
    in the walk) has fills alone, and its texts' accepts are priced from their specs' walks alone.

    An engine fills a step's rows one grammar after another, so a grammar meets caches its
    neighbours have just used, and its first fill comes well after its compile. Against the same
    texts walked alone, on an H100 host's CPU (JSON schemas, 16 at a time): later fills +10 to +35 %
    at the median and p90, first fills a tenth
    (``reports/fidelity/live_vs_model.md``, "Fills walked in batch").
    """

    format_version: Literal[1, 2] = 2
    width: int
    fill_s: list[list[float | None] | None]
    accept_s: list[list[float | None] | None] = []

    @model_validator(mode="after")
    def _accepts_beside_fills(self) -> BatchFillEntry:
        if self.format_version >= 2 and len(self.accept_s) != len(self.fill_s):
            raise ValueError(f"format {self.format_version} holds an accept list per walk: "
                             f"{len(self.accept_s)} for {len(self.fill_s)} walks")
        return self


_Entry = TypeVar("_Entry", bound=_StoreEntry)


class SpecCostStore:
    """The entries under ``root`` (created on the first write)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _folder(self, digest: str) -> Path:
        return self.root / digest[:2] / digest

    def entries(self, digest: str) -> list[SpecCostEntry]:
        """Every host's entry for ``digest``, ordered by host id; a damaged file raises
        :class:`~cdbench.harness.costs.grammar_profile.ProfileError` naming it."""
        return _read(self._folder(digest), SpecCostEntry, "a spec-cost entry", "the spec")

    def put(self, entry: SpecCostEntry) -> Path:
        """Store ``entry`` (replacing this host's earlier one for its spec); returns its path."""
        return self._write(self._folder(entry.digest), entry.host.id, entry)

    def sequences(self, digest: str) -> list[SequenceEntry]:
        """Every host's :class:`SequenceEntry` for ``digest``, ordered by host id."""
        return _read(self.root / "sequences" / digest[:2] / digest, SequenceEntry, "a compile-sequence entry",
                     "the sequence")

    def put_sequence(self, entry: SequenceEntry) -> Path:
        """Store ``entry`` (replacing this host's earlier one for its sequence); returns its path."""
        return self._write(self.root / "sequences" / entry.digest[:2] / entry.digest, entry.host.id, entry)

    def batch_fills(self, digest: str) -> list[BatchFillEntry]:
        """Every host's :class:`BatchFillEntry` for ``digest``, ordered by host id."""
        return _read(self.root / "batch_fills" / digest[:2] / digest, BatchFillEntry, "a batch-fill entry",
                     "the batch walk")

    def put_batch_fills(self, entry: BatchFillEntry) -> Path:
        """Store ``entry`` (replacing this host's earlier one for its walks); returns its path."""
        return self._write(self.root / "batch_fills" / entry.digest[:2] / entry.digest, entry.host.id, entry)

    def _write(self, folder: Path, name: str, entry: BaseModel) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.json"
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=_WRITING, suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(entry.model_dump_json())
        os.replace(tmp, path)
        return path

    def __len__(self) -> int:
        if not self.root.is_dir():
            return 0
        return sum(1 for path in self.root.glob("*/*/*.json") if not path.name.startswith(_WRITING))


#: The prefix of a file another process is still writing (renamed onto its entry's name when whole): readers
#: sharing the store skip it (a glob's ``*`` matches names that start with a dot).
_WRITING = ".tmp-"


def _read(folder: Path, model: type[_Entry], what: str, again: str) -> list[_Entry]:
    """Every host's file in ``folder`` as ``model``, ordered by host id; a damaged one names itself."""
    out = []
    paths = sorted(p for p in folder.glob("*.json") if not p.name.startswith(_WRITING)) if folder.is_dir() else ()
    for path in paths:
        try:
            out.append(model.model_validate_json(path.read_text(encoding="utf-8")))
        except (OSError, ValidationError) as exc:
            raise ProfileError(f"{path}: not {what} ({exc.__class__.__name__}: {str(exc).splitlines()[0]}); "
                               f"delete it to measure {again} again") from exc
    return out
