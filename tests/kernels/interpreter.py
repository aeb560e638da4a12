"""Run a kernel-vs-reference test module under Triton's CPU interpreter, in a clean subprocess.

``TRITON_INTERPRET`` must be set before Triton is imported and must not leak into the pytest-xdist
worker that runs the other tests, hence the subprocess; this folder is on its path for the shared cases.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_under_interpreter(module: str) -> None:
    """Run ``module`` (a file in this folder) with ``TRITON_INTERPRET=1``; fail with its output's tail."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
           "-o", "addopts=", str(HERE / module)]
    result = subprocess.run(cmd, check=False, cwd=HERE.parent.parent, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
