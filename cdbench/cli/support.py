"""What every command shares: the consoles, progress bars, and turning user mistakes into one line.

A user mistake (bad config, unknown backend, corpus, model or GPU, a missing
file) is printed as ``error: <what and why>`` on stderr with exit code 2 and
no traceback. Anything else is a bug or a failed run: its traceback goes to a
log file and the console gets one line saying where.

A run interrupted (Ctrl-C, SIGTERM) or failing keeps what it finished
(:mod:`cdbench.results.stopped_run`); its one line says how many requests
finished and where they are, and an interrupted run exits 130 (Ctrl-C) or
143 (SIGTERM), as a shell reports those signals.
"""

from __future__ import annotations

import os
import signal
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import click
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from cdbench.backends.engine_log import engine_log
from cdbench.backends.registry import UnknownBackendError
from cdbench.backends.vocab import UnknownVocabularyError
from cdbench.harness.costs.grammar_profile import ProfileError
from cdbench.harness.costs.hardware import SpecFileError, UnknownSpecError
from cdbench.reports.gate import GateError
from cdbench.reports.run_report import build_report
from cdbench.results.config_files import (
    ConfigError,
    apply_overrides,
    builtin_config_path,
    read_yaml_mapping,
)
from cdbench.results.output_folder import (
    Command,
    FolderInUseError,
    claim_folder,
    new_folder,
    release_folder,
)
from cdbench.results.run_folder import SavedRun, record_run
from cdbench.workloads.corpora import UnknownCorpusError
from cdbench.workloads.trace import TraceError

if TYPE_CHECKING:
    from cdbench.harness.config import RunConfig


def _console(stderr: bool = False) -> Console:
    # Rich assumes 80 columns when output is not a terminal (CI logs, pipes); tables need more.
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=140)


console = _console()
err_console = _console(stderr=True)

USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    GateError,
    UnknownBackendError,
    UnknownVocabularyError,
    UnknownSpecError,
    SpecFileError,
    ProfileError,
    UnknownCorpusError,
    TraceError,
    FolderInUseError,
    # A path the user gave that is the wrong kind of thing or off limits (``--out /``, a folder as a file).
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)
"""Exceptions that mean the user asked for something that cannot be done (exit code 2)."""


def _message(err: BaseException) -> str:
    # KeyError subclasses repr their argument; show the text itself.
    if isinstance(err, KeyError) and err.args:
        return str(err.args[0])
    return str(err)


def _notes(err: BaseException) -> str:
    """The notes added on the way up (e.g. what a stopped run saved), as ``; ``-joined text."""
    return "; ".join(getattr(err, "__notes__", ()))


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` and return the exit to raise."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


@contextmanager
def user_errors(log_file: Path | None = None) -> Iterator[None]:
    """Turn user mistakes into one line (exit 2) and other failures into one line plus a log (exit 1)."""
    try:
        yield
    except typer.Exit:
        raise
    except USER_ERRORS as err:
        notes = _notes(err)
        raise fail(_message(err) + (f" ({notes})" if notes else "")) from None
    except Exception as err:
        if log_file is None:
            raise
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log_file.write_text(traceback.format_exc())
        # the message, not the exception's class: the class names code the user never sees (it is in the log)
        notes = _notes(err)
        raise fail(f"{_message(err) or type(err).__name__} (details in {log_file}{'; ' + notes if notes else ''})",
                   code=1) from None


def print_workload_issues(run: SavedRun) -> None:
    """One console line counting what did not make it into the run's requests, and where each is listed."""
    issues = run.workload_issues
    if issues is not None and issues.total:
        console.print(f"[yellow]workload:[/] {issues.describe()} (each with its reason in "
                      f"{run.folder / issues.details})", highlight=False)


def print_forward_speed(run: SavedRun) -> None:
    """One console line on the forward speed, where it is not the calibration's own (1, given)."""
    speed = run.forward_speed
    if speed is not None and not (speed.is_one and speed.source == "given"):
        console.print(f"forward speed: {speed.describe()}", highlight=False, markup=False)


def print_spec_costs(run: SavedRun) -> None:
    """Where a ``model`` run's spec prices came from, one line each (a per-kind guess in yellow)."""
    coverage = run.spec_costs
    if coverage is None:
        return
    for line in coverage.lines():
        style = "yellow" if line.startswith(("warning", "no predictor", "cannot measure")) or "failed" in line else ""
        console.print(f"[{style}]{line}[/]" if style else line, highlight=False, markup=bool(style))


def progress_bar(transient: bool = False) -> Progress:
    """The progress bar every long command shows (on stderr, so stdout stays clean for tables)."""
    return Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=transient,
    )


# ----------------------------------------------------------------------------- run options (run, compare)

RUN_OPTION_PATHS: dict[str, tuple[str, ...]] = {
    "backend": ("backend.name",),
    "policy": ("policy.name",),
    "mode": ("mode",),
    "model": ("costs.model",),
    "gpu": ("costs.gpu",),
    "corpus": ("workload.corpus",),
    "requests": ("workload.num_requests",),
    "rate": ("workload.arrival.rate",),
    "seed": ("seed", "workload.seed"),  # one seed fixes both the requests and the run's own draws
}
"""Command-line option → the configuration paths it sets."""


def option_overrides(options: dict[str, Any]) -> dict[str, Any]:
    """Dotted-path overrides for the run options that were given (``None`` = not given).

    >>> option_overrides({"seed": 3, "corpus": "embedded,regex_from_json_schemas", "rate": None})
    {'seed': 3, 'workload.seed': 3, 'workload.corpus': ['embedded', 'regex_from_json_schemas']}
    """
    out: dict[str, Any] = {}
    for name, value in options.items():
        if value is None:
            continue
        if name == "corpus":
            value = [c.strip() for c in str(value).split(",") if c.strip()]
        for path in RUN_OPTION_PATHS[name]:
            out[path] = value
    return out

ConfigArg = Annotated[
    Path | None, typer.Argument(help="Run-config YAML; without it the built-in default (cdbench/configs/default.yaml).")
]
BackendOpt = Annotated[str | None, typer.Option("--backend", help="Grammar backend: xgrammar, llguidance, outlines, none.")]
PolicyOpt = Annotated[str | None, typer.Option("--policy", help="Scheduler policy preset: sglang or vllm.")]
ModeOpt = Annotated[str | None, typer.Option("--mode", help="model (profiled grammar costs), hybrid (real backend, modelled GPU) or live (real backend and GPU, wall clock; a CUDA host).")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Model for the cost model, e.g. qwen3-8b, or a spec file.")]
GpuOpt = Annotated[str | None, typer.Option("--gpu", help="GPU for the cost model, e.g. h100-sxm, h200, or a spec file.")]
CorpusOpt = Annotated[str | None, typer.Option("--corpus", help="Workload corpora, comma-separated: a name (embedded, ...) or a JSONL path.")]
RequestsOpt = Annotated[int | None, typer.Option("--requests", "-n", help="Number of requests.")]
RateOpt = Annotated[float | None, typer.Option("--rate", help="Arrival rate (requests per second).")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Seed of every random choice.")]
SetOpt = Annotated[
    list[str], typer.Option("--set", "-s", help="Any config path: --set scheduler.poll_interval_s=0.001 (repeatable).")
]


def parse_set_options(items: list[str]) -> dict[str, Any]:
    """``path=value`` strings to overrides; values are parsed as YAML (numbers, booleans, lists)."""
    import yaml

    from cdbench.results.config_files import ConfigError

    out: dict[str, Any] = {}
    for item in items:
        path, sep, raw = item.partition("=")
        if not sep or not path.strip():
            raise ConfigError(f"--set {item!r} is not PATH=VALUE (e.g. scheduler.overlap=false)")
        try:
            out[path.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ConfigError(f"--set {item!r}: {raw!r} is not a valid value") from None
    return out


def load_run_tree(config: Path | None, options: dict[str, Any], sets: list[str]) -> tuple[dict[str, Any], str]:
    """The configuration mapping: the file (or built-in default), then options, then ``--set`` values."""
    path = config if config is not None else builtin_config_path("default")
    source = str(config) if config is not None else "built-in default config"
    tree = read_yaml_mapping(path)
    tree = apply_overrides(tree, option_overrides(options))
    tree = apply_overrides(tree, parse_set_options(sets))
    return tree, source


def default_out_dir(prefix: str = "") -> Path:
    """``runs/<prefix><UTC timestamp>`` (:func:`output_folder` adds ``-2``, ... if it is taken)."""
    return Path("runs") / f"{prefix}{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


OverwriteOpt = Annotated[bool, typer.Option(
    "--overwrite", help="Replace what the --out folder holds (refused unless cdbench wrote it); without it, "
                        "a folder holding results is never written into.")]


def output_folder(out: Path | None, default: Path, command: Command, overwrite: bool = False,
                  identity: Any = None, resumable: bool = False, adopt: bool = False,
                  runs: Sequence[RunConfig] | Callable[[Path], Sequence[RunConfig]] = ()) -> Path:
    """The folder ``command`` writes into, claimed (see :func:`~cdbench.results.output_folder.claim_folder`):
    ``out``, or else ``default`` (made unique unless the command resumes there); else a one-line error, also
    where the folders of ``runs`` (or of those ``runs(folder)`` gives: a resumed command's runs still to do)
    would not fit on its disk (:func:`~cdbench.harness.footprint.disk_refusal`: refused before the folder is
    claimed)."""
    if out is None and not resumable:
        out = new_folder(default)
    folder = out if out is not None else default
    if callable(runs):
        runs = runs(folder)
    if runs:
        from cdbench.harness import footprint

        too_big = footprint.disk_refusal(footprint.folder_bytes(runs), folder)
        if too_big is not None:
            raise ConfigError(too_big)
    claim_folder(folder, command, identity=identity, resumable=resumable, overwrite=overwrite, adopt=adopt)
    context = click.get_current_context(silent=True)
    if context is not None:  # the claim lasts as long as the command (a test runs many commands in one process)
        context.call_on_close(lambda: release_folder(folder))
    return folder


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's ``KeyboardInterrupt`` so that a run stops the same way, keeping what it
    finished."""


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within: SIGTERM raises :class:`Terminated` (by default it ends the process on the spot, losing the run)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise Terminated("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def execute(run_config: RunConfig, out: Path, label: str = "") -> SavedRun:
    """Run a validated config with a progress bar, save and report; user mistakes become one-line errors.

    Callers validate (``validate_run_config``) before claiming ``out``, so a refused config leaves no folder.

    The bar shows each stage of the run (workload generation, then simulation), prefixed by ``label``.
    An interrupted run prints one line and exits 130 (Ctrl-C) or 143 (SIGTERM).
    """
    prefix = f"{label}: " if label else ""
    logged: list[str] = []
    # Native engine logging would cut through the progress bar and tables: it goes to a file of the run.
    try:
        with sigterm_interrupts(), engine_log() as logged, user_errors(out / "run.log"):
            with progress_bar(transient=True) as bar:
                task = bar.add_task(f"{prefix}starting", total=100)

                def show(stage: str, fraction: float) -> None:
                    bar.update(task, description=prefix + stage, completed=100 * fraction)

                saved = record_run(run_config, out, progress=show, finish=build_report)
    except KeyboardInterrupt as err:
        signum = signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT
        err_console.print(f"[bold yellow]interrupted[/] ({signum.name}): {_notes(err) or 'nothing was saved'}",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(128 + signum) from None
    finally:
        save_engine_log(logged, out)
    return saved


ENGINE_LOG_FILE = "engine_log.txt"
"""The file of a run folder listing what the grammar engine wrote to stderr during the run (when it did)."""


def save_engine_log(lines: list[str], folder: Path) -> None:
    """Write ``lines`` to the run folder's engine log (none: no file, a stale one removed)."""
    path = folder / ENGINE_LOG_FILE
    if lines:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{line}\n" for line in lines))
    else:
        path.unlink(missing_ok=True)


def print_engine_log(folders: list[Path]) -> None:
    """One console line counting what the grammar engine logged in these run folders, and where it is."""
    counts = {f / ENGINE_LOG_FILE: len((f / ENGINE_LOG_FILE).read_text().splitlines())
              for f in folders if (f / ENGINE_LOG_FILE).is_file()}
    total = sum(counts.values())
    if total:
        paths = list(counts)
        where = (str(paths[0]) if len(paths) == 1 else
                 f"{ENGINE_LOG_FILE} of {len(paths)} runs in {os.path.commonpath([p.parent for p in paths])}")
        console.print(f"[yellow]engine:[/] {total} line{'s' if total != 1 else ''} the grammar engine logged "
                      f"(listed in {where})", highlight=False, soft_wrap=True)
