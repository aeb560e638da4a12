#!/bin/bash
# Device side of the out-of-sample campaign (issue 27). Usage: .cache/oos/call.sh under|saturated
set -o pipefail
phase=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
tar xf .cache/oos/head_overlay.tar && xargs -r rm -f < .cache/oos/head_remove.txt   # HEAD's cdbench/, not work in progress
mkdir -p .cache/corpora
for f in .cache/oos/*.jsonl.gz; do gunzip -c "$f" > ".cache/corpora/$(basename "$f" .gz)"; done
{ echo "commit $(cat .cache/oos/head_commit.txt)"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc; lscpu | grep -i "model name"; uptime
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  python3 -m pip list 2>/dev/null | grep -i -E "^(xgrammar|transformers|tokenizers|numpy|pandas|pyarrow|scipy|typer|rich|pyyaml|hypothesis) "
} 2>&1 | tee $OUT/device_$phase.txt
lvm() { CDBENCH="python3 -m cdbench" MODEL=defaults POLICIES="sglang vllm" SETS=workload.prompt_len.max=1024 \
          timeout "$1" scripts/live/live_vs_model.sh "${@:2}"; }
case $phase in
  under)
    for cores in 0-15 0-3 4-7; do echo "cdbench host, cores $cores:"; taskset -c $cores python3 -m cdbench host; done 2>&1 | tee $OUT/host.txt
    start=$SECONDS
    timeout 150 taskset -c 0-3 python3 -m cdbench run --mode live --policy sglang --requests 20 --rate 8 \
      --corpus .cache/corpora/jsonschemabench_github_medium.jsonl --set 'workload.kind_weights={json_schema: 1.0}' \
      --set trace_steps=0 --out /tmp/smoke > $OUT/smoke.log 2>&1 || { echo "smoke failed"; tail -40 $OUT/smoke.log; exit 1; }
    echo "smoke live run (20 requests): $(( SECONDS - start )) s"; grep -E "TTFT|completed|request_throughput" $OUT/smoke.log
    CORPUS=.cache/corpora/jsonschemabench_github_medium.jsonl OVERLAPS=true lvm 430 /tmp/oos/under 150 8 json 2>&1 | tee $OUT/console_under.log ;;
  saturated)
    CORPUS=.cache/corpora/jsonschemabench_github_hard.jsonl OVERLAPS=false lvm 500 /tmp/oos/saturated 150 25 json 2>&1 | tee $OUT/console_saturated.log ;;
esac
wait
tar czf $OUT/runs_$phase.tgz --exclude=trace.json --exclude=plots -C /tmp/oos $phase
tar czf $OUT/store_$phase.tgz .cache/spec_costs
ls -la $OUT; du -sh /tmp/oos/$phase .cache/spec_costs
