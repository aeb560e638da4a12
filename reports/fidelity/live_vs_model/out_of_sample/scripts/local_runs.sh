#!/bin/bash
# Model-mode runs on this machine over each GPU case's workload (replayed from live-a's trace), the device's code (cdbench/ of e82157e):
#   own      live-a's own in-situ grammar profile (control: the model's GPU and scheduler side with live's grammar costs)
#   gpustore model at its defaults with the GPU host's spec store (costs.host = the GPU host; must reproduce the device's model run)
#   livecompile         diagnostic: the GPU host's store with each spec's compile time replaced by live-a's in-situ one
#   livecompile_reject  the same, and live-a's rejections (ana/patch_store.py)
#   runorder            CODE=cdbench/ of 000469e (compile times in the run's order, 0c09208): the GPU host's store, the
#                       run-order compile sequence measured here and scaled to the GPU host
#   scaled   this machine's measurements, priced for the GPU host (costs.host = the GPU host: scaled by the score ratio;
#            a spec this machine lacks is measured here first)
set -u
cd /tmp/oos/wd  # not the checkout: python -m puts the working directory first on sys.path
export CDBENCH_CACHE_DIR=/tmp/oos/wd/.cache
export PYTHONPATH=${CODE:-/tmp/oos/head_e8}  # cdbench/ as the device ran it (e82157e)
D=/tmp/oos/dev L=/tmp/oos/local GPU=7fdcd680e958
mkdir -p $L
for c in "under medium 8 true" "saturated hard 25 false"; do
  set -- $c; ph=$1 corpus=$2 rate=$3 ov=$4
  for pol in sglang vllm; do
    cfg=$D/$ph/json-$pol-overlap_$ov
    common=(--mode model --policy $pol --corpus .cache/corpora/jsonschemabench_github_$corpus.jsonl --requests 150 --rate $rate
            --set 'workload.kind_weights={json_schema: 1.0}' --set scheduler.overlap=$ov --set trace_steps=0
            --set workload.prompt_len.max=1024 --set workload.trace=$cfg-live-a/workload.trace.jsonl)
    for what in ${WHAT:-own gpustore scaled}; do
      case $what in
        own) extra=(--set costs.grammar_profile=$cfg-live-a/grammar_profile.json);;
        gpustore) extra=(--set costs.spec_store=/tmp/oos/store_gpu --set costs.host=$GPU --set costs.spec_costs=strict);;
        livecompile) extra=(--set costs.spec_store=/tmp/oos/store_patch_${ph}_${pol}_compile --set costs.host=$GPU --set costs.spec_costs=strict);;
        livecompile_reject) extra=(--set costs.spec_store=/tmp/oos/store_patch_${ph}_${pol}_compile_reject --set costs.host=$GPU --set costs.spec_costs=strict);;
        runorder) extra=(--set costs.spec_store=/tmp/oos/store_head_order --set costs.host=$GPU);;  # with CODE=HEAD 000469e
        scaled) extra=(--set costs.spec_store=/tmp/oos/store_here_for_gpu --set costs.host=$GPU);;  # measures here what is missing
      esac
      run=$L/$ph-$pol-model-$what
      /work/main/.venv/bin/python -m cdbench run "${common[@]}" "${extra[@]}" --out $run --overwrite > $run.log 2>&1 || { echo "$run failed"; tail -3 $run.log; }
      /work/main/.venv/bin/python -m cdbench fidelity $cfg-live-a $run --noise $cfg-live-a $cfg-live-b --out $run-fidelity --overwrite > $run-fidelity.log 2>&1
      echo "$ph $pol $what: fidelity exit $? ; $(grep -o 'spec costs.*' $run.log | head -1)"
    done
  done
done
