#!/usr/bin/env bash
# The CI job: the default test suite (fast, CPU-only).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
.venv/bin/python -m pytest -q -n 2
