"""The entry point: a terminal sees a status line at once, before the commands (and torch) load."""

import os
import pty
import subprocess
import sys

import cdbench

ENTRY = "from cdbench.cli.main import main; import sys; sys.argv = ['cdbench', 'version']; main()"


def test_without_a_terminal_the_entry_point_prints_only_the_command_output():
    done = subprocess.run([sys.executable, "-c", ENTRY], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == cdbench.__version__ and done.stderr == ""


def test_in_a_terminal_the_loading_stage_shows_before_the_command_runs():
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdout and stderr are the pseudo-terminal
        os.execv(sys.executable, [sys.executable, "-c", ENTRY])
    output = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.waitpid(pid, 0)
    text = output.decode(errors="replace")
    assert "loading cdbench" in text and cdbench.__version__ in text
    assert text.index("loading cdbench") < text.rindex(cdbench.__version__)
