#!/usr/bin/env bash
# Redo the model side of every committed live campaign pair with this checkout's code and shipped calibrations
# (reports/fidelity/live_vs_model.md). A pair is a campaign's runs/ folder holding <cfg>-model/config.yaml,
# <cfg>-live-a with its grammar_profile.json, and live copies b, c, ... with requests.parquet and steps.parquet.
# Model mode is deterministic: at the commit a campaign ran, this reproduces its model summaries exactly.
# Usage: [CDBENCH=cdbench] [JOBS=2] scripts/live/model_rerun.sh OUTDIR [CAMPAIGN_DIR ...]
#   (default campaigns: every folder under reports/fidelity/live_vs_model with such pairs)
# Writes OUTDIR/<campaign>-<cfg>-model (the run) and OUTDIR/<campaign>-<cfg>-fid (cdbench fidelity against
# live-a, the other copies as the noise floor); prints one line per pair with fidelity's exit status.
set -uo pipefail
out=$1; shift
cdbench=${CDBENCH:-cdbench}
[ $# -gt 0 ] || set -- reports/fidelity/live_vs_model
mkdir -p "$out"
pairs=()
while IFS= read -r profile; do
  live_a=$(dirname "$profile"); runs=$(dirname "$live_a"); cfg=$(basename "$live_a"); cfg=${cfg%-live-a}
  [ -f "$runs/$cfg-model/config.yaml" ] && [ -f "$live_a/requests.parquet" ] && [ -f "$runs/$cfg-live-b/requests.parquet" ] \
    && pairs+=("$runs $cfg")
done < <(find "$@" -path '*/runs/*-live-a/grammar_profile.json' | sort)
one() {
  local runs=$1 cfg=$2
  local name; name=$(basename "$(dirname "$runs")")-$cfg
  local noise=(--noise "$runs/$cfg-live-a" "$runs/$cfg-live-b")
  for copy in "$runs/$cfg"-live-[c-h]; do [ -f "$copy/requests.parquet" ] && noise+=(--noise-run "$copy"); done
  $cdbench run "$runs/$cfg-model/config.yaml" --set "costs.grammar_profile=$runs/$cfg-live-a/grammar_profile.json" \
    --out "$out/$name-model" --overwrite > "$out/$name-model.log" 2>&1 || { echo "$name: model run failed"; return; }
  $cdbench fidelity "$runs/$cfg-live-a" "$out/$name-model" "${noise[@]}" --out "$out/$name-fid" --overwrite \
    > "$out/$name-fid.log" 2>&1
  echo "$name: fidelity exit $?"
}
export -f one; export out cdbench
printf '%s\n' "${pairs[@]}" | xargs -P "${JOBS:-2}" -I{} bash -c 'one {}'
