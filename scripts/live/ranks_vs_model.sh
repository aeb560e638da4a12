#!/usr/bin/env bash
# Live runs of several ranks, one process and one GPU each (scheduler.ranks, scheduler.parallel), against model
# mode priced from what they measured (reports/fidelity/live_vs_model.md, "Multi-GPU").
# Usage: [COPIES=N] [RANKS=2] [PARALLELS="tp dp"] [SETS="key=value ..."] [LIVE_CORES=0-7] [MODEL_CORES=16-23] \
#        [RUN_TIMEOUT=600] [MODEL=1|0] scripts/live/ranks_vs_model.sh OUTDIR REQUESTS RATE WORKLOAD...
# (RUN_TIMEOUT: seconds each live run may take; with CDBENCH_RANK_STACKS_S set its ranks print their stacks;
#  MODEL=0: live runs only, each model run's prices printed, for model runs elsewhere)
# For each workload (default: the default mix; json: every structured request a JSON schema) and parallelism:
#   live-a, live-b, ...  COPIES (default 2) --mode live runs, SGLang, overlap on, same seed, on LIVE_CORES;
#   model                --mode model with live-a's grammar_profile.json and its ranks' prices, on live-a's GPU:
#                        tp: scheduler.ranks, costs.tp, all_gather_s and rank_jitter from live-a's live.json
#                        (cdbench.harness.live.ranks.model_parameters); dp: the same dealing of requests;
# then `cdbench fidelity` against live-a with the other copies as the noise.
# CDBENCH overrides the command (default: cdbench; on a GPU host: python3 -m cdbench).
set -uo pipefail
out=$1 requests=$2 rate=$3
shift 3
cdbench=${CDBENCH:-cdbench}
ranks=${RANKS:-2}
copies=(a b c d e f)
copies=("${copies[@]:0:${COPIES:-2}}")
sets=()
for item in ${SETS:-}; do sets+=(--set "$item"); done
mkdir -p "$out"
for workload in "$@"; do
  mix=()
  [ "$workload" = json ] && mix=(--set 'workload.kind_weights={json_schema: 1.0}')
  for parallel in ${PARALLELS:-tp dp}; do
    cfg=$workload-$parallel$ranks
    common=(--policy sglang --requests "$requests" --rate "$rate" "${mix[@]}" --set scheduler.overlap=true
            --set trace_steps=0 --set "scheduler.ranks=$ranks" --set "scheduler.parallel=$parallel" "${sets[@]}")
    [ "$parallel" = tp ] && common+=(--set "costs.tp=$ranks")
    for copy in "${copies[@]}"; do
      start=$SECONDS
      timeout "${RUN_TIMEOUT:-600}" taskset -c "${LIVE_CORES:-0-7}" $cdbench run --mode live "${common[@]}" --out "$out/$cfg-live-$copy" \
        --overwrite > "$out/$cfg-live-$copy.log" 2>&1 || { echo "$cfg-live-$copy failed:"; tail -5 "$out/$cfg-live-$copy.log"; }
      echo "$cfg-live-$copy: $(( SECONDS - start )) s"
    done
    live=$out/$cfg-live-a
    [ -f "$live/summary.json" ] || { echo "skipped $cfg-model: live-a is missing"; continue; }
    prices=()
    if [ "$parallel" = tp ]; then
      for item in $(python3 -c "
import sys
from cdbench.harness.live.ranks import load_ranks_info, model_parameters
print(' '.join(f'scheduler.{k}={v:.6g}' for k, v in model_parameters(load_ranks_info(sys.argv[1])).items() if k != 'ranks'))
" "$live/live.json"); do prices+=(--set "$item"); done
    fi
    # the model prices the GPU the live run ran on
    gpu=$(python3 -c "import json, sys; print('h200' if 'H200' in json.load(open(sys.argv[1]))['device'] else 'h100-sxm')" \
      "$live/live.json")
    prices+=(--set "costs.gpu=$gpu")
    echo "$cfg-model: ${prices[*]}"
    [ "${MODEL:-1}" = 1 ] || continue
    (  # beside the next live runs, on cores of its own
      taskset -c "${MODEL_CORES:-16-23}" $cdbench run --mode model "${common[@]}" \
        --set "costs.grammar_profile=$live/grammar_profile.json" "${prices[@]}" --out "$out/$cfg-model" --overwrite \
        > "$out/$cfg-model.log" 2>&1 || { echo "$cfg-model failed:"; tail -5 "$out/$cfg-model.log"; }
      noise=(--noise "$out/$cfg-live-a" "$out/$cfg-live-b")
      for copy in "${copies[@]:2}"; do noise+=(--noise-run "$out/$cfg-live-$copy"); done
      $cdbench fidelity "$live" "$out/$cfg-model" "${noise[@]}" --out "$out/$cfg-model-fidelity" --overwrite \
        > "$out/$cfg-model-fidelity.log" 2>&1
      echo "$cfg-model vs live: exit $?"
    ) &
  done
done
wait
