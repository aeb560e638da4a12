"""Output folders: which command made one, and whether another may write into it.

Every command that writes a folder (``run``, ``compare``, ``sweep``,
``profile``, ``fidelity``) claims it first with :func:`claim_folder`, which leaves a marker
file, :data:`MARKER_FILE`, naming the command and, for the commands that
resume (``sweep``, ``profile``), what must stay the same for a rerun to
continue the folder's work. A claim is refused with :class:`FolderInUseError`
(one line, naming ``--overwrite``) when the folder holds anything else:

- ``run``, ``compare`` and ``fidelity`` never write into a non-empty folder;
- ``sweep`` and ``profile`` resume in a folder their own command made with the
  same identity (sweep: the sweep file's content; profile: its own settings
  check, :func:`cdbench.profile.runner.check_resume`), and refuse others;
- ``overwrite=True`` empties the folder first, but only one that is a
  cdbench output folder (the marker, or the files of an older cdbench), so a
  mistyped ``--out`` never deletes someone's files;
- ``adopt=True`` claims a folder without a marker as it is, its files kept
  (``campaign run --adopt``: runs made before campaigns, which the caller has
  found to be the campaign's own).

A claim is atomic: the claiming process holds an exclusive lock on the folder
(``flock``) from before it looks inside until it releases the claim
(:func:`release_folder`) or exits, so of two commands started on one folder
exactly one proceeds and the other is refused in one line. The kernel drops the
lock of a process that dies, even one killed outright, so a stale claim never
blocks a folder (an exclusively created claim file would, with no safe way to
tell a dead claimer from a slow one). The marker is written whole (renamed into
place), so a reader never sees half of one.

>>> import tempfile
>>> folder = Path(tempfile.mkdtemp()) / "keep"
>>> claim_folder(folder, "run")
>>> (folder / "summary.json").write_text("{}")
2
>>> claim_folder(folder, "run")
Traceback (most recent call last):
...
cdbench.results.output_folder.FolderInUseError: --out ... already holds the results of `cdbench run`; give another --out, or --overwrite to replace them
>>> claim_folder(folder, "run", overwrite=True)
>>> sorted(p.name for p in folder.iterdir())
['.cdbench.json']
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

import cdbench

MARKER_FILE = ".cdbench.json"

Command = Literal["run", "compare", "sweep", "profile", "fidelity", "kernels", "campaign"]

# What each command wrote before folders carried a marker: such folders are recognized by these files.
_OLDER_OUTPUTS: dict[str, Command] = {
    "summary.json": "run", "run.log": "run", "requests.parquet": "run", "comparison.md": "compare",
    "compare.log": "compare", "sweep.json": "sweep", "sweep.log": "sweep", "profile_config.json": "profile",
    "items.jsonl": "profile", "fidelity.md": "fidelity", "kernels.png": "kernels", "h2d.csv": "kernels",
}


class FolderInUseError(FileExistsError):
    """An output folder holds results this command must not mix with or replace unasked."""


class FolderMarker(BaseModel):
    """The marker file: which command made the folder, and what a resuming rerun must share with it."""

    model_config = ConfigDict(extra="forbid")

    command: Command
    identity: Any = None
    cdbench_version: str = ""


def _read_marker(folder: Path) -> FolderMarker | None:
    path = folder / MARKER_FILE
    if not path.is_file():
        return None
    try:
        return FolderMarker.model_validate_json(path.read_text())
    except (ValidationError, OSError, UnicodeDecodeError):
        raise FolderInUseError(f"--out {folder}: its {MARKER_FILE} is unreadable; give another --out, or remove "
                               "the folder yourself") from None


def _maker(folder: Path, marker: FolderMarker | None) -> Command | None:
    """The command that made ``folder``: its marker's, else the one whose older files it holds."""
    if marker is not None:
        return marker.command
    for name, command in _OLDER_OUTPUTS.items():
        if (folder / name).exists():
            return command
    return None


def _identity(folder: Path, marker: FolderMarker | None, command: Command) -> Any:
    """What a resuming rerun must match: the marker's, or for an older sweep folder its ``sweep.json``."""
    if marker is not None:
        return marker.identity
    older = folder / "sweep.json"
    if command == "sweep" and older.is_file():
        try:
            return json.loads(older.read_text())
        except (ValueError, OSError):
            return {"unreadable": str(older)}  # matches no sweep: refused, not guessed
    return None


def _empty(folder: Path) -> None:
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


_HELD: dict[Path, int] = {}
"""Folders this process has claimed → the open, locked file descriptor of each."""


def _lock(folder: Path) -> int:
    """An open descriptor of ``folder`` holding its exclusive lock, or :class:`FolderInUseError` when
    another process holds it."""
    key = folder.resolve()
    if key in _HELD:
        return _HELD[key]
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        marker = _holders_marker(folder)
        what = f"`cdbench {marker.command}`" if marker is not None else "another cdbench command"
        raise FolderInUseError(f"--out {folder} is being written by {what} right now; give another --out, or "
                               "wait for it to finish") from None
    return fd


def _holders_marker(folder: Path, wait_s: float = 1.0) -> FolderMarker | None:
    """The marker of the command holding ``folder``'s lock, to name it; a holder writes its marker just
    after taking the lock, so one that has not yet is given up to ``wait_s`` to do so."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            marker = _read_marker(folder)
        except FolderInUseError:  # a marker from before markers were written whole
            return None
        if marker is not None or time.monotonic() >= deadline:
            return marker
        time.sleep(0.02)


def release_folder(folder: Path) -> None:
    """Give up this process's claim on ``folder`` (its marker stays; another command may now claim it)."""
    fd = _HELD.pop(Path(folder).resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor drops the lock


def _check(folder: Path, command: Command, identity: Any, resumable: bool, overwrite: bool, act: bool,
           adopt: bool = False) -> None:
    """Raise :class:`FolderInUseError` if ``command`` may not write into ``folder``; with ``act``, empty it
    when ``overwrite`` allows."""
    # (the marker, and the marker being renamed into place)
    contents = [p.name for p in folder.iterdir() if not p.name.startswith(MARKER_FILE)] if folder.is_dir() else []
    if not contents:  # a folder holding only a marker (a claim whose command then stopped) has nothing to lose
        return
    marker = _read_marker(folder)
    if adopt and marker is None:
        return
    maker = _maker(folder, marker)
    if overwrite:
        if maker is None:
            raise FolderInUseError(f"--out {folder} holds files cdbench did not write (e.g. {min(contents)}); "
                                   "--overwrite only replaces a cdbench output folder: give another --out")
        if act:
            _empty(folder)
    elif maker is None:
        raise FolderInUseError(f"--out {folder} is not empty and not a cdbench output folder (it holds "
                               f"{min(contents)}); give another --out")
    elif maker != command:
        raise FolderInUseError(f"--out {folder} holds the results of `cdbench {maker}`; give another --out, "
                               "or --overwrite to replace them")
    elif not resumable:
        raise FolderInUseError(f"--out {folder} already holds the results of `cdbench {command}`; "
                               "give another --out, or --overwrite to replace them")
    elif _identity(folder, marker, command) not in (None, identity):
        raise FolderInUseError(f"--out {folder} holds a `cdbench {command}` made with other settings, so it "
                               "cannot be resumed; give another --out, or --overwrite to replace it")


def claim_folder(folder: Path, command: Command, identity: Any = None, resumable: bool = False,
                 overwrite: bool = False, adopt: bool = False) -> None:
    """Make ``folder`` ``command``'s output folder (created if missing), or raise :class:`FolderInUseError`.

    ``resumable`` commands may continue a folder their own command made with an equal ``identity``
    (a JSON-able value); a folder of that command from before markers is continued when its own record
    agrees (a sweep's ``sweep.json``; a profile checks its settings itself); ``adopt`` takes a folder without a
    marker as it is (the caller checks that its files are its command's). The claim holds until
    :func:`release_folder` or the process's end; claiming a folder this process holds checks it again.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FolderInUseError(f"--out {folder} is a file; it must be a folder (new or existing)")
    # Checked first without the lock, so a folder refused for what it holds is not even created.
    _check(folder, command, identity, resumable, overwrite, act=False, adopt=adopt)
    folder.mkdir(parents=True, exist_ok=True)
    held = folder.resolve() in _HELD
    fd = _lock(folder)
    try:
        _check(folder, command, identity, resumable, overwrite, act=True, adopt=adopt)  # again, now no one else can
    except FolderInUseError:
        if not held:  # a claim this process already held stays held
            os.close(fd)
        raise
    _HELD[folder.resolve()] = fd
    marker = FolderMarker(command=command, identity=identity, cdbench_version=cdbench.__version__)
    partial = folder / f"{MARKER_FILE}.{os.getpid()}"
    partial.write_text(marker.model_dump_json(indent=2) + "\n")
    partial.replace(folder / MARKER_FILE)


def new_folder(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``, ...: the first that did not exist, created here (so two
    commands started in the same second never share one)."""
    base = Path(base)
    base.parent.mkdir(parents=True, exist_ok=True)
    candidate, n = base, 1
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1
            candidate = base.with_name(f"{base.name}-{n}")


__all__ = ["MARKER_FILE", "FolderInUseError", "FolderMarker", "claim_folder", "new_folder", "release_folder"]
