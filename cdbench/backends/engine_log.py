"""What grammar engines write to the process's stderr, captured instead of shown.

Native engines log from C++ straight to file descriptor 2 (xgrammar:
``json_schema_converter.cc:1161: Warning: ...``), past ``sys.stderr``, so
their lines would land in the middle of progress bars and tables.
:func:`engine_log` points descriptor 2 at a capture file while any caller is
inside it and hands each caller the lines written meanwhile.

Thread safety: the redirect is process-wide and reference-counted (the first
caller in starts it, the last one out ends it), so compiles on a thread pool
never undo each other's redirect. Each caller receives every line written
between its entry and its exit: a line written while two compiles overlap is
given to both, none is lost. Python's own ``sys.stderr`` keeps the console
while the redirect lasts (when it was descriptor 2), so progress bars and
error messages still show.

>>> import os
>>> with engine_log() as lines:
...     _ = os.write(2, b"engine: hello\\n")
>>> lines
['engine: hello']
"""

from __future__ import annotations

import io
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

_MAX_LINE_CHARS = 500
_LOGGED = re.compile(r"^\S+ logged: ")


def logged_warning(backend: str, line: str) -> str:
    """A compile warning holding a line ``backend`` logged (see :class:`~cdbench.backends.base.CompiledGrammar`)."""
    return f"{backend} logged: {line}"


def is_logged_warning(warning: str) -> bool:
    """Whether a compile warning is an engine's logged line (not one of cdbench's own notes)."""
    return _LOGGED.match(warning) is not None


class _Redirect:
    """The process-wide state: descriptor 2's saved target, the capture file, and how many callers are inside."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.capture: io.BufferedRandom | None = None  # kept between redirects; emptied when the last caller leaves
        self.saved_fd = -1
        self.python_stderr: TextIO | None = None  # sys.stderr before it was pointed at the console

    def enter(self) -> int:
        """Start the redirect if it is off; the capture file's size (the caller's first byte)."""
        with self.lock:
            if self.depth == 0:
                self._start()
            self.depth += 1
            assert self.capture is not None
            return os.fstat(self.capture.fileno()).st_size

    def leave(self, start: int) -> list[str]:
        """The lines written since ``start``; ends the redirect when this is the last caller."""
        with self.lock:
            assert self.capture is not None
            end = os.fstat(self.capture.fileno()).st_size
            data = os.pread(self.capture.fileno(), end - start, start) if end > start else b""
            self.depth -= 1
            if self.depth == 0:
                self._stop()
        text = data.decode("utf-8", errors="replace")
        return [line.rstrip()[:_MAX_LINE_CHARS] for line in text.splitlines() if line.strip()]

    def _start(self) -> None:
        if self.capture is None:
            self.capture = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.saved_fd = os.dup(2)
        os.dup2(self.capture.fileno(), 2)
        self.python_stderr = None
        try:
            writes_fd2 = sys.stderr.fileno() == 2
        except (AttributeError, OSError, ValueError):  # a test runner's or rich's stand-in
            writes_fd2 = False
        if writes_fd2:
            self.python_stderr = sys.stderr
            sys.stderr = _Console(self.saved_fd, sys.stderr)

    def _stop(self) -> None:
        if self.python_stderr is not None:
            sys.stderr = self.python_stderr
        os.dup2(self.saved_fd, 2)
        os.close(self.saved_fd)
        assert self.capture is not None
        fd = self.capture.fileno()
        if os.fstat(fd).st_size:
            # Descriptor 2 shared this file's offset: back to 0 too, or the next lines would follow a hole.
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)


class _Console(io.TextIOBase):
    """``sys.stderr`` while the redirect lasts: Python's writes go, unbuffered, where descriptor 2 went before.

    A light stand-in rather than ``open(fd)``: it is made at every redirect, and compile times include it.
    """

    def __init__(self, fd: int, like: TextIO) -> None:
        self._fd = fd
        self._encoding = like.encoding or "utf-8"
        self._errors = like.errors or "backslashreplace"

    @property
    def encoding(self) -> str:
        return self._encoding

    @property
    def errors(self) -> str:
        return self._errors

    def write(self, text: str) -> int:
        data = text.encode(self._encoding, self._errors)
        while data:
            data = data[os.write(self._fd, data):]
        return len(text)

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def writable(self) -> bool:
        return True


_REDIRECT = _Redirect()


@contextmanager
def engine_log() -> Iterator[list[str]]:
    """Capture descriptor 2 for the block; the list yielded receives, when it ends, the lines written
    meanwhile (blank lines dropped, each cut at 500 characters)."""
    start = _REDIRECT.enter()
    lines: list[str] = []
    try:
        yield lines
    finally:
        lines.extend(_REDIRECT.leave(start))
