#!/usr/bin/env bash
# On the GPU machine: GGUF -> HF safetensors (bf16) with the image's transformers + the carried gguf wheel.
set -euo pipefail
[ -f /tmp/models/qwen-coder-0.5b/config.json ] && { echo "model already converted"; exit 0; }
source scripts/gpu/env.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/gguf-site .gpuwork/gguf-*.whl
PYTHONPATH="/tmp/gguf-site:$PYTHONPATH" python3 -m populora_verl.models convert \
  /tmp/models/qwen-coder-0.5b-instruct-q4_k_m.gguf /tmp/models/qwen-coder-0.5b --dtype bfloat16
ls -la /tmp/models/qwen-coder-0.5b
