#!/usr/bin/env bash
# The exact GPU run behind reports/kernels/: GPU tests, then the full `cdbench kernels` sweep.
# Run from the repo root on a CUDA host whose python3 has torch + triton; wheels for what the
# host lacks (xgrammar, apache-tvm-ffi, pydantic, ...) may sit in .whl/. Writes to $OUT.
set -uo pipefail
OUT=${OUT:-runs/kernels-gpu}
mkdir -p "$(dirname "$OUT")"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Skip tvm-ffi's torch DLPack JIT build; build xgrammar's CUDA kernel for this GPU only.
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  # xgrammar's CUDA backend is JIT-built by nvcc (about a minute): start it beside the tests.
  python3 -c "import xgrammar.kernels.apply_token_bitmask_inplace_cuda" > /tmp/xgr_build.log 2>&1 &
  build=$!
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    echo "== GPU tests"
    timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 tests/kernels/test_kernels_gpu.py 2>&1 | tail -25
  fi
  wait $build; echo "xgrammar cuda build exit $?"; tail -5 /tmp/xgr_build.log
  echo "== benchmark"
  # = `cdbench kernels ...`, without importing the other subcommands' dependencies
  timeout ${BENCH_TIMEOUT:-330} python3 -c "import typer; from cdbench.cli.kernels import kernels_command as k; typer.run(k)" \
    --out "$OUT" --cost-table "$OUT/cost_table.json" "$@" 2>&1 | grep -v "━"
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu --format=csv
} 2>&1 | tee "$OUT.run.log"  # beside the folder while the benchmark claims it, moved in after
mkdir -p "$OUT" && mv "$OUT.run.log" "$OUT/run.log"
