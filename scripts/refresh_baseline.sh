#!/usr/bin/env bash
# Re-record ci/baseline.json from the CI run (cdbench/configs/ci.yaml). Run this only when a change of the
# metrics is intended, and commit the new baseline together with that change.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf runs/ci
.venv/bin/cdbench run cdbench/configs/ci.yaml --out runs/ci --overwrite
.venv/bin/cdbench gate runs/ci --baseline ci/baseline.json --update
git --no-pager diff --stat -- ci/baseline.json || true
