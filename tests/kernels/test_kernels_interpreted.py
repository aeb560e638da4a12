"""Run the Triton-interpreter checks (``interpreted_cases.py``) in a clean subprocess.

``TRITON_INTERPRET`` must be set before Triton is imported and must not leak into
the pytest-xdist worker that runs other teams' tests, hence the subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_triton_kernels_equal_references_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
           "-o", "addopts=", str(HERE / "interpreted_cases.py")]
    result = subprocess.run(cmd, cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
