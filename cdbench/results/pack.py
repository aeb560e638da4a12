"""A pack: many run folders (a campaign's raw results) as one compressed Parquet file set.

Layout of a pack (a folder, conventionally named ``<campaign>.pack``)::

    <name>.pack/
      runs.parquet       the index: one row a run (run_id, summary.json and config.yaml as their text,
                         the arrow schema of each saved table, row counts, and mode / backend / policy / seed
                         for listing)
      requests.parquet   every run's requests.parquet, a ``run_id`` column first, runs one after another
      steps.parquet      every run's steps.parquet, the same way
      files.parquet      every other file: run_id, path (relative to the run folder), data, inflated;
                         files of the campaign outside any run folder have no run_id. A gzip file
                         (``.gz``, ``.tgz``) is kept inflated (``inflated`` true) and gzipped again when
                         read: its content is the same, its compressed bytes need not be

The step log's seconds (its float ``*_s`` columns) are kept at :data:`STEP_QUANTUM_S` (0.1 µs) as integer
ticks unless the pack is written exact: measured step parts vary between steps by microseconds, and the ticks
take a third of the bytes of the floats' noise digits (the committed campaigns' steps went from 6.1 to 2.4 MB).
A run's summary and its requests are kept exact, so every verdict read from a pack is the run's own. A figure
made of many step parts (the launch: what is left of a step after its timed parts) moves by up to 0.05 µs a
part; a study of such residuals packs its runs ``--exact``.

Every table is one zstd row group (level 19), without dictionaries but for categorical columns: the pack
compresses a column of all its runs at once, and files of one name (the runs' profiles, traces, stores)
side by side, which a row group a run and files kept gzipped did not (the three committed campaign packs
went from 13.6 to 9.1 MB, their contents equal). Packs written before (a row group a run, no ``inflated``
column) read the same; ``cdbench pack --repack`` rewrites one.

Runs are named by their id in the pack, written ``<pack>::<run id>`` where a run folder is accepted
(:func:`open_run`; ``cdbench fidelity`` and ``cdbench compare``). ``cdbench pack`` uses the run folder's
path relative to the packed folder as its id, so the run's label (the id's last part) is the folder's name.

What a run folder holds that is derived from the rest (``report.md``, ``plots/``, ``trace.json``) or
marks the folder's command (``.cdbench.json``) is left out; ``cdbench report`` rebuilds the first two
from an unpacked run.

Examples
--------
>>> split_ref("reports/fidelity/live_vs_model.pack::runs/a/hybrid")
(PosixPath('reports/fidelity/live_vs_model.pack'), 'runs/a/hybrid')
>>> split_ref("runs/a/hybrid")
(PosixPath('runs/a/hybrid'), None)
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from cdbench.results.run_folder import TABLES, ResultsError, SavedRun, load_run
from cdbench.results.stopped_run import status_of, stopped_run_error

REF_SEPARATOR = "::"
PACK_SUFFIX = ".pack"
INDEX_FILE = "runs.parquet"
FILES_FILE = "files.parquet"
RUN_FILES = ("summary.json", "config.yaml", *TABLES)
"""Files a run's row in the index and its table rows hold; everything else goes to ``files.parquet``."""
DERIVED = ("report.md", "trace.json", ".cdbench.json")
DERIVED_FOLDERS = ("plots",)
GZIP_SUFFIXES = (".gz", ".tgz")
STEPS_FILE = "steps.parquet"
STEP_QUANTUM_S = 1e-7
"""The resolution at which a pack keeps the step log's seconds (``None`` where a pack is written exact)."""
QUANTUM_KEY = b"cdbench.quantum_s"
"""Field metadata of a packed column held as integer ticks: the seconds a tick stands for."""
CATEGORIES_KEY = b"cdbench.categories"
"""Field metadata of a run's own schema in the index: a categorical column's categories, in order (the
runs share a row group, so the column read back holds the categories of every run)."""


def _write_options(schema: pa.Schema) -> dict[str, object]:
    """Packs are written once and read often: the smaller file is worth the slower write. Measured values
    rarely repeat, so dictionaries only cost; only categorical columns keep theirs."""
    categorical = [field.name for field in schema if pa.types.is_dictionary(field.type)]
    return {"compression": "zstd", "compression_level": 19, "use_dictionary": categorical or False}

Progress = Callable[[str], None]
"""Told the id of each run as it is packed."""


def split_ref(ref: str | Path) -> tuple[Path, str | None]:
    """``(pack, run id)`` of a ``<pack>::<run id>`` reference, or ``(folder, None)`` of a run folder."""
    text = str(ref)
    if REF_SEPARATOR not in text:
        return Path(text), None
    pack, run_id = text.split(REF_SEPARATOR, 1)
    return Path(pack), run_id


def is_run_folder(folder: Path) -> bool:
    return (folder / "summary.json").is_file() and (folder / "config.yaml").is_file()


def find_run_folders(root: Path) -> dict[str, Path]:
    """Every run folder under ``root`` (it included) by its path relative to ``root``, sorted; a run folder's
    subfolders are not searched."""
    root = Path(root)
    found: dict[str, Path] = {}
    for summary in sorted(root.rglob("summary.json")):
        folder = summary.parent
        if is_run_folder(folder) and not any(parent in found.values() for parent in folder.parents):
            found[folder.relative_to(root).as_posix() or "."] = folder
    return found


def _loose_files(folder: Path) -> Iterable[tuple[str, Path]]:
    """A run folder's files that are neither in the index nor derived: (path relative to the folder, path)."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder)
        if rel.as_posix() in RUN_FILES or rel.as_posix() in DERIVED or rel.parts[0] in DERIVED_FOLDERS:
            continue
        yield rel.as_posix(), path


def _section(config: Mapping, key: str, field: str) -> str | None:
    value = config.get(key)
    return str(value.get(field)) if isinstance(value, Mapping) and value.get(field) is not None else None


def _seconds_as_ticks(table: pa.Table, quantum_s: float) -> pa.Table:
    """``table`` with each float ``*_s`` column as int64 ticks of ``quantum_s`` (NaN as null), marked in its
    field's metadata."""
    for i, field in enumerate(table.schema):
        if pa.types.is_floating(field.type) and field.name.endswith("_s"):
            seconds = table.column(i).to_numpy(zero_copy_only=False)
            missing = np.isnan(seconds)
            ticks = pa.array(np.rint(np.where(missing, 0.0, seconds) / quantum_s).astype(np.int64), mask=missing)
            marked = pa.field(field.name, pa.int64(), metadata={QUANTUM_KEY: repr(quantum_s).encode()})
            table = table.set_column(i, marked, ticks)
    return table


def _ticks_as_seconds(table: pa.Table) -> pa.Table:
    """The inverse of :func:`_seconds_as_ticks` (a tick count divided by ticks a second, null as NaN)."""
    for i, field in enumerate(table.schema):
        if field.metadata and QUANTUM_KEY in field.metadata:
            per_second = round(1 / float(field.metadata[QUANTUM_KEY]))
            seconds = table.column(i).to_numpy(zero_copy_only=False).astype(np.float64) / per_second
            table = table.set_column(i, pa.field(field.name, pa.float64()), pa.array(seconds))
    return table


def _write_tables(tables: list[tuple[str, pa.Table]], path: Path, quantum_s: float | None) -> None:
    """One Parquet file of every run's table, a ``run_id`` column first, in one row group; seconds as ticks of
    ``quantum_s`` unless it is ``None``.

    Runs written by different cdbench versions have different columns; the file holds their union (a
    column a run lacks is null in its rows) and each run's own schema is kept in the index to read it back.
    """
    tagged = [table.add_column(0, "run_id", pa.array([run_id] * table.num_rows, pa.string()))
              .replace_schema_metadata(None) for run_id, table in tables]
    if not tagged:
        return
    schema = pa.unify_schemas([t.schema for t in tagged], promote_options="permissive")
    whole = pa.concat_tables([_conform(table, schema) for table in tagged])
    if quantum_s is not None:
        whole = _seconds_as_ticks(whole, quantum_s)
    pq.write_table(whole, path, row_group_size=max(whole.num_rows, 1), **_write_options(whole.schema))


def _run_schema(table: pa.Table) -> bytes:
    """A run's table's own schema for the index, each categorical column's categories in its field's metadata."""
    table = table.unify_dictionaries()
    fields = []
    for field in table.schema:
        column = table.column(field.name)
        if pa.types.is_dictionary(field.type) and column.num_chunks:
            categories = json.dumps(column.chunk(0).dictionary.to_pylist()).encode()
            field = field.with_metadata({**(field.metadata or {}), CATEGORIES_KEY: categories})
        fields.append(field)
    return pa.schema(fields, metadata=table.schema.metadata).serialize().to_pybytes()


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with every column of ``schema`` (nulls where it has none), cast to the schema's types."""
    columns = [table.column(field.name).cast(field.type) if field.name in table.schema.names
               else pa.nulls(table.num_rows, field.type) for field in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def _file_row(run_id: str | None, path: str, data: bytes) -> dict[str, object]:
    """A packed file's row: a gzip file inflated, so that zstd compresses its content beside the pack's others."""
    if path.endswith(GZIP_SUFFIXES):
        try:
            return {"run_id": run_id, "path": path, "data": gzip.decompress(data), "inflated": True}
        except (OSError, EOFError, zlib.error):  # not gzip after all: kept as it is
            pass
    return {"run_id": run_id, "path": path, "data": data, "inflated": False}


def _file_order(row: Mapping[str, object]) -> tuple[str, str, str]:
    """Files of one name side by side (every run's profile, every trace): zstd finds what they share."""
    path = str(row["path"])
    return path.rsplit("/", 1)[-1], str(row["run_id"] or ""), path


def _write_pack(dest: Path, index_rows: list[dict[str, object]], tables: Mapping[str, list[tuple[str, pa.Table]]],
                file_rows: list[dict[str, object]], exact: bool) -> Path:
    dest.mkdir(parents=True)
    index = pa.Table.from_pandas(pd.DataFrame(index_rows, columns=list(_INDEX_SCHEMA.names)), schema=_INDEX_SCHEMA,
                                 preserve_index=False)
    pq.write_table(index, dest / INDEX_FILE, **_write_options(index.schema))
    for name, runs in tables.items():
        _write_tables(runs, dest / name, None if exact or name != STEPS_FILE else STEP_QUANTUM_S)
    pq.write_table(pa.Table.from_pylist(sorted(file_rows, key=_file_order), schema=_FILES_SCHEMA), dest / FILES_FILE,
                   **_write_options(_FILES_SCHEMA))
    return dest


def _check_new(dest: Path) -> Path:
    dest = Path(dest)
    if dest.exists():
        raise ResultsError(f"{dest} already exists; a pack is written whole into a new folder")
    return dest


def pack_runs(folders: Mapping[str, Path], dest: Path, files: Mapping[str, Path] | None = None,
              progress: Progress | None = None, exact: bool = False) -> Path:
    """Pack run folders (run id -> folder) into the pack folder ``dest`` (created; must not exist); returns it.

    ``exact``: keep the step log's seconds as they are, not at :data:`STEP_QUANTUM_S`.

    Each folder needs ``summary.json`` and ``config.yaml``; its tables are packed when present (a campaign
    that kept only summaries packs as such). ``files``: more files of the campaign, outside any run folder,
    by the path they are listed under. Raises :class:`ResultsError` naming a folder that is not a run folder.
    """
    dest = _check_new(dest)
    for run_id, folder in folders.items():
        if REF_SEPARATOR in run_id or not run_id:
            raise ResultsError(f"run id {run_id!r} ({folder}): must be non-empty and hold no {REF_SEPARATOR!r}")
        if not Path(folder).is_dir() or not (Path(folder) / "summary.json").is_file():
            raise ResultsError(f"{folder} is not a cdbench run folder (no summary.json)")
    index_rows: list[dict[str, object]] = []
    tables: dict[str, list[tuple[str, pa.Table]]] = {name: [] for name in TABLES}
    file_rows: list[dict[str, object]] = []
    for run_id, folder in folders.items():
        folder = Path(folder)
        run = load_run(folder, tables_optional=True)  # validates the summary, config and tables it finds
        row: dict[str, object] = {
            "run_id": run_id, "mode": run.config.get("mode"),
            "backend": _section(run.config, "backend", "name"), "policy": _section(run.config, "policy", "name"),
            "seed": run.config.get("seed"),
            "summary": (folder / "summary.json").read_text(), "config": (folder / "config.yaml").read_text()}
        for name in TABLES:
            stem = name.removesuffix(".parquet")
            table = pq.read_table(folder / name) if (folder / name).is_file() else None
            row[f"{stem}_schema"] = None if table is None else _run_schema(table)
            row[f"{stem}_rows"] = None if table is None else table.num_rows
            if table is not None:
                tables[name].append((run_id, table))
        index_rows.append(row)
        file_rows += [_file_row(run_id, rel, path.read_bytes()) for rel, path in _loose_files(folder)]
        if progress is not None:
            progress(run_id)
    file_rows += [_file_row(None, rel, Path(path).read_bytes()) for rel, path in sorted((files or {}).items())]
    return _write_pack(dest, index_rows, tables, file_rows, exact)


_INDEX_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("mode", pa.string()), ("backend", pa.string()), ("policy", pa.string()),
    ("seed", pa.int64()), ("summary", pa.string()), ("config", pa.string()),
    ("requests_schema", pa.binary()), ("requests_rows", pa.int64()),
    ("steps_schema", pa.binary()), ("steps_rows", pa.int64()),
])
_FILES_SCHEMA = pa.schema([("run_id", pa.string()), ("path", pa.string()), ("data", pa.binary()),
                           ("inflated", pa.bool_())])


@dataclass(frozen=True)
class PackedRunFiles:
    """A packed run's other files, read from the pack on demand (a :class:`~cdbench.results.run_folder.RunSource`)."""

    pack: Pack
    run_id: str

    @property
    def ref(self) -> str:
        return f"{self.pack.path}{REF_SEPARATOR}{self.run_id}"

    def read(self, name: str) -> bytes | None:
        return self.pack.read_file(name, self.run_id)


class Pack:
    """A pack read back: its index, its runs and its files."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not (self.path / INDEX_FILE).is_file():
            raise ResultsError(f"{self.path} is not a cdbench pack (no {INDEX_FILE})")

    @cached_property
    def index(self) -> pd.DataFrame:
        """One row a run: run_id, mode, backend, policy, seed, requests_rows, steps_rows."""
        columns = ["run_id", "mode", "backend", "policy", "seed", "requests_rows", "steps_rows"]
        index = pq.read_table(self.path / INDEX_FILE, columns=columns).to_pandas()
        return index.astype({"seed": "Int64", "requests_rows": "Int64", "steps_rows": "Int64"})

    @property
    def run_ids(self) -> list[str]:
        return self.index["run_id"].tolist()

    def files(self) -> pd.DataFrame:
        """One row a packed file: run_id (None for the campaign's own files), path, size in bytes (a gzip
        file's inflated size)."""
        table = pq.read_table(self.path / FILES_FILE)
        return pd.DataFrame({"run_id": table.column("run_id").to_pylist(), "path": table.column("path").to_pylist(),
                             "bytes": pc.binary_length(table.column("data")).to_pylist()})

    def _file_records(self, match: pc.Expression | None = None) -> list[dict[str, object]]:
        """Packed files as rows of run_id, path and their bytes as the run folder held them."""
        records = pq.read_table(self.path / FILES_FILE, filters=match).to_pylist()
        # packs written before files were kept inflated have no ``inflated`` column: their bytes are as they were
        return [{**record, "data": gzip.compress(record["data"], mtime=0) if record.get("inflated") else record["data"]}
                for record in records]

    def read_file(self, path: str, run_id: str | None = None) -> bytes | None:
        """A packed file's bytes (``run_id`` None: a campaign file), or ``None`` when the pack has no such file."""
        match = pc.field("path") == path
        match &= pc.field("run_id").is_null() if run_id is None else pc.field("run_id") == run_id
        records = self._file_records(match)
        return records[0]["data"] if records else None

    def _row(self, run_id: str) -> dict[str, object]:
        table = pq.read_table(self.path / INDEX_FILE, filters=pc.field("run_id") == run_id)
        if not table.num_rows:
            raise ResultsError(f"{self.path} holds no run {run_id!r} (`cdbench pack --list {self.path}` lists them)")
        return table.to_pylist()[0]

    def _arrow_table(self, name: str, run_id: str, schema_bytes: bytes) -> pa.Table:
        schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
        table = pq.read_table(self.path / name, columns=schema.names,
                              filters=pc.field("run_id") == run_id)
        # back to the run's own types and pandas metadata, so the frame equals the folder's read_parquet
        return _ticks_as_seconds(table).cast(schema)

    def _table(self, name: str, run_id: str, schema_bytes: bytes | None) -> pd.DataFrame:
        if schema_bytes is None:
            return pd.DataFrame()
        table = self._arrow_table(name, run_id, schema_bytes)
        frame = table.to_pandas()
        for field in table.schema:
            if field.metadata and CATEGORIES_KEY in field.metadata:
                frame[field.name] = frame[field.name].cat.set_categories(json.loads(field.metadata[CATEGORIES_KEY]))
        return frame

    def open(self, run_id: str) -> SavedRun:
        """The run ``run_id`` as :func:`~cdbench.results.run_folder.load_run` reads its folder."""
        row = self._row(run_id)
        source = PackedRunFiles(self, run_id)
        try:
            summary = json.loads(str(row["summary"]))
            config = yaml.safe_load(str(row["config"])) or {}
        except (ValueError, yaml.YAMLError) as err:
            raise ResultsError(f"{source.ref}: unreadable summary or config: {err}") from None
        requests, steps = (self._table(name, run_id, row[f"{name.removesuffix('.parquet')}_schema"])
                           for name in TABLES)
        return SavedRun(self.path / run_id, config, summary, (requests, steps), source=source)

    def unpack(self, dest: Path, progress: Progress | None = None) -> Path:
        """Write every run back as a run folder under ``dest`` (at its id) and the campaign files at their paths."""
        dest = Path(dest)
        for run_id in self.run_ids:
            row = self._row(run_id)
            folder = dest / run_id
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "summary.json").write_text(str(row["summary"]))
            (folder / "config.yaml").write_text(str(row["config"]))
            run = self.open(run_id)
            for name, frame in zip(TABLES, (run.requests, run.steps), strict=True):
                if row[f"{name.removesuffix('.parquet')}_schema"] is not None:
                    frame.to_parquet(folder / name, index=False)
            if progress is not None:
                progress(run_id)
        for record in self._file_records():
            target = dest / (record["path"] if record["run_id"] is None else f"{record['run_id']}/{record['path']}")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(record["data"])
        return dest

    def repack(self, dest: Path, progress: Progress | None = None, exact: bool = False) -> Path:
        """Write this pack again, in the current format, as the new pack folder ``dest``: the same runs (index
        rows, tables, each run's own schema) and files; ``exact`` as :func:`pack_runs` takes it (a pack whose
        steps are already ticks stays as it is)."""
        dest = _check_new(dest)
        index_rows = pq.read_table(self.path / INDEX_FILE).to_pylist()
        tables: dict[str, list[tuple[str, pa.Table]]] = {name: [] for name in TABLES}
        for row in index_rows:
            for name in TABLES:
                key = f"{name.removesuffix('.parquet')}_schema"
                if row[key] is not None:
                    table = self._arrow_table(name, str(row["run_id"]), row[key])
                    if not any(field.metadata and CATEGORIES_KEY in field.metadata for field in table.schema):
                        # a pack of a row group a run: the run's own dictionaries are its categories
                        row[key] = _run_schema(table)
                    tables[name].append((str(row["run_id"]), table))
            if progress is not None:
                progress(str(row["run_id"]))
        files = [_file_row(record["run_id"], record["path"], record["data"]) for record in self._file_records()]
        return _write_pack(dest, index_rows, tables, files, exact)


def open_run(ref: str | Path, stopped_ok: bool = True) -> SavedRun:
    """A run from a run folder or a ``<pack>::<run id>`` reference, as the code reads a run folder.

    A folder that kept only its summary and config is read with empty tables (``SavedRun.has_tables``).
    ``stopped_ok=False``: a run that stopped early (its summary has a ``run_status``) is refused in one line,
    from a folder or a pack alike.
    """
    path, run_id = split_ref(ref)
    if run_id is None:
        return load_run(path, tables_optional=True, stopped_ok=stopped_ok)
    run = Pack(path).open(run_id)
    status = status_of(run.summary)
    if status is not None and not stopped_ok:
        raise stopped_run_error(ref, status)
    return run


__all__ = ["PACK_SUFFIX", "REF_SEPARATOR", "Pack", "PackedRunFiles", "find_run_folders", "is_run_folder",
           "open_run", "pack_runs", "split_ref"]
