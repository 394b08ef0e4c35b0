#!/usr/bin/env bash
# On the GPU machine: GGUF -> HF safetensors (bf16) with the image's transformers + the carried gguf wheel.
#   bash scripts/gpu/convert_model.sh [0.5b|1.5b]   -> /tmp/models/qwen-coder-<size>
set -euo pipefail
size=${1:-0.5b}
case "$size" in 0.5b|1.5b) ;; *) echo "usage: convert_model.sh [0.5b|1.5b]" >&2; exit 2 ;; esac
dst=/tmp/models/qwen-coder-$size
[ -f $dst/config.json ] && { echo "model already converted: $dst"; exit 0; }
source scripts/gpu/env.sh
if [ ! -d /tmp/gguf-site ]; then
  # The wheel travels with the bundle (.gpuwork) or with the clean-code carry (.gpuclean), depending on the staging.
  whl=$(ls .gpuwork/gguf-*.whl .gpuwork/whl/gguf-*.whl .gpuclean/gguf-*.whl 2>/dev/null | head -1 || true)
  [ -n "$whl" ] || { echo "convert_model: no gguf wheel in .gpuwork/ or .gpuclean/: carry one" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --target /tmp/gguf-site "$whl"
fi
t0=$(date +%s)
PYTHONPATH="/tmp/gguf-site:$PYTHONPATH" python3 -m populora_verl.models convert \
  /tmp/models/qwen-coder-$size-instruct-q4_k_m.gguf $dst --dtype bfloat16
echo "converted in $(( $(date +%s) - t0 )) s on $(nproc) CPUs"  # the staging figure of BENCHMARKS.md §8
ls -la $dst
