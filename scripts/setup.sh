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
# Pin the CPU wheel before anything can pull a multi-GB CUDA build of torch: PyPI's Linux
# torch==2.13.0 is the CUDA build, so ask for the +cpu build, first from the configured indexes
# (a local wheel house), then from PyTorch's own CPU index.
if ! $py -c "import torch" 2>/dev/null; then
  $py -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
    || $py -m pip install -q "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu \
         --extra-index-url https://pypi.org/simple
fi
$py -m pip install -q -e ".[dev]"
