#!/usr/bin/env bash
# One device call of a host of four GPUs (famm, famh: two): a campaign's live runs in lanes, in parallel, each lane its own GPUs
# and cores (benchmarks/campaign_lane.py writes each lane's campaign); the wheels the GPU image lacks in .whl/.
# Everything comes back as one $OUT/res_PHASE.tgz (the device returns few files). As run on 2026-11-28
# (reports/fidelity/live_vs_model.md): DL=500 for rk1 and rk2, DL=360 for fam; later DL=330 for famm, DL=380 for famh,
# DL=450 for rk1, DL=500 for oos4, DL=380 for mtp, DL=240 for rk2s, DL=255 for rkt, DL=430 for rk300 and rk300d, DL=540 for rk1kj and rk1kd, DL=250 for rk600j, DL=470 for oos.
# usage: DL=SECONDS benchmarks/gpu_campaign_lanes.sh PHASE   (rk1 | rk2 | rk2s | rkt | rk300 | rk300d | rk1kj | rk1kd | rk600j | oos | oos4 | fam | famm | famh | mtp)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 CDBENCH_CACHE_DIR=/tmp/cdb_cache PYTHONUNBUFFERED=1 \
  CDBENCH_CORPORA=${CDBENCH_CORPORA:-$PWD/.cache/corpora} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=/tmp/triton_cache
P=$1; R=/tmp/res_$P; mkdir -p $R/logs /tmp/lanes
{ nvidia-smi --query-gpu=index,name,clocks.max.sm,memory.total --format=csv; nproc; git log -1 --format=%H 2>/dev/null;
  python3 -c "import torch, xgrammar; print(torch.__version__, xgrammar.__version__)"; } > $R/logs/device.txt 2>&1
DL=${DL:-470}
lane() {  # name campaign filters gpus cores [warm-up model] [arms kept beside the live ones] [campaign_lane options]
  local name=$1 camp=$2 filt=$3 gpus=$4 cores=$5 warm=${6:-} keep=${7:-} opts=${8:-}
  python3 benchmarks/campaign_lane.py $camp "$filt" /tmp/lanes/$name.yaml $keep $opts > $R/logs/$name.log 2>&1
  if [ -n "$warm" ]; then
    CUDA_VISIBLE_DEVICES=$gpus taskset -c $cores timeout 150 python3 -m cdbench run --mode live --set costs.model=$warm \
      --set costs.gpu=h200 --set workload.num_requests=24 --set workload.arrival.rate=8 --set trace_steps=0 \
      --out /tmp/warm_$name >> $R/logs/$name.log 2>&1
  fi
  CUDA_VISIBLE_DEVICES=$gpus taskset -c $cores timeout $((DL + 60)) python3 -m cdbench campaign run /tmp/lanes/$name.yaml \
    --out $R/$name --deadline-s $DL >> $R/logs/$name.log 2>&1
  echo "lane $name exit $? at $(date +%T)" >> $R/logs/$name.log
}
date +%T > $R/logs/start.txt
case $P in
  rk1) lane tpdef campaigns/ranks_under_vs_model.yaml "scheduler.parallel=tp,workload=default" 0,1 0-15 &
       lane dpdef campaigns/ranks_under_vs_model.yaml "scheduler.parallel=dp,workload=default" 2,3 16-31 & ;;
  # both workloads' TP=2 lanes one after the other on a host of two GPUs (a third replicate of the TP cells)
  rkt) lane tpdef campaigns/ranks_under_vs_model.yaml "scheduler.parallel=tp,workload=default" 0,1 0-31
       lane tpjson campaigns/ranks_under_vs_model.yaml "scheduler.parallel=tp,workload=json" 0,1 0-31 ;;
  # the TP=2 cells with 300 requests a run (campaigns/ranks_under_long_vs_model.yaml)
  rk300) lane tpjson300 campaigns/ranks_under_long_vs_model.yaml "workload=json,workload.num_requests=300" 0,1 0-31 ;;
  # issue 27's acceptance against live, one policy a GPU, the model arms measuring on the lane's cores
  oos) lane oossg campaigns/spec_costs_vs_live.yaml "requests=150,policy.name=sglang" 0 0-15 "" model-defaults,model-own,model-speed &
       lane oosvl campaigns/spec_costs_vs_live.yaml "requests=150,policy.name=vllm" 1 16-31 "" model-defaults,model-own,model-speed & ;;
  # the same, one cell a GPU on a host of four GPUs, the longer runs (400 requests under capacity, 200 saturated)
  oos4) for c in under,sglang,0,400 under,vllm,1,400 sat,sglang,2,200 sat,vllm,3,200; do IFS=, read ph pol g n <<< "$c"
          lane oos4$ph$pol campaigns/spec_costs_vs_live.yaml "phase=$ph,requests=$n,policy.name=$pol" $g \
            $((g * 16))-$((g * 16 + 15)) "" model-defaults,model-own,model-speed &
        done ;;
  rk300d) lane tpdef300 campaigns/ranks_under_long_vs_model.yaml "workload=default,workload.num_requests=300" 0,1 0-31 ;;
  # a 1,000-request TP=2 cell's two live copies side by side on a host of four GPUs, one copy a lane
  rk1kj) lane json1ka campaigns/ranks_under_long_vs_model.yaml "workload=json,workload.num_requests=1000" 0,1 0-31 "" "" "--live-copies 1" &
         lane json1kb campaigns/ranks_under_long_vs_model.yaml "workload=json,workload.num_requests=1000" 2,3 32-63 "" "" "--live-copies 1" & ;;
  rk600j) lane json6a campaigns/ranks_under_long_vs_model.yaml "workload=json,workload.num_requests=600" 0,1 0-31 "" "" "--live-copies 1" &
          lane json6b campaigns/ranks_under_long_vs_model.yaml "workload=json,workload.num_requests=600" 2,3 32-63 "" "" "--live-copies 1" & ;;
  rk1kd) lane def1ka campaigns/ranks_under_long_vs_model.yaml "workload=default,workload.num_requests=1000" 0,1 0-31 "" "" "--live-copies 1" &
         lane def1kb campaigns/ranks_under_long_vs_model.yaml "workload=default,workload.num_requests=1000" 2,3 32-63 "" "" "--live-copies 1" & ;;
  rk2) lane tpjson campaigns/ranks_under_vs_model.yaml "scheduler.parallel=tp,workload=json" 0,1 0-15 &
       lane dpjson campaigns/ranks_under_vs_model.yaml "scheduler.parallel=dp,workload=json" 2,3 16-31 & ;;
  fam) lane moeu campaigns/model_family_vs_model.yaml "costs.model=qwen3-30b-a3b,load=under" 0 0-7 &
       lane moes campaigns/model_family_vs_model.yaml "costs.model=qwen3-30b-a3b,load=sat" 1 8-15 &
       lane hybu campaigns/model_family_vs_model.yaml "costs.model=qwen3.5-35b-a3b,load=under" 2 16-23 qwen3.5-35b-a3b &
       lane hybs campaigns/model_family_vs_model.yaml "costs.model=qwen3.5-35b-a3b,load=sat" 3 24-31 qwen3.5-35b-a3b & ;;
  # the same lanes on a host of two GPUs (32 cores), one model a call
  famm) lane moeu campaigns/model_family_vs_model.yaml "costs.model=qwen3-30b-a3b,load=under" 0 0-15 &
        lane moes campaigns/model_family_vs_model.yaml "costs.model=qwen3-30b-a3b,load=sat" 1 16-31 & ;;
  famh) lane hybu campaigns/model_family_vs_model.yaml "costs.model=qwen3.5-35b-a3b,load=under" 0 0-15 qwen3.5-35b-a3b &
        lane hybs campaigns/model_family_vs_model.yaml "costs.model=qwen3.5-35b-a3b,load=sat" 1 16-31 qwen3.5-35b-a3b & ;;
  # rk2's lanes one after the other on a host of two GPUs
  rk2s) lane tpjson campaigns/ranks_under_vs_model.yaml "scheduler.parallel=tp,workload=json" 0,1 0-31
        lane dpjson campaigns/ranks_under_vs_model.yaml "scheduler.parallel=dp,workload=json" 0,1 0-31 ;;
  # the hybrid drafting with its MTP head (campaigns/mtp_vs_model.yaml), one GPU a load
  mtp) lane mtpu campaigns/mtp_vs_model.yaml "load=under" 0 0-15 qwen3.5-35b-a3b &
       lane mtps campaigns/mtp_vs_model.yaml "load=sat" 1 16-31 qwen3.5-35b-a3b & ;;
esac
wait
find $R -name "*.jsonl.gz" -path "*trace*" -size +4M -delete
tar czf $OUT/res_$P.tgz -C /tmp res_$P
ls -la $OUT; for f in $R/logs/*.log; do echo "== $f"; tail -5 $f; done
