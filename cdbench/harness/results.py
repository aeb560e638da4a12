"""A run folder: writing one from a finished run, and reading it back.

Layout (every file written by :func:`save_run`)::

    <folder>/
      config.yaml        the resolved RunConfig (every default filled in)
      requests.parquet   one row a request (columns: cdbench.harness.records.RequestRecord)
      steps.parquet      one row a scheduler iteration (cdbench.harness.records.StepRecord)
      trace.json         Chrome / Perfetto trace of the first steps of the timeline
      summary.json       the summary (vLLM serving-benchmark names where they exist); written last
      report.md, plots/  the report (cdbench.reports.run_report), rebuildable with ``cdbench report``
      run.log            the traceback, if the run failed

``summary.json`` is written last, so its presence marks a finished run (sweeps
skip such folders when resuming).

Examples
--------
>>> import tempfile
>>> load_run(Path(tempfile.mkdtemp()) / "missing")
Traceback (most recent call last):
...
cdbench.harness.results.ResultsError: ... is not a cdbench run folder (no summary.json)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import yaml

from cdbench.harness.config_io import ConfigError, dump_config, validate_config
from cdbench.reports.trace import chrome_trace

if TYPE_CHECKING:
    from cdbench.harness.config import RunConfig
    from cdbench.harness.run import RunResult

TRACE_MAX_SPANS = 200_000
"""Spans kept in ``trace.json`` (the earliest ones); Perfetto stays responsive well past this."""


class ResultsError(FileNotFoundError):
    """A folder that is not a (complete) run folder."""


@dataclass(frozen=True)
class SavedRun:
    """A run as stored on disk: its resolved config, summary, and per-request / per-step tables."""

    folder: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    requests: pd.DataFrame
    steps: pd.DataFrame

    @property
    def label(self) -> str:
        return self.folder.name

    def trace_note(self) -> str:
        """What ``trace.json`` holds when it was capped (empty when it holds everything)."""
        path = self.folder / "trace.json"
        if not path.is_file():
            return ""
        meta = json.loads(path.read_text()).get("otherData", {})
        return meta.get("note", "")


def validate_run_config(tree: Mapping[str, Any], source: str = "config") -> RunConfig:
    """A :class:`RunConfig` from a mapping, or a one-line :class:`ConfigError`."""
    from cdbench.harness.config import RunConfig

    return validate_config(RunConfig, tree, source)


def save_run(result: RunResult, config: RunConfig, folder: Path, trace_max_spans: int = TRACE_MAX_SPANS) -> SavedRun:
    """Write ``result`` into ``folder`` (created; existing files replaced)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").unlink(missing_ok=True)  # a half-rewritten folder must not look finished
    dump_config(config, folder / "config.yaml")
    result.requests.to_parquet(folder / "requests.parquet", index=False)
    result.steps.to_parquet(folder / "steps.parquet", index=False)
    timeline = result.timeline
    # The scheduler records spans of the first max_steps iterations only (RunConfig.trace_steps).
    partial = timeline.steps_seen >= timeline.max_steps and len(result.steps) > timeline.steps_seen
    note = f"only the first {timeline.steps_seen} of {len(result.steps)} iterations were recorded" if partial else ""
    chrome_trace(timeline.spans, max_spans=trace_max_spans, recorded_note=note).write(folder / "trace.json")
    summary = json.loads(result.summary.model_dump_json())  # strict JSON: NaN becomes null
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return SavedRun(folder, config.model_dump(mode="json"), summary, result.requests, result.steps)


def load_run(folder: Path) -> SavedRun:
    """Read a run folder written by :func:`save_run`; raises :class:`ResultsError` when it is not one."""
    folder = Path(folder)
    if not (folder / "summary.json").is_file():
        raise ResultsError(f"{folder} is not a cdbench run folder (no summary.json)")
    for name in ("config.yaml", "requests.parquet", "steps.parquet"):
        if not (folder / name).is_file():
            raise ResultsError(f"run folder {folder} is incomplete: {name} is missing")
    try:
        config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
        summary = json.loads((folder / "summary.json").read_text())
        requests = pd.read_parquet(folder / "requests.parquet")
        steps = pd.read_parquet(folder / "steps.parquet")
    except (ValueError, OSError, yaml.YAMLError) as err:
        raise ResultsError(f"run folder {folder} has an unreadable file: {err}") from None
    return SavedRun(folder, config, summary, requests, steps)


def record_run(
    config: RunConfig,
    folder: Path,
    progress: Callable[[str, float], None] | None = None,
    report: bool = True,
) -> SavedRun:
    """Run ``config``, save it into ``folder`` and (by default) build its report.

    ``progress`` is handed to :func:`cdbench.harness.run.run`, then told the
    stage ``saving the results and the report``. Raises
    :class:`ConfigError` for a configuration the run rejects.
    """
    from cdbench.harness.run import run
    from cdbench.reports.run_report import build_report

    result = run(config, progress=progress)
    if progress is not None:
        progress("saving the results and the report", 1.0)
    saved = save_run(result, config, folder)
    if report:
        build_report(saved)
    return saved


__all__ = ["ConfigError", "ResultsError", "SavedRun", "load_run", "record_run", "save_run", "validate_run_config"]
