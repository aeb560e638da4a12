#!/bin/bash
# Device side of the out-of-sample rerun (issue 27): model at its defaults with this commit's spec costs
# (run-order compile sequence, refusals kept), over live-a's workloads, on the GPU host's CPU.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 CDBENCH_CACHE_DIR=/tmp/cdb_cache
mkdir -p /tmp/w /tmp/c
for f in .cache/oos2/*.gz; do gunzip -c "$f" > "/tmp/c/$(basename "$f" .gz)"; done
{ echo "commit $(git rev-parse HEAD 2>/dev/null)"; nproc; lscpu | grep -i "model name"; uptime; } 2>&1 | tee $OUT/device.txt
case_runs() {  # phase corpus rate overlap cores
  local ph=$1 corpus=$2 rate=$3 ov=$4 cores=$5
  for pol in sglang vllm; do
    start=$SECONDS
    taskset -c $cores python3 -m cdbench run --mode model --policy $pol \
      --requests 150 --rate $rate \
      --set 'workload.kind_weights={json_schema: 1.0}' --set scheduler.overlap=$ov --set trace_steps=0 \
      --set workload.prompt_len.max=1024 --set workload.trace=/tmp/c/$ph.trace.jsonl \
      --out /tmp/w/$ph-$pol-model --overwrite > /tmp/w/$ph-$pol-model.log 2>&1
    echo "$ph $pol: exit $? in $(( SECONDS - start )) s; $(grep -E 'spec costs|measured|compile times' /tmp/w/$ph-$pol-model.log | tr '\n' ' ')"
  done
}
taskset -c 8-11 python3 -m cdbench host > $OUT/host.txt 2>&1
case_runs under medium 8 true 0-3 &
case_runs saturated hard 25 false 4-7 &
wait
tar czf $OUT/model_runs.tgz --exclude=trace.json --exclude=plots -C /tmp/w .
tar czf $OUT/store.tgz -C /tmp/cdb_cache spec_costs
ls -la $OUT
