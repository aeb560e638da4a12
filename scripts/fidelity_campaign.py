"""The model-vs-hybrid fidelity campaign of issue 14: every cell's runs, its fidelity figures, and the report.

A cell group is (backend, policy, corpus set). Its capacity is the request throughput of one saturating
``hybrid`` run (every request arrives within the first second: ``--rate 1000``). Each load of the group
is a cell, run at ``load x capacity`` requests/s:

- ``hybrid-a``, ``hybrid-b`` (and with ``--noise-copies N`` up to N copies: ``hybrid-c``, ...): the same config
  and seed run again; the largest spread of a copy from ``hybrid-a`` is the cell's noise floor;
- ``model-own``: ``model`` mode replaying ``hybrid-a``'s in-situ profile
  (``--set costs.grammar_profile=<hybrid-a>/grammar_profile.json``);
- ``model-shipped`` (default corpus set only): ``model`` mode with the backend's shipped profile;
- with ``--model-defaults``, ``model-defaults``: ``model`` mode at its defaults, on any corpus set: every spec
  the shipped profile lacks is measured on demand into the campaign's own spec-cost store
  (``<out>/spec_store``), judged against issue 14's bar;
- with ``--out-of-sample``, ``hybrid-oos`` and ``model-oos``: the same config on another seed's workload
  (``--seed`` plus ``--oos-seed-offset``, 1000 by default), ``hybrid`` and ``model`` replaying ``hybrid-a``'s
  profile. ``model-own`` replays the profile on the very requests it was measured on; ``model-oos`` asks
  whether it also predicts requests it has not seen.

Each model run is judged against the hybrid run of its own workload (``cdbench fidelity hybrid-a model
--noise hybrid-a hybrid-b [--noise-run hybrid-c ...]``; ``hybrid-oos`` for ``model-oos``), with the copies'
spread as the noise floor: the own-profile and out-of-sample runs against issue 14's bar (5 % medians and throughput,
10 % p99s), the shipped-profile run against 15 % (medians, throughput) and 25 % (p99s); a cell's noise
widens its bar.

Runs go in parallel, each pinned to its own core (``--pin``; ``--cores-per-run N``: N cores of its own,
as a profile build with N cores had them: xgrammar compiles with threads) with one thread of OpenMP and
tokenizers, and a run folder that
already holds a ``summary.json`` is not run again. ``--deadline-s`` stops starting runs (and stops
running ones) so that the report is always written; cells left incomplete are listed as such.

Examples:
  python scripts/fidelity_campaign.py --out runs/fidelity-campaign --requests 200 --jobs 14 --pin
  python scripts/fidelity_campaign.py --out runs/fid-tiny --requests 30 --backends xgrammar \\
      --policies sglang --corpora default --loads 0.5 --jobs 2 --out-of-sample
  python scripts/fidelity_campaign.py --out runs/fidelity-campaign --report-only --report reports/fidelity
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from cdbench.reports.fidelity import (
    ACCEPTANCE_TOLERANCES,
    FidelityError,
    check_same_workload,
    evaluate_fidelity,
    fidelity_frame,
    write_fidelity,
)
from cdbench.results.run_folder import ResultsError, load_run

CORPUS_SETS: dict[str, list[str]] = {
    # the built-in default workload (embedded sample, its default kind mix)
    "default": [],
    "github_medium": ["--corpus", "jsonschemabench_github_medium"],
    "regex_choice": ["--corpus", "regex_from_json_schemas,choice_from_json_schema_enums",
                     "--set", "workload.kind_weights={regex: 0.5, choice: 0.5}"],
    # corpora no shipped profile holds (issue 27's out-of-sample campaign): JSON schemas only
    "glaive": ["--corpus", "jsonschemabench_glaiveai2k", "--set", "workload.kind_weights={json_schema: 1.0}"],
    "kubernetes": ["--corpus", "jsonschemabench_kubernetes_sampled",
                   "--set", "workload.kind_weights={json_schema: 1.0}"],
}
SHIPPED_TOLERANCES = {"median_ttft_ms": 15.0, "median_tpot_ms": 15.0, "request_throughput": 15.0,
                      "p99_ttft_ms": 25.0, "p99_tpot_ms": 25.0, "p99_itl_ms": 25.0}
SATURATING_RATE = 1000.0
CHECKED = tuple(ACCEPTANCE_TOLERANCES)


@dataclass
class Job:
    """One ``cdbench run``: its folder, its arguments after ``run``, and what to start once it finished."""

    folder: Path
    args: list[str]
    then: Callable[[Path], list[Job]] | None = None
    wall_s: float = 0.0
    error: str = ""
    reused: bool = False  # its folder already held a finished run

    @property
    def log(self) -> Path:
        """The run's console output, beside its folder (cdbench refuses an --out holding foreign files)."""
        return self.folder.with_name(self.folder.name + ".log")


@dataclass
class Campaign:
    out: Path
    requests: int
    seed: int
    jobs: int
    pin: bool
    first_core: int
    deadline: float
    cdbench: list[str]
    cores_per_run: int = 1
    finished: list[Job] = field(default_factory=list)
    failed: list[Job] = field(default_factory=list)
    skipped: list[Job] = field(default_factory=list)
    _cores: deque[str] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _procs: set[subprocess.Popen] = field(default_factory=set)

    def command(self, job: Job) -> list[str]:
        return [*self.cdbench, "run", *job.args, "--out", str(job.folder)]

    def _run(self, job: Job) -> Job:
        if (job.folder / "summary.json").is_file():
            job.reused = True
            return job
        with self._lock:
            core = self._cores.popleft() if self._cores else None
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        cmd = self.command(job)
        if core is not None:
            cmd = ["taskset", "-c", core, *cmd]
        job.folder.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        try:
            with open(job.log, "w") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                with self._lock:
                    self._procs.add(proc)
                try:
                    code = proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    code = None
                with self._lock:
                    self._procs.discard(proc)
        finally:
            if core is not None:
                with self._lock:
                    self._cores.append(core)
        job.wall_s = time.monotonic() - start
        if code is None:
            job.error = f"stopped at the campaign deadline after {job.wall_s:.0f} s"
        elif code != 0:
            lines = job.log.read_text(errors="replace").strip().splitlines()
            job.error = f"exit {code}: {lines[-1] if lines else ''}"
        return job

    def core_sets(self) -> list[str]:
        """The ``taskset -c`` core list of each of the ``jobs`` slots: ``cores_per_run`` consecutive cores each,
        from ``first_core`` on.

        >>> Campaign(Path("x"), 1, 1, 3, True, 2, 0.0, [], cores_per_run=2).core_sets()
        ['2-3', '4-5', '6-7']
        """
        n = self.cores_per_run
        starts = range(self.first_core, self.first_core + self.jobs * n, n)
        return [str(a) if n == 1 else f"{a}-{a + n - 1}" for a in starts]

    def execute(self, initial: list[Job]) -> None:
        """Run ``initial`` and whatever finished jobs start, ``jobs`` at a time; dependants first (a cell
        completes before new groups start), until the deadline."""
        if self.pin:
            self._cores.extend(self.core_sets())
        pending: deque[Job] = deque(initial)
        running: set[Future[Job]] = set()
        with ThreadPoolExecutor(self.jobs) as pool:
            while pending or running:
                while pending and len(running) < self.jobs and time.monotonic() < self.deadline:
                    running.add(pool.submit(self._run, pending.popleft()))
                if not running:
                    break
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    job = future.result()
                    if job.error:
                        self.failed.append(job)
                        print(f"[{time.strftime('%H:%M:%S')}] FAILED {job.folder}: {job.error}", flush=True)
                        continue
                    self.finished.append(job)
                    print(f"[{time.strftime('%H:%M:%S')}] done {job.folder} ({job.wall_s:.0f} s)", flush=True)
                    if job.then is not None:
                        pending.extendleft(reversed(job.then(job.folder)))
        self.skipped.extend(pending)


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def plan(args: argparse.Namespace, campaign: Campaign) -> list[Job]:
    """The capacity run of every group; each one, once finished, starts its cells' runs."""
    sets = [item for setting in args.set for item in ("--set", setting)]
    common = ["--requests", str(args.requests), "--seed", str(args.seed), *sets]
    oos_common = ["--requests", str(args.requests), "--seed", str(args.seed + args.oos_seed_offset), *sets]
    initial = []
    for corpus in args.corpora:
        for backend in args.backends:
            for policy in args.policies:
                group = campaign.out / f"{backend}-{policy}-{corpus}"
                if any(fnmatch.fnmatch(group.name, pattern) for pattern in args.exclude):
                    continue
                config = ["--backend", backend, "--policy", policy, *CORPUS_SETS[corpus]]
                base = [*config, *common]

                def cells(capacity_folder: Path, group=group, config=config, base=base, corpus=corpus) -> list[Job]:
                    capacity = _summary(capacity_folder)["request_throughput"]
                    jobs = []
                    for load in args.loads:
                        cell = group / f"load{load:g}"
                        rate = ["--rate", f"{load * capacity:.4g}"]
                        hybrid = [*base, "--mode", "hybrid", *rate]
                        model = [*base, "--mode", "model", *rate]
                        profile = ["--set", f"costs.grammar_profile={cell / 'hybrid-a' / 'grammar_profile.json'}"]
                        after_a = [Job(cell / "model-own", [*model, *profile])]
                        jobs.append(Job(cell / "hybrid-a", hybrid, then=lambda _, after=after_a: after))
                        jobs.extend(Job(cell / name, hybrid) for name in noise_copies(args.noise_copies)[1:])
                        if args.out_of_sample:  # hybrid-a's profile replayed on the other seed's requests
                            oos = [*config, *oos_common]
                            after_a.append(Job(cell / "model-oos", [*oos, "--mode", "model", *rate, *profile]))
                            jobs.append(Job(cell / "hybrid-oos", [*oos, "--mode", "hybrid", *rate]))
                        if corpus == "default":
                            jobs.append(Job(cell / "model-shipped", model))
                        if args.model_defaults:
                            store = ["--set", f"costs.spec_store={campaign.out / 'spec_store'}"]
                            jobs.append(Job(cell / "model-defaults", [*model, *store]))
                    return jobs

                saturating = [*base, "--mode", "hybrid", "--rate", f"{SATURATING_RATE:g}"]
                if args.capacity_from is not None:  # an earlier campaign's capacity: same rates, same workloads
                    (group / "capacity").mkdir(parents=True, exist_ok=True)
                    shutil.copy(args.capacity_from / group.name / "capacity" / "summary.json", group / "capacity")
                initial.append(Job(group / "capacity", saturating, then=cells))
    # The slowest groups first (outlines compiles, then github_medium's large schemas): their chains of
    # capacity -> hybrid -> model runs are the longest.
    return sorted(initial, key=lambda job: ("outlines" not in job.folder.parent.name,
                                           "github_medium" not in job.folder.parent.name))


# ----------------------------------------------------------------------------- evaluation and report


def noise_copies(count: int) -> list[str]:
    """The folder names of a cell's same-seed hybrid runs: hybrid-a, hybrid-b, ..."""
    return [f"hybrid-{chr(ord('a') + i)}" for i in range(count)]


def evaluate(out: Path, out_of_sample: bool = False, copies: int = 2) -> pd.DataFrame:
    """Every cell's fidelity (written into the cell as fidelity-own/, fidelity-shipped/ and, with
    ``out_of_sample``, fidelity-oos/), as one frame; the noise floor is over ``copies`` same-seed hybrid runs."""
    names = noise_copies(copies)
    rows = []
    for group in sorted(p for p in out.iterdir() if (p / "capacity").is_dir()):
        backend, policy, corpus = group.name.split("-", 2)
        try:
            capacity = _summary(group / "capacity")["request_throughput"]
        except OSError:
            rows.append({"backend": backend, "policy": policy, "corpus": corpus, "load": float("nan"),
                         "comparison": "all comparisons", "metric": "",
                         "verdict": "incomplete: its saturating capacity run did not finish"})
            continue
        for cell in sorted(p for p in group.iterdir() if p.name.startswith("load")):
            load = float(cell.name.removeprefix("load"))
            # (model run, the hybrid run of its workload, bar); the noise is always the seed's hybrid copies
            comparisons = [("model-own", "hybrid-a", ACCEPTANCE_TOLERANCES)]
            if corpus == "default":
                comparisons.append(("model-shipped", "hybrid-a", SHIPPED_TOLERANCES))
            if (cell / "model-defaults").is_dir():
                comparisons.append(("model-defaults", "hybrid-a", ACCEPTANCE_TOLERANCES))
            if out_of_sample:
                comparisons.append(("model-oos", "hybrid-oos", ACCEPTANCE_TOLERANCES))
            for model_name, reference, tolerances in comparisons:
                key = {"backend": backend, "policy": policy, "corpus": corpus, "load": load, "capacity_rps": capacity,
                       "comparison": model_name}
                try:
                    runs = {name: load_run(cell / name) for name in (reference, model_name)}
                    noise = {name: load_run(cell / name) for name in names}
                    check_same_workload(runs)
                    check_same_workload(noise)
                except (ResultsError, FidelityError) as err:
                    rows.append({**key, "metric": "", "verdict": f"incomplete: {err}"})
                    continue
                result = evaluate_fidelity({n: r.summary for n, r in runs.items()},
                                           [noise[name].summary for name in names], tolerances, names)
                # the CDFs draw the other copies only beside runs of their own workload
                write_fidelity(runs, result, cell / f"fidelity-{model_name.removeprefix('model-')}",
                               {name: noise[name] for name in names[1:]} if reference == "hybrid-a" else None)
                frame = fidelity_frame(result).drop(columns=["run"])
                for name, value in key.items():
                    frame.insert(list(key).index(name), name, value)
                workload = runs[reference].config["workload"]
                frame["rate_rps"] = workload["arrival"]["rate"]
                frame["seed"] = workload.get("seed")
                rows.extend(frame.to_dict("records"))
    return pd.DataFrame(rows)


def _cell_text(row: pd.Series) -> str:
    if pd.isna(row["error_pct"]):
        return "n/a"
    text = f"{row['error_pct']:+.1f}"
    if row["noise_pct"] > row["tolerance_pct"]:
        text += f" (n {row['noise_pct']:.1f})"
    return text if row["verdict"] == "within" else f"**{text}** ✗"


def _comparison_table(frame: pd.DataFrame) -> list[str]:
    checked = frame[frame["metric"].isin(CHECKED)]
    header = ["backend", "policy", "corpus", "load", "rate/s", *CHECKED, "pass"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for key, cell in checked.groupby(["backend", "policy", "corpus", "load"], sort=True):
        by_metric = cell.set_index("metric")
        values = [_cell_text(by_metric.loc[m]) if m in by_metric.index else "-" for m in CHECKED]
        ok = (cell["verdict"] == "within").all()
        lines.append("| " + " | ".join([*map(str, key[:3]), f"{key[3]:g}", f"{cell['rate_rps'].iloc[0]:.3g}",
                                         *values, "yes" if ok else "no"]) + " |")
    return lines


def _seeds(part: pd.DataFrame) -> str:
    return ", ".join(str(seed) for seed in sorted({int(s) for s in part["seed"].dropna()})) or "unknown"


def write_report(frame: pd.DataFrame, out: Path, report_dir: Path, command: str, campaign: Campaign | None,
                 copies: int = 2) -> Path:
    report_dir.mkdir(parents=True, exist_ok=True)
    frame.to_csv(report_dir / "campaign.csv", index=False)
    complete = frame[frame["metric"] != ""]
    lines = ["# Fidelity: model mode vs hybrid mode", "",
             "Generated by `scripts/fidelity_campaign.py`; every figure below is read from the run folders it wrote.",
             "", "## Command", "", "```", command, "```", ""]
    if campaign is not None:
        reused = sum(job.reused for job in campaign.finished)
        lines += [(f"Runs finished: {len(campaign.finished) - reused} (and {reused} reused from earlier), "
                   f"failed: {len(campaign.failed)}, "
                  f"not started (deadline): {len(campaign.skipped)}."), ""]
        for job in campaign.failed:
            lines.append(f"- failed: `{job.folder.relative_to(out)}`: {job.error}")
        for job in campaign.skipped:
            lines.append(f"- not started: `{job.folder.relative_to(out)}`")
        lines.append("")
    sections = (("model-own", "hybrid-a", ("model with the run's own in-situ profile vs that hybrid run "
                 "(bar: 5 % medians and throughput, 10 % p99s, or the cell's noise if larger)")),
                ("model-shipped", "hybrid-a", ("model with the shipped default profile vs hybrid, default "
                 "workload (bar: 15 % medians and throughput, 25 % p99s, or the noise)")),
                ("model-defaults", "hybrid-a", ("model at its defaults (every spec the shipped profile lacks "
                 "measured on demand) vs hybrid (bar: 5 % medians and throughput, 10 % p99s, or the noise)")),
                ("model-oos", "hybrid-oos", ("out of sample: model replaying hybrid-a's in-situ profile on another "
                 "seed's workload vs hybrid on that workload (bar: 5 % medians and throughput, 10 % p99s, or the "
                 "cell's noise if larger)")))
    for comparison, reference, title in sections:
        part = complete[complete["comparison"] == comparison]
        if part.empty:
            continue
        checked = part[part["metric"].isin(CHECKED)]
        cells = checked.groupby(["backend", "policy", "corpus", "load"])["verdict"].apply(lambda v: (v == "within").all())
        lines += [f"## {title}", "", (f"Cells passing: {int(cells.sum())} of {len(cells)}; figures within their bar: "
                  f"{int((checked['verdict'] == 'within').sum())} of {len(checked)}."), ""]
        if comparison == "model-oos":
            lines += [(f"Profiles measured on seed {_seeds(complete[complete['comparison'] == 'model-own'])}, "
                       f"replayed (model-oos) and measured again (hybrid-oos) on seed {_seeds(part)}."), ""]
        lines += [(f"Signed relative error of model against {reference}, in percent; `(n X)`: the cell's noise floor "
                   f"X % (the largest |hybrid-a vs {' / '.join(noise_copies(copies)[1:])}|) when it exceeds the "
                   "tolerance; bold ✗: beyond the bar."), "",
                  *_comparison_table(part), ""]
    incomplete = frame[frame["metric"] == ""]
    for _, row in incomplete.iterrows():
        load = "every load" if pd.isna(row["load"]) else f"load {row['load']:g}"
        lines.append(f"- incomplete: {row['backend']}/{row['policy']}/{row['corpus']}/{load} "
                     f"({row['comparison']}): {row['verdict']}")
    md = report_dir / "campaign.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the run folders")
    parser.add_argument("--report", type=Path, default=None, help="folder of campaign.md/.csv (default: --out)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--backends", type=lambda s: s.split(","), default=["xgrammar", "llguidance", "outlines"])
    parser.add_argument("--policies", type=lambda s: s.split(","), default=["sglang", "vllm"])
    parser.add_argument("--corpora", type=lambda s: s.split(","), default=list(CORPUS_SETS))
    parser.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 0.9])
    parser.add_argument("--capacity-from", type=Path, default=None,
                        help="take each group's capacity from this earlier campaign folder instead of running it")
    parser.add_argument("--exclude", action="append", default=[],
                        help="skip the groups (BACKEND-POLICY-CORPUS) matching this glob, e.g. 'outlines-*-default'")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--pin", action="store_true", help="pin each run to its own core (taskset)")
    parser.add_argument("--first-core", type=int, default=0,
                        help="with --pin: runs use cores first..first+jobs*cores_per_run-1")
    parser.add_argument("--cores-per-run", type=int, default=1,
                        help="with --pin: consecutive cores each run gets (xgrammar compiles with threads)")
    parser.add_argument("--deadline-s", type=float, default=float("inf"), help="start no run after this many seconds")
    parser.add_argument("--noise-copies", type=int, default=2,
                        help="same-seed hybrid runs per cell (hybrid-a, hybrid-b, ...); their spread is the noise floor")
    parser.add_argument("--report-only", action="store_true", help="only evaluate existing runs and write the report")
    parser.add_argument("--out-of-sample", action="store_true",
                        help="also run and judge hybrid-oos and model-oos: hybrid-a's profile on another seed's workload")
    parser.add_argument("--model-defaults", action="store_true",
                        help="also run and judge model-defaults: model mode at its defaults, measuring what it lacks")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run of the campaign (repeatable)")
    parser.add_argument("--oos-seed-offset", type=int, default=1000,
                        help="with --out-of-sample: the other workload's seed is --seed plus this")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.corpora) - set(CORPUS_SETS))
    if unknown:
        parser.error(f"unknown corpus set(s) {', '.join(unknown)} (known: {', '.join(CORPUS_SETS)})")
    if args.noise_copies < 2:
        parser.error("--noise-copies must be at least 2: the noise floor is a spread between same-seed runs")
    if args.oos_seed_offset == 0:
        parser.error("--oos-seed-offset 0 gives the out-of-sample runs hybrid-a's own seed: they would be in sample")
    return args


def main() -> None:
    args = parse_args()
    command = "python scripts/fidelity_campaign.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    cdbench = [sys.executable, "-c", "from cdbench.cli.app import app; app()"]
    if shutil.which("cdbench") and Path(shutil.which("cdbench")).parent == Path(sys.executable).parent:
        cdbench = [shutil.which("cdbench")]
    campaign = Campaign(args.out, args.requests, args.seed, args.jobs, args.pin, args.first_core,
                        time.monotonic() + args.deadline_s, cdbench, args.cores_per_run)
    if not args.report_only:
        initial = plan(args, campaign)
        started = time.monotonic()
        campaign.execute(initial)
        print(f"runs took {time.monotonic() - started:.0f} s", flush=True)
        with open(args.out / "commands.txt", "w") as f:
            f.writelines("cdbench run " + " ".join(shlex.quote(a) for a in job.args) + f" --out {job.folder}\n" for job in [*campaign.finished, *campaign.failed] if not job.reused)
    frame = evaluate(args.out, args.out_of_sample, args.noise_copies)
    md = write_report(frame, args.out, args.report or args.out, command, None if args.report_only else campaign,
                      args.noise_copies)
    print(f"report: {md}")


if __name__ == "__main__":
    main()
