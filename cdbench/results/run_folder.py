"""A run folder: writing one from a finished run, and reading it back.

Layout (every file written by :func:`save_run`)::

    <folder>/
      config.yaml        the resolved RunConfig (every default filled in)
      requests.parquet   one row a request (columns: cdbench.harness.records.RequestRecord)
      steps.parquet      one row a scheduler iteration (cdbench.harness.records.StepRecord)
      trace.json         Chrome / Perfetto trace of the first steps of the timeline
      workload.trace.jsonl   the run's requests as a replayable workload trace (docs/trace_format.md):
                         ``--set workload.trace=<folder>/workload.trace.jsonl`` runs them again
      workload_issues.json   what did not make it into the requests: corpus lines skipped, specs with
                         no valid instance, ... (cdbench.workloads.workload.WorkloadReport)
      grammar_profile.json   hybrid runs: the grammar costs the run measured, per kind and per spec
                         (cdbench.harness.costs.grammar_profile.GrammarProfile):
                         ``--mode model --set costs.grammar_profile=<folder>/grammar_profile.json``
                         replays them
      live.json          live runs: the GPU, torch version, KV slots and captured graphs
      rank_steps.parquet runs of several rank processes: each rank's own step records
                         (cdbench.harness.live.rank_steps)
      report.md, plots/  the report (cdbench.reports.run_report), rebuildable with ``cdbench report``
      summary.json       the summary (vLLM serving-benchmark names where they exist); written last
      summary.stopped.json   instead of summary.json, for a run interrupted or failed: the summary of the
                         requests it finished, with its run_status (cdbench.results.stopped_run)
      requests.partial/  while a run goes: its ended requests in the run's order, one Parquet file a batch
      steps.partial/     while a run goes: its steps, likewise (both joined into the tables at its end)
      run.log            the traceback, if the run failed
      engine_log.txt     what native code (the grammar engine) wrote to stderr during the run, when it did
                         (written by the CLI: cdbench.cli.support.save_engine_log)
      .cdbench.json      the command that claimed the folder (cdbench.results.output_folder)

``summary.json`` is written last, after the report, so its presence marks a
finished run (sweeps skip such folders when resuming).

Examples
--------
>>> import tempfile
>>> load_run(Path(tempfile.mkdtemp()) / "missing")
Traceback (most recent call last):
...
cdbench.results.run_folder.ResultsError: ... is not a cdbench run folder (no summary.json)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pandas as pd
import pyarrow.parquet as pq
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cdbench.harness.live.rank_steps import RANK_STEPS_FILE
from cdbench.results.chrome_trace import chrome_trace
from cdbench.results.config_files import ConfigError, dump_config
from cdbench.results.errors import ResultsError
from cdbench.results.stopped_run import RecordSpill, RunStatus, stopped_summary

READ_ROWS = 1 << 14
"""Rows of a saved table handed on at a time (:meth:`SavedRun.chunks`): a row group (``ROW_GROUP``, 8 times as
many) is read whole and converted and worked on in slices this long, which lowered the report's own peak over a
million requests' tables from 603.5 to 535.4 MiB (``reports/scheduler_benchmark.md``, 2026-11-28). Arrow's batch
reader (``iter_batches``) reads ahead: 973 MiB."""

if TYPE_CHECKING:
    from cdbench.harness.config import RunConfig
    from cdbench.harness.costs.forward_speed import ForwardSpeed
    from cdbench.harness.costs.spec_costs import SpecCoverage
    from cdbench.harness.run import RunResult
    from cdbench.workloads.workload import WorkloadReport

Section = TypeVar("Section", bound=BaseModel)

TRACE_MAX_SPANS = 200_000
"""Spans kept in ``trace.json`` (the earliest ones); Perfetto stays responsive well past this."""

WORKLOAD_TRACE_FILE = "workload.trace.jsonl"
WORKLOAD_ISSUES_FILE = "workload_issues.json"
GRAMMAR_PROFILE_FILE = "grammar_profile.json"
LIVE_FILE = "live.json"


class WorkloadIssues(BaseModel):
    """The ``workload_issues`` section of ``summary.json``: how much of the asked-for workload was lost,
    and which file of the run folder lists each item with its reason."""

    model_config = ConfigDict(extra="forbid")

    skipped_corpus_lines: int = Field(description="corpus lines that did not load (file:line and reason in details)")
    spec_failures: int = Field(description="specs with no valid oracle instance, left out of the workload")
    bad_trace_lines: int = Field(description="lines of a replayed trace that did not load")
    duplicate_specs: int = Field(description="corpus items dropped because an earlier item has the same spec")
    details: str = WORKLOAD_ISSUES_FILE

    @classmethod
    def of(cls, report: WorkloadReport) -> WorkloadIssues:
        return cls(skipped_corpus_lines=report.skipped_line_count, spec_failures=report.spec_failure_count,
                   bad_trace_lines=report.bad_trace_line_count, duplicate_specs=report.duplicate_spec_count)

    @property
    def total(self) -> int:
        return self.skipped_corpus_lines + self.spec_failures + self.bad_trace_lines + self.duplicate_specs

    def describe(self) -> str:
        """One line, e.g. ``2 corpus lines skipped, 1 spec without a valid instance`` (empty when none)."""
        counts = ((self.skipped_corpus_lines, "corpus line", "skipped"),
                  (self.spec_failures, "spec", "without a valid instance"),
                  (self.bad_trace_lines, "trace line", "skipped"),
                  (self.duplicate_specs, "corpus item", "dropped as a duplicate spec"))
        return ", ".join(f"{n} {noun}{'s' if n != 1 else ''} {what}" for n, noun, what in counts if n)


class RunSource(Protocol):
    """Where a run not read from its own folder came from (a pack, :mod:`cdbench.results.pack`)."""

    @property
    def ref(self) -> str:
        """How the user names the run, e.g. ``<pack>::<run id>``."""
        ...

    def read(self, name: str) -> bytes | None:
        """The bytes of the run's file ``name`` (e.g. ``workload.trace.jsonl``); ``None`` when it has none."""
        ...


@dataclass(frozen=True)
class SavedRun:
    """A run as stored on disk: its resolved config, summary, and per-request / per-step tables.

    ``tables`` holds the ``requests`` and ``steps`` frames in memory; ``None``: they are in the folder's
    Parquet files, read whole the first time :attr:`requests` or :attr:`steps` is asked for, or a row
    group at a time by :meth:`chunks` (a run of millions of requests, whose report reads them so).
    ``source`` is set for a run read out of a pack: ``folder`` is then the pack's path joined with the
    run's id (no such folder exists), and the run's other files are read through ``source``. A run saved
    without its tables (a campaign that kept only summaries and configs) has empty ``requests`` and
    ``steps`` frames with no columns (:attr:`has_tables`).
    """

    folder: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    tables: tuple[pd.DataFrame, pd.DataFrame] | None = None
    source: RunSource | None = None

    @cached_property
    def requests(self) -> pd.DataFrame:
        return self.tables[0] if self.tables is not None else pd.read_parquet(self.folder / TABLES[0])

    @cached_property
    def steps(self) -> pd.DataFrame:
        return self.tables[1] if self.tables is not None else pd.read_parquet(self.folder / TABLES[1])

    def chunks(self, table: str, columns: Sequence[str]) -> Iterator[pd.DataFrame]:
        """``columns`` of the ``requests`` or ``steps`` table in row order: the frame in memory, or the folder's
        Parquet file a row group at a time, handed on :data:`READ_ROWS` rows at a time (the whole table never
        held)."""
        if self.tables is not None or table in self.__dict__:
            yield getattr(self, table)[list(columns)]
            return
        source = pq.ParquetFile(self.folder / f"{table}.parquet")
        for group in range(source.num_row_groups):
            rows = source.read_row_group(group, columns=list(columns))
            for start in range(0, max(rows.num_rows, 1), READ_ROWS):
                yield rows.slice(start, READ_ROWS).to_pandas()

    @property
    def label(self) -> str:
        return self.folder.name

    @property
    def ref(self) -> str:
        """The run as the user names it: its folder, or ``<pack>::<run id>``."""
        return str(self.folder) if self.source is None else self.source.ref

    @property
    def has_tables(self) -> bool:
        """Whether the per-request table was saved (a summary-only run has none)."""
        if self.tables is None and "requests" not in self.__dict__:
            return (self.folder / TABLES[0]).is_file()
        return not self.requests.columns.empty

    def read_file(self, name: str) -> bytes | None:
        """The bytes of one of the run's files (``name`` relative to the run folder); ``None`` when absent."""
        if self.source is not None:
            return self.source.read(name)
        path = self.folder / name
        return path.read_bytes() if path.is_file() else None

    def _summary_section(self, key: str, model: type[Section]) -> Section | None:
        """The summary's ``key`` section as ``model`` (``None`` when the summary has none)."""
        section = self.summary.get(key)
        if section is None:
            return None
        try:
            return model.model_validate(section)
        except ValidationError as err:
            raise ResultsError(f"run folder {self.folder}: summary.json's {key} is malformed: "
                               f"{err.errors()[0]['msg']}") from None

    @property
    def workload_issues(self) -> WorkloadIssues | None:
        """The summary's ``workload_issues`` section (``None`` for a run built from hand-made requests)."""
        return self._summary_section("workload_issues", WorkloadIssues)

    @property
    def forward_speed(self) -> ForwardSpeed | None:
        """The forward speed that priced the run's steps (``None``: not priced, or a run from before)."""
        from cdbench.harness.costs.forward_speed import ForwardSpeed

        return self._summary_section("forward_speed", ForwardSpeed)

    @property
    def spec_costs(self) -> SpecCoverage | None:
        """Where a ``model`` run's spec prices came from (``None``: another mode, or a run from before)."""
        from cdbench.harness.costs.spec_costs import SpecCoverage

        return self._summary_section("spec_costs", SpecCoverage)

    def trace_note(self) -> str:
        """What ``trace.json`` holds when it was capped (empty when it holds everything)."""
        data = self.read_file("trace.json")
        if data is None:
            return ""
        meta = json.loads(data).get("otherData", {})
        return meta.get("note", "")


Finisher = Callable[["SavedRun"], None]
"""Called on a run just saved, before its ``summary.json`` is written (e.g. a report builder)."""


def save_run(result: RunResult, config: RunConfig, folder: Path, trace_max_spans: int = TRACE_MAX_SPANS,
             finish: Finisher | None = None, status: RunStatus | None = None) -> SavedRun:
    """Write ``result`` into ``folder`` (created; existing files replaced), then call ``finish`` on it.

    ``status``: the run stopped early; its summary (with ``run_status``) goes to ``summary.stopped.json``.

    ``finish`` adds what is derived from the saved run (the CLI passes the
    report builder). ``summary.json`` is written after everything else,
    ``finish`` included, so a folder holding one is complete.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").unlink(missing_ok=True)  # a half-rewritten folder must not look finished
    dump_config(config, folder / "config.yaml")
    if not result.tables_written:  # (a run that streamed its tables wrote them already)
        result.requests.to_parquet(folder / "requests.parquet", index=False)
        result.steps.to_parquet(folder / "steps.parquet", index=False)
    steps = pq.ParquetFile(folder / "steps.parquet").metadata.num_rows
    timeline = result.timeline
    # The scheduler records spans of the first max_steps iterations only (RunConfig.trace_steps).
    partial = timeline.steps_seen >= timeline.max_steps and steps > timeline.steps_seen
    note = f"only the first {timeline.steps_seen} of {steps} iterations were recorded" if partial else ""
    chrome_trace(timeline.spans, max_spans=trace_max_spans, recorded_note=note).write(folder / "trace.json")
    summary = json.loads(result.summary.model_dump_json())  # strict JSON: NaN becomes null
    if result.workload is not None:
        from cdbench.workloads.trace import write_trace

        workload_report = result.workload.report()
        (folder / WORKLOAD_ISSUES_FILE).write_text(workload_report.model_dump_json(indent=2) + "\n")
        write_trace(result.workload, folder / WORKLOAD_TRACE_FILE)
        summary["workload_issues"] = WorkloadIssues.of(workload_report).model_dump()
    if result.grammar_profile is not None:
        result.grammar_profile.save(folder / GRAMMAR_PROFILE_FILE)
    if result.live is not None:
        (folder / LIVE_FILE).write_text(json.dumps(dataclasses.asdict(result.live), indent=2) + "\n")
    if result.rank_steps is not None:
        result.rank_steps.to_parquet(folder / RANK_STEPS_FILE, index=False)
    if status is not None:
        summary["run_status"] = status.model_dump()
    # a streamed run's tables stay on disk: the report reads them a slice of a row group at a time
    tables = None if result.tables_written else (result.requests, result.steps)
    saved = SavedRun(folder, config.model_dump(mode="json"), summary, tables)
    if finish is not None:
        finish(saved)
    summary_file = "summary.json" if status is None else "summary.stopped.json"
    (folder / summary_file).write_text(json.dumps(summary, indent=2) + "\n")
    return saved


TABLES = ("requests.parquet", "steps.parquet")
"""The run folder's per-request and per-step tables (see ``tables_optional`` of :func:`load_run`)."""


def load_run(folder: Path, tables_optional: bool = False, stopped_ok: bool = True) -> SavedRun:
    """Read a run folder written by :func:`save_run`; raises :class:`ResultsError` when it is not one.

    ``tables_optional``: a missing table is read as an empty frame instead of refused. The committed
    campaigns kept only the summary and config of most runs; what compares runs needs their summaries.
    """
    folder = Path(folder)
    summary_file = folder / "summary.json"
    if not summary_file.is_file():  # a run that stopped early, read unless refused (``stopped_ok=False``)
        summary_file = stopped_summary(folder, stopped_ok)
    for name in ("config.yaml", *(() if tables_optional else TABLES)):
        if not (folder / name).is_file():
            raise ResultsError(f"run folder {folder} is incomplete: {name} is missing")
    try:
        config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
        summary = json.loads(summary_file.read_text())
        requests, steps = (pd.read_parquet(folder / name) if (folder / name).is_file() else pd.DataFrame()
                           for name in TABLES)
    except (ValueError, OSError, yaml.YAMLError) as err:
        raise ResultsError(f"run folder {folder} has an unreadable file: {err}") from None
    for name, data in (("summary.json", summary), ("config.yaml", config)):
        if not isinstance(data, dict):
            raise ResultsError(f"run folder {folder}: {name} must hold a mapping of keys, not {type(data).__name__}")
    return SavedRun(folder, config, summary, (requests, steps))


def record_run(
    config: RunConfig,
    folder: Path,
    progress: Callable[[str, float], None] | None = None,
    finish: Finisher | None = None,
) -> SavedRun:
    """Run ``config`` and save it into ``folder`` (``finish`` as in :func:`save_run`).

    ``progress`` is handed to :func:`cdbench.harness.run.run`, then told the
    stage ``saving the results``. Raises :class:`ConfigError` for a
    configuration the run rejects. A run interrupted or failing saves what it
    finished first (:func:`_save_stopped`), then raises
    on, the error carrying a note of what was saved and where.
    """
    from cdbench.harness.run import run

    spill = RecordSpill(folder)
    try:
        result = run(config, progress=progress, records=spill)
    except BaseException as err:
        status = _save_stopped(spill, err, config, folder, finish)
        err.add_note(f"{status.counted()} finished; they and their summary are in {folder}/")
        raise
    if progress is not None:
        progress("saving the results", 1.0)
    saved = save_run(result, config, folder, finish=finish)
    spill.remove()
    return saved


def _save_stopped(spill: RecordSpill, error: BaseException, config: RunConfig, folder: Path,
                 finish: Finisher | None = None) -> RunStatus:
    """Save what a run stopped by ``error`` finished into ``folder`` (see :mod:`cdbench.results.stopped_run`);
    returns its status.

    A run stopped before its simulation began (while building its workload or backend) finished nothing:
    its folder gets the config and a summary of no requests.
    """
    from cdbench.harness.run import empty_result

    result = spill.result if spill.result is not None else empty_result()
    status = RunStatus.of(error, result.summary.completed + result.summary.failed, spill.total)
    save_run(result, config, folder, finish=finish, status=status)
    spill.remove()
    return status


__all__ = ["TABLES", "ConfigError", "ResultsError", "RunSource", "SavedRun", "WorkloadIssues", "load_run",
           "record_run", "save_run"]
