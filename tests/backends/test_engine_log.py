"""Native engine logging is captured from descriptor 2 and kept with the compile's warnings."""

from __future__ import annotations

import os
import sys
import threading

from cdbench.backends import ConstraintSpec, create_backend
from cdbench.backends.engine_log import engine_log, is_logged_warning

# xgrammar 0.2.8 logs "json_schema_converter.cc:...: Warning: pattern combined with minLength/maxLength is
# not supported; ignoring minLength/maxLength" for this schema.
LOGGING_SCHEMA = {"type": "string", "pattern": "^[a-z]+$", "minLength": 2}


def test_xgrammar_log_lines_become_warnings_not_console_output(capfd):
    backend = create_backend("xgrammar", "cl100k", compiler_cache=False)
    capfd.readouterr()
    grammar = backend.compile(ConstraintSpec("json_schema", LOGGING_SCHEMA))
    logged = [w for w in grammar.warnings if is_logged_warning(w)]
    assert len(logged) == 1, grammar.warnings
    assert logged[0].startswith("xgrammar logged: ") and "json_schema_converter.cc" in logged[0]
    assert "ignoring minLength/maxLength" in logged[0] and not logged[0].startswith("xgrammar logged: [")
    assert capfd.readouterr().err == ""
    quiet = backend.compile(ConstraintSpec("json_schema", {"type": "string", "minLength": 2}))
    assert not any(is_logged_warning(w) for w in quiet.warnings)


def test_overlapping_captures_lose_no_line_and_restore_descriptor_2(capfd):
    inside = threading.Barrier(2)
    got: dict[str, list[str]] = {}

    def compile_like(name: str) -> None:
        with engine_log() as lines:
            os.write(2, f"{name} before\n".encode())
            inside.wait()  # both captures are open here
            os.write(2, f"{name} after\n".encode())
            inside.wait()
        got[name] = lines

    threads = [threading.Thread(target=compile_like, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in ("a", "b"):
        assert {f"{name} before", f"{name} after"} <= set(got[name])
    os.write(2, b"after the captures\n")
    assert capfd.readouterr().err == "after the captures\n"


def test_python_stderr_still_reaches_the_console_during_a_capture(capfd, monkeypatch):
    # As in a terminal: sys.stderr writes to descriptor 2 itself (pytest's own stand-in does not).
    console = open(2, "w", closefd=False)  # noqa: SIM115
    monkeypatch.setattr(sys, "stderr", console)
    with engine_log() as lines:
        print("progress bar", file=sys.stderr)
        os.write(2, b"native chatter\n")
    console.flush()
    assert lines == ["native chatter"]
    assert sys.stderr is console
    assert capfd.readouterr().err == "progress bar\n"
