#!/usr/bin/env bash
# Create .venv and install cdbench with its test tools, offline-safe and CPU-only by default.
# A GPU user who already has torch: CDBENCH_SYSTEM_SITE=1 scripts/setup.sh reuses it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  if [ "${CDBENCH_SYSTEM_SITE:-0}" = 1 ]; then
    python3 -m venv --system-site-packages .venv
  else
    python3 -m venv .venv
  fi
fi
py=.venv/bin/python
$py -m pip install -q --upgrade pip
# Pin the CPU wheel before anything can pull a multi-GB CUDA build of torch.
if ! $py -c "import torch" 2>/dev/null; then
  $py -m pip install -q torch==2.13.0
fi
$py -m pip install -q -e ".[dev]"
