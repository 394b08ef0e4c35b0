#!/usr/bin/env bash
# Plumbing check of the verl path on a tiny random Qwen2 (real Qwen tokenizer, 2 layers, hidden 64) that travels in
# .gpuwork/tiny-qwen.tar.xz (2.6 MB): no 9-part model staging needed, so a cold machine needs only the bundle.
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
[ -d /tmp/models/tiny-qwen ] || { mkdir -p /tmp/models && tar -xJf .gpuwork/tiny-qwen.tar.xz -C /tmp/models; }
GPU_PROOF_TIMEOUT_S=${GPU_PROOF_TIMEOUT_S:-260} bash scripts/gpu_proof.sh /tmp/models/tiny-qwen "$OUT/tiny" \
  data.max_response_length=128 data.max_prompt_length=1536 "$@"
rc=$?
for f in "$OUT"/tiny/*.log; do tail -c 60000 "$f" > "$f.tail"; rm "$f"; done
exit $rc
