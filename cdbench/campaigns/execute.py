"""Running a campaign: every unfinished run as a local ``cdbench run`` process, resumable.

A run whose folder holds a ``summary.json`` is finished and never run again, so a rerun of the same campaign
runs only what is missing. Before a run starts, its configuration is written to
``<out>/.campaign/<run id>.yaml`` (its console to ``.log`` beside it); a finished run whose configuration
would now differ (the campaign file changed under it) is refused in one line instead of being mixed in.

Runs start when the runs their configuration refers to have finished (and those an arm's later copies wait
for have ended), ``jobs`` at a time, one at a time per ``lane``, and with ``pin``, each on cores of its own
(``os.sched_setaffinity`` in the child before it starts, so every thread it makes inherits them) with one
OpenMP / MKL / Rayon thread unless the runner says otherwise. On a GPU host the same command runs the campaign there.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cdbench.campaigns.plan import PlannedRun, folder_lookup, run_config
from cdbench.campaigns.spec import CampaignSpec
from cdbench.results.config_files import ConfigError

STATE_DIR = ".campaign"


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """What happened to one run: done, skipped (finished earlier), failed, blocked (a run it needs failed or
    never started) or not started (the deadline)."""

    run: PlannedRun
    status: str
    error: str | None = None
    wall_s: float = 0.0


def is_finished(folder: Path) -> bool:
    return (folder / "summary.json").is_file()


def config_path(out: Path, run: PlannedRun) -> Path:
    return Path(out) / STATE_DIR / f"{run.run_id}.yaml"


def _dump(tree: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(tree), sort_keys=True)


def check_finished_configs(spec: CampaignSpec, base: Mapping[str, Any], out: Path, runs: Sequence[PlannedRun]) -> None:
    """Refuse a campaign folder whose finished runs were made from another configuration than the file's now."""
    lookup = folder_lookup(out)
    for run in runs:
        saved = config_path(out, run)
        if is_finished(Path(out) / run.run_id) and saved.is_file():
            if saved.read_text() != _dump(run_config(spec, base, run, lookup, out)):
                raise ConfigError(f"campaign {spec.name}: finished run {run.run_id} was made from another "
                                  f"configuration than the campaign file gives it now ({saved}); rename the arm "
                                  "or give another --out")


def core_count(spec: CampaignSpec, run: PlannedRun) -> int:
    return spec.arms[run.arm].cores or spec.runner.cores_per_run


def usable_cores(spec: CampaignSpec) -> list[int]:
    """The cores pinned runs may use: this process's, from ``first_core`` on."""
    return sorted(c for c in os.sched_getaffinity(0) if c >= spec.runner.first_core)


def _env(spec: CampaignSpec) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if spec.runner.threads is not None:
        threads = str(spec.runner.threads)
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, RAYON_NUM_THREADS=threads)
    return env


@dataclass
class _Running:
    run: PlannedRun
    proc: subprocess.Popen[bytes]
    cores: list[int]
    start: float


def run_campaign(
    spec: CampaignSpec,
    base: Mapping[str, Any],
    runs: Sequence[PlannedRun],
    out: Path,
    command: Sequence[str],
    on_outcome: Callable[[RunOutcome], None] | None = None,
    deadline_s: float | None = None,
) -> list[RunOutcome]:
    """Run every unfinished run of ``runs`` into ``out/<run id>`` with ``command`` (the cdbench invocation,
    e.g. ``[sys.executable, "-m", "cdbench"]``); one outcome per run, in ``runs``' order.

    After ``deadline_s`` seconds no run starts and running ones are stopped (their outcome: failed).
    """
    out = Path(out)
    deadline = time.monotonic() + (deadline_s if deadline_s is not None else float("inf"))
    free_cores = usable_cores(spec) if spec.runner.pin else []
    if spec.runner.pin:  # only the runs still to do: finished ones (e.g. a GPU host's live runs) need no cores here
        for run in (r for r in runs if not is_finished(out / r.run_id)):
            if core_count(spec, run) > len(free_cores):
                raise ConfigError(f"campaign {spec.name}: arm {run.arm} needs {core_count(spec, run)} cores a run "
                                  f"and the runner may use {len(free_cores)} (cores {free_cores})")
    outcomes: dict[str, RunOutcome] = {}
    lookup = folder_lookup(out)
    env = _env(spec)

    def record(outcome: RunOutcome) -> None:
        outcomes[outcome.run.run_id] = outcome
        if on_outcome is not None:
            on_outcome(outcome)

    pending: list[PlannedRun] = []
    for run in runs:
        if is_finished(out / run.run_id):
            record(RunOutcome(run, "skipped"))
        else:
            pending.append(run)
    running: list[_Running] = []
    busy_lanes: set[str] = set()

    def start(run: PlannedRun, cores: list[int]) -> None:
        try:
            tree = run_config(spec, base, run, lookup, out)
        except ConfigError as err:
            record(RunOutcome(run, "failed", str(err)))
            return
        path = config_path(out, run)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_dump(tree))
        folder = out / run.run_id
        folder.parent.mkdir(parents=True, exist_ok=True)
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        with open(path.with_suffix(".log"), "wb") as log:
            proc = subprocess.Popen([*command, "run", str(path), "--out", str(folder), "--overwrite"],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=pin)
        running.append(_Running(run, proc, cores, time.monotonic()))
        lane = spec.arms[run.arm].lane
        if lane:
            busy_lanes.add(lane)
        for core in cores:
            free_cores.remove(core)

    def finish(job: _Running, code: int | None) -> None:
        running.remove(job)
        free_cores.extend(job.cores)
        free_cores.sort()
        busy_lanes.discard(spec.arms[job.run.arm].lane or "")
        wall = time.monotonic() - job.start
        if code == 0 and is_finished(out / job.run.run_id):
            record(RunOutcome(job.run, "done", wall_s=wall))
            return
        log = config_path(out, job.run).with_suffix(".log")
        lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
        reason = "stopped at the campaign deadline" if code is None else f"exit {code}: {lines[-1] if lines else ''}"
        record(RunOutcome(job.run, "failed", f"{reason} (console: {log})", wall))

    try:
        while pending or running:
            for job in list(running):
                code = job.proc.poll()
                if code is None and time.monotonic() > deadline:
                    job.proc.kill()
                    job.proc.wait()
                elif code is None:
                    continue
                finish(job, code)
            for run in list(pending):
                failed_dep = next((d for d in run.depends if d in outcomes and outcomes[d].status not in ("done", "skipped")),
                                  None)
                if failed_dep is not None:
                    pending.remove(run)
                    record(RunOutcome(run, "blocked", f"needs run {failed_dep}, which {outcomes[failed_dep].status}"))
                    continue
                if time.monotonic() > deadline or len(running) >= spec.runner.jobs:
                    continue
                if (any(d not in outcomes for d in (*run.depends, *run.waits_for))
                        or spec.arms[run.arm].lane in busy_lanes):
                    continue
                cores: list[int] = []
                if spec.runner.pin:
                    if len(free_cores) < core_count(spec, run):
                        continue
                    cores = free_cores[:core_count(spec, run)]
                pending.remove(run)
                start(run, cores)
            if time.monotonic() > deadline and not running:
                for run in pending:
                    record(RunOutcome(run, "not started", "the campaign deadline passed"))
                pending.clear()
            if running:
                time.sleep(0.2)
    finally:  # an interrupted campaign (Ctrl-C, an error) leaves no run going on without it
        for job in running:
            job.proc.kill()
            job.proc.wait()
    return [outcomes[run.run_id] for run in runs]
