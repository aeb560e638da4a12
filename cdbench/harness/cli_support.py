"""What every command shares: the consoles, progress bars, and turning user mistakes into one line.

A user mistake (bad config, unknown backend, corpus, model or GPU, a missing
file) is printed as ``error: <what and why>`` on stderr with exit code 2 and
no traceback. Anything else is a bug or a failed run: its traceback goes to a
log file and the console gets one line saying where.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from cdbench.backends.registry import UnknownBackendError
from cdbench.backends.vocab import UnknownVocabularyError
from cdbench.harness.config_io import ConfigError
from cdbench.harness.costs.grammar_profile import ProfileError
from cdbench.harness.costs.hardware import SpecFileError, UnknownSpecError
from cdbench.reports.gate import GateError
from cdbench.workloads.corpora import UnknownCorpusError
from cdbench.workloads.trace import TraceError

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
    FileNotFoundError,
)
"""Exceptions that mean the user asked for something that cannot be done (exit code 2)."""


def _message(err: BaseException) -> str:
    # KeyError subclasses repr their argument; show the text itself.
    if isinstance(err, KeyError) and err.args:
        return str(err.args[0])
    return str(err)


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
        raise fail(_message(err)) from None
    except Exception as err:
        if log_file is None:
            raise
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log_file.write_text(traceback.format_exc())
        raise fail(f"{type(err).__name__}: {_message(err)} (details in {log_file})", code=1) from None


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
