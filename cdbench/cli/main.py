"""The ``cdbench`` entry point: a status line while the command line loads.

Loading the commands imports torch, pandas, matplotlib and the grammar
engines (seconds on a busy machine); a terminal sees the stage at once
instead of a silent pause before the first progress bar.
"""

from __future__ import annotations

import sys


def main() -> None:
    status = None
    if sys.stderr.isatty():
        from rich.console import Console

        status = Console(stderr=True).status("loading cdbench (torch, grammar engines)")
        status.start()
    try:
        from cdbench.cli.app import app
    finally:
        if status is not None:
            status.stop()
    app()
