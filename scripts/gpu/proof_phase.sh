#!/usr/bin/env bash
# One phase of the real-model GPU proof (logs kept in /tmp/proof between calls on a warm machine), then copies
# the evidence to $OUT. Usage: bash scripts/gpu/proof_phase.sh run1|run2 [hydra overrides...]
set -uo pipefail
source scripts/gpu/env.sh
phase=$1; shift
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT" /tmp/proof
GPU_PROOF_PHASE=$phase GPU_PROOF_TIMEOUT_S=${GPU_PROOF_TIMEOUT_S:-540} \
  bash scripts/gpu_proof.sh "$MODEL_DIR" /tmp/proof "$@" > /tmp/proof/$phase.out 2>&1
rc=$?
grep -hE '\[populora\]|^(OK|MISS) |exit=' /tmp/proof/$phase.out | cut -c1-700 | tail -80
grep -hE 'Traceback|Error' /tmp/proof/$phase.out | head -5
for f in /tmp/proof/*.log; do tail -c 3000000 "$f" > "$OUT/$(basename "$f")"; done
cp /tmp/proof/summary.txt /tmp/proof/populora_lines.txt /tmp/proof/rollout_probs_diff.txt "$OUT/" 2>/dev/null
cp /tmp/proof/ckpt/metrics.jsonl "$OUT/proof_metrics.jsonl" 2>/dev/null
exit $rc
