#!/usr/bin/env bash
# The CI job: the default test suite (fast, CPU-only), then the regression gate.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
.venv/bin/python -m pytest -q -n 2

# Regression gate: a small model-mode run (virtual time, so deterministic) against the committed baseline.
# Refresh the baseline deliberately with: scripts/refresh_baseline.sh
rm -rf runs/ci
.venv/bin/cdbench run cdbench/configs/ci.yaml --out runs/ci --overwrite
.venv/bin/cdbench gate runs/ci --baseline ci/baseline.json
