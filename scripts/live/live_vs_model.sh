#!/usr/bin/env bash
# Live mode against the calibrated model and hybrid modes on one GPU host (reports/fidelity/live_vs_model.md).
# Usage: [COPIES=N] [POLICIES="sglang vllm"] [OVERLAPS="true false"] [SETS="key=value ..."] [CORPUS=PATH,...] \
#        [MODEL=own|defaults] [HYBRID=1|0] scripts/live/live_vs_model.sh OUTDIR REQUESTS RATE WORKLOAD...
# (SETS: config overrides for every run, one --set each, e.g. SETS=workload.prompt_len.max=1024;
#  CORPUS: every run's --corpus, e.g. a JSONL file no shipped profile has seen)
# For each workload (default: cdbench/configs/default.yaml's mix; json: every structured request a JSON schema),
# policy (sglang, vllm) and overlap (on, off):
#   live-a, live-b  COPIES (default 2) --mode live runs, same seed (live-a, live-b, live-c, ...; the largest
#                   spread of a copy from live-a is the noise floor), one after another on cores 0-3 and the GPU;
#   hybrid          --mode hybrid: the same grammar work, the GPU priced by the shipped calibration;
#   model           --mode model with live-a's own grammar_profile.json (MODEL=own, the default), or at its
#                   defaults (MODEL=defaults: no profile; the specs no shipped profile has are measured on
#                   demand into the spec-cost store, costs.spec_store, default .cache/spec_costs), on cores 4-7
#                   of its own every time (a later pair's model reuses the store's entries), with
#                   costs.measure_workers=2, half its cores (the default counts the machine's CPUs, not the
#                   four it may use); HYBRID=0 leaves hybrid out;
# the last two run beside the live runs, on four cores of their own from 4 up (4-7, 8-11, ... in turn): as
# many as live mode's, since xgrammar compiles with threads (on one core its large grammars compile ~1.5x slower). Then `cdbench fidelity` compares
# hybrid and model against live-a with the other copies as the noise (--noise live-a live-b --noise-run ...).
# CDBENCH overrides the command (default: cdbench; on a GPU host without the script: python3 -m cdbench).
set -uo pipefail
out=$1 requests=$2 rate=$3
shift 3
cdbench=${CDBENCH:-cdbench}
copies=(a b c d e f g h)
copies=("${copies[@]:0:${COPIES:-2}}")
sets=()
for item in ${SETS:-}; do sets+=(--set "$item"); done
corpus=()
[ -n "${CORPUS:-}" ] && corpus=(--corpus "$CORPUS")
model=${MODEL:-own}
case $model in own|defaults) ;; *) echo "MODEL must be own or defaults, not '$model'"; exit 2;; esac
mkdir -p "$out"
block=4
first=4  # the first hybrid block: 8 with MODEL=defaults, whose model runs keep 4-7
[ "$model" = defaults ] && first=8 block=8
background() {  # name, cores, then the run's arguments: on those cores, in the background (once process $after ends)
  local name=$1 cores=$2; shift 2
  ( while [ -n "${after:-}" ] && kill -0 "$after" 2>/dev/null; do sleep 1; done
    exec taskset -c "$cores" $cdbench run "$@" --out "$out/$name" --overwrite ) > "$out/$name.log" 2>&1 &
}
for workload in "$@"; do
  mix=()
  [ "$workload" = json ] && mix=(--set 'workload.kind_weights={json_schema: 1.0}')
  for policy in ${POLICIES:-sglang vllm}; do
    for overlap in ${OVERLAPS:-true false}; do
      cfg=$workload-$policy-overlap_$overlap
      common=(--policy "$policy" --requests "$requests" --rate "$rate" "${corpus[@]}" "${mix[@]}" --set "scheduler.overlap=$overlap"
              --set trace_steps=0 "${sets[@]}")
      for copy in "${copies[@]}"; do
        start=$SECONDS
        taskset -c 0-3 $cdbench run --mode live "${common[@]}" --out "$out/$cfg-live-$copy" --overwrite \
          > "$out/$cfg-live-$copy.log" 2>&1 || { echo "$cfg-live-$copy failed:"; tail -5 "$out/$cfg-live-$copy.log"; }
        echo "$cfg-live-$copy: $(( SECONDS - start )) s"
      done
      cores=$block-$(( block + 3 ))
      [ "${HYBRID:-1}" = 1 ] && background "$cfg-hybrid" "$cores" --mode hybrid "${common[@]}"
      if [ "$model" = defaults ]; then
        # after the last pair's model, so that this one finds what that one measured
        after=${model_pid:-} background "$cfg-model" 4-7 --mode model "${common[@]}" --set costs.measure_workers=2
        model_pid=$!
      elif [ -f "$out/$cfg-live-a/grammar_profile.json" ]; then
        background "$cfg-model" "$cores" --mode model "${common[@]}" \
          --set "costs.grammar_profile=$out/$cfg-live-a/grammar_profile.json"
      fi
      block=$(( block + 4 > $(nproc) - 4 ? first : block + 4 ))
    done
  done
done
wait
for run in "$out"/*-hybrid "$out"/*-model; do
  cfg=${run%-*}
  noise=(--noise "$cfg-live-a" "$cfg-live-b")
  for copy in "${copies[@]:2}"; do noise+=(--noise-run "$cfg-live-$copy"); done
  missing=0
  for copy in "${copies[@]}"; do [ -f "$cfg-live-$copy/summary.json" ] || missing=1; done
  [ -f "$run/summary.json" ] && [ $missing = 0 ] || { echo "skipped $(basename "$run"): a run is missing"; continue; }
  $cdbench fidelity "$cfg-live-a" "$run" "${noise[@]}" --out "$run-fidelity" --overwrite > "$run-fidelity.log" 2>&1
  echo "$(basename "$run") vs live: exit $?"
done
