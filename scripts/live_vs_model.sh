#!/usr/bin/env bash
# Live GPU vs calibrated model, hybrid mode, on one GPU host (reports/fidelity/live_vs_model.md).
# Usage: scripts/live_vs_model.sh WORKLOAD OUTDIR [REQUESTS]
#   WORKLOAD: default (cdbench/configs/default.yaml's mix) or json (every structured request a JSON schema)
# For each policy (sglang, vllm) and overlap (on, off) it runs the same workload twice in hybrid mode: the GPU
# parts measured on this machine's GPU (costs.live_gpu) and priced by the shipped forward calibration.
# CDBENCH overrides the command (default: .venv/bin/cdbench).
set -euo pipefail
workload=$1 out=$2 requests=${3:-200}
cdbench=${CDBENCH:-.venv/bin/cdbench}
case $workload in
  default) mix=() ;;
  json) mix=(--set 'workload.kind_weights={json_schema: 1.0}') ;;
  *) echo "unknown workload $workload (default or json)" >&2; exit 2 ;;
esac
mkdir -p "$out"
for policy in sglang vllm; do
  for overlap in true false; do
    for gpu in live model; do
      name=$workload-$policy-overlap_$overlap-$gpu
      extra=(--set "scheduler.overlap=$overlap" --set trace_steps=0)
      [ "$gpu" = live ] && extra+=(--set costs.live_gpu=true)
      start=$(date +%s)
      $cdbench run --mode hybrid --policy "$policy" --requests "$requests" "${mix[@]}" "${extra[@]}" \
        --out "$out/$name" > "$out/$name.log" 2>&1 || { echo "$name failed:"; tail -3 "$out/$name.log"; exit 1; }
      echo "$name: $(( $(date +%s) - start )) s"
    done
  done
done
