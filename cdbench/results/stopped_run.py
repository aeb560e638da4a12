"""A run that stopped before its last request ended: what it finished, kept.

While a run goes, :class:`RecordSpill` writes the requests that ended into
``<folder>/requests.partial/`` and its steps into ``<folder>/steps.partial/``
(one Parquet file a batch, each written under a hidden name and renamed into
place whole), so even a run killed outright leaves them readable:
``pandas.read_parquet("<folder>/requests.partial")``. The run's memory then
holds no table: at its end the parts are joined into ``requests.parquet`` and
``steps.parquet`` and the folders removed.

When a run is interrupted (Ctrl-C, SIGTERM) or fails, ``run_folder.record_run``
saves what it finished as a run folder of its own kind: ``requests.parquet``
holds the requests that ended (outputs unchecked: ``valid`` is empty),
``steps.parquet`` every step so far, and the summary of those goes to
:data:`STOPPED_SUMMARY_FILE` instead of ``summary.json`` (which keeps meaning
"a finished run": sweeps rerun such a point, ``gate`` and ``fidelity`` refuse
it), with a ``run_status`` section (:class:`RunStatus`) saying how and why it
stopped and how many requests finished. ``cdbench report`` and
``cdbench compare`` read such a folder and label it.

>>> RunStatus(status="interrupted", reason="SIGINT", requests_done=120, requests_total=3000).describe()
'interrupted (SIGINT) after 120 of 3000 requests'
>>> RunStatus(status="failed", reason="out of KV slots", requests_done=0, requests_total=None).describe()
'failed (out of KV slots) after 0 requests'
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from cdbench.results.errors import ResultsError

if TYPE_CHECKING:
    from cdbench.harness.run import RunResult

PARTIAL_REQUESTS_DIR = "requests.partial"
PARTIAL_STEPS_DIR = "steps.partial"
ROW_GROUP = 1 << 17
"""Rows a row group of the joined tables holds (at least; a part is never split)."""
STOPPED_SUMMARY_FILE = "summary.stopped.json"
SPILL_INTERVAL_S = 2.0
"""Wall seconds between writes of the finished requests (each costs milliseconds)."""


class RunStatus(BaseModel):
    """The ``run_status`` section of a stopped run's summary."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["interrupted", "failed"]
    reason: str = Field(description="the signal (SIGINT, SIGTERM) or the error's message")
    requests_done: int = Field(description="requests that ended (finished or aborted) before the run stopped")
    requests_total: int | None = Field(description="the run's requests (None: stopped before they were built)")

    @classmethod
    def of(cls, error: BaseException, done: int, total: int | None) -> RunStatus:
        """The status of a run stopped by ``error`` (a ``KeyboardInterrupt`` is an interrupt)."""
        if isinstance(error, KeyboardInterrupt):
            return cls(status="interrupted", reason=str(error) or "SIGINT", requests_done=done, requests_total=total)
        message = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return cls(status="failed", reason=message, requests_done=done, requests_total=total)

    def counted(self) -> str:
        """``120 of 3000 requests`` (``0 requests`` when the total is unknown)."""
        of = f" of {self.requests_total}" if self.requests_total is not None else ""
        return f"{self.requests_done}{of} request{'s' if (self.requests_total or self.requests_done) != 1 else ''}"

    def describe(self) -> str:
        return f"{self.status} ({self.reason}) after {self.counted()}"

    def label(self) -> str:
        """A short label for tables: ``interrupted, 120 of 3000 done``."""
        return f"{self.status}, {self.counted().removesuffix(' requests').removesuffix(' request')} done"


class RecordSpill:
    """The run's :class:`~cdbench.harness.run.RecordSink`: the ended requests (in the run's order) into
    ``requests.partial/`` and the steps into ``steps.partial/`` as the run goes, one Parquet file a hand-over;
    at the end (or when it stops early) those parts are joined into ``requests.parquet`` and ``steps.parquet``
    (row groups of :data:`ROW_GROUP` rows), which the summary then reads back a row group at a time, so neither
    table is ever whole in memory."""

    def __init__(self, folder: Path, interval_s: float = SPILL_INTERVAL_S) -> None:
        self.folder = Path(folder)
        self.dir = self.folder / PARTIAL_REQUESTS_DIR
        self.steps_dir = self.folder / PARTIAL_STEPS_DIR
        self.interval_s = interval_s
        self.parts = 0
        self.result: RunResult | None = None
        self.total: int | None = None

    def _part(self, folder: Path, rows: pd.DataFrame) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.parts += 1
        name = f"part-{self.parts:06d}.parquet"
        hidden = folder / f".{name}"  # readers of the folder skip hidden files
        # (read back once, by _join: dictionaries only where they keep a categorical's categories, no statistics;
        # the joined tables are written with the defaults)
        categorical = [name for name, dtype in rows.dtypes.items() if isinstance(dtype, pd.CategoricalDtype)]
        rows.to_parquet(hidden, index=False, use_dictionary=categorical, write_statistics=False)
        hidden.replace(folder / name)

    def finished(self, requests: pd.DataFrame) -> None:
        if not requests.empty:
            self._part(self.dir, requests)

    def steps(self, steps: pd.DataFrame) -> None:
        if not steps.empty:
            self._part(self.steps_dir, steps)

    def close(self, valid: np.ndarray | None) -> RecordSpill:
        """Join the parts into the run's two tables (``valid`` filled in where given) and remove them."""
        from cdbench.harness.records import RequestTable, StepLog

        _join(self.dir, self.folder / "requests.parquet", RequestTable(0).to_frame(), valid)
        _join(self.steps_dir, self.folder / "steps.parquet", StepLog().to_frame(), None)
        return self

    def chunks(self, table: str, columns: Sequence[str]) -> Iterator[pd.DataFrame]:
        """``columns`` of the joined ``requests`` or ``steps`` table, a row group at a time."""
        source = pq.ParquetFile(self.folder / f"{table}.parquet")
        for group in range(source.num_row_groups):
            yield source.read_row_group(group, columns=list(columns)).to_pandas()

    def stopped(self, result: RunResult, total: int, error: BaseException) -> None:
        self.result, self.total = result, total

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.steps_dir, ignore_errors=True)


def _join(parts: Path, dest: Path, empty: pd.DataFrame, valid: np.ndarray | None) -> None:
    """The Parquet files of ``parts`` (in name order) as one file of row groups of :data:`ROW_GROUP` rows;
    ``empty``: the table's columns, for a run without rows. ``valid``: the ``valid`` codes of every row."""
    files = sorted(parts.glob("part-*.parquet")) if parts.is_dir() else []
    if not files:
        empty.to_parquet(dest, index=False)
        return
    hidden = dest.with_name(f".{dest.name}")
    writer: pq.ParquetWriter | None = None
    pending: list[pa.Table] = []
    held = written = 0

    def flush() -> None:
        nonlocal writer, pending, held, written
        table = pa.concat_tables(pending)
        if valid is not None:
            codes = valid[written:written + len(table)]
            checked = pa.array(codes == 1, mask=codes < 0)
            table = table.set_column(table.schema.get_field_index("valid"), "valid", checked)
        if writer is None:
            writer = pq.ParquetWriter(hidden, table.schema)
        writer.write_table(table, row_group_size=len(table))
        written += len(table)
        pending, held = [], 0

    for path in files:
        part = pq.read_table(path)
        pending.append(part)
        held += len(part)
        if held >= ROW_GROUP:
            flush()
    if pending:
        flush()
    writer.close()
    hidden.replace(dest)
    shutil.rmtree(parts, ignore_errors=True)


def stopped_run_error(where: str | Path, status: RunStatus | None) -> ResultsError:
    """The one-line refusal of a stopped run by a command that needs a finished one (``where``: its folder or
    ``PACK::RUN_ID``)."""
    what = f" ({status.describe()})" if status is not None else ""
    return ResultsError(f"{where} holds a run that stopped early{what}; `cdbench report` and `cdbench compare` "
                        "read it, this command needs a finished run")


def stopped_summary(folder: Path, stopped_ok: bool) -> Path:
    """The summary of a run folder without ``summary.json``: its :data:`STOPPED_SUMMARY_FILE` where
    ``stopped_ok``; else a one-line ``ResultsError`` saying what the folder holds."""
    path = folder / STOPPED_SUMMARY_FILE
    if path.is_file():
        if stopped_ok:
            return path
        try:
            status = status_of(json.loads(path.read_text()))
        except (ValueError, AttributeError):  # (read for the message only)
            status = None
        raise stopped_run_error(folder, status)
    if (folder / PARTIAL_REQUESTS_DIR).is_dir():
        raise ResultsError(f"{folder} holds a run that ended before saving (killed, or still running): the "
                           f"requests it finished are in {folder / PARTIAL_REQUESTS_DIR}/ (pandas.read_parquet "
                           "reads that folder)")
    raise ResultsError(f"{folder} is not a cdbench run folder (no summary.json)")


def status_of(summary: dict) -> RunStatus | None:
    """A summary's ``run_status`` (``None`` for a finished run)."""
    section = summary.get("run_status")
    return RunStatus.model_validate(section) if section is not None else None


__all__ = ["PARTIAL_REQUESTS_DIR", "STOPPED_SUMMARY_FILE", "RecordSpill", "RunStatus", "status_of",
           "stopped_run_error", "stopped_summary"]
__all__ = ["PARTIAL_REQUESTS_DIR", "PARTIAL_STEPS_DIR", "STOPPED_SUMMARY_FILE", "RecordSpill", "RunStatus", "status_of", "stopped_summary"]
