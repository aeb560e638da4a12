"""Run the Triton-interpreter checks (``interpreted_cases.py``) in a clean subprocess.

``TRITON_INTERPRET`` must be set before Triton is imported and must not leak into
the pytest-xdist worker that runs other teams' tests, hence the subprocess.
"""

from __future__ import annotations

from interpreter import run_under_interpreter


def test_triton_kernels_equal_references_under_interpreter():
    run_under_interpreter("interpreted_cases.py")
