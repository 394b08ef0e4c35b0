#!/usr/bin/env bash
# The multi-GPU checks of scripts/gpu/multi_gpu_proof.sh over the logs of a finished proof (run1 + run2, or the one
# run to step 3 of MGPU_PHASE=one, where "after resume" reads "at step 3, after evolution"):
#   bash scripts/gpu/multi_gpu_checks.sh DIR N TP
# Appends OK/MISS lines to DIR/summary.txt; exit 1 if one is missing. No GPU needed (the CPU tests run it on logs
# made from the same Python functions that print these lines on a GPU run).
set -uo pipefail
DIR=${1:?usage: multi_gpu_checks.sh DIR N TP}; N=${2:?N}; TP=${3:?TP}
REPLICAS=$((N / TP))
R1=run1_steps1-2.log R2=run2_resume_to4.log AFTER="after resume"
if [ ! -f "$DIR/$R2" ] && [ -f "$DIR/run1_steps1-3.log" ]; then
  R1=run1_steps1-3.log R2=run1_steps1-3.log AFTER="at step 3"
fi
missing=0
check() {  # check <log> <grep -E pattern> <what>
  if grep -Eq "$2" "$DIR/$1" 2>/dev/null; then echo "OK   $3" | tee -a "$DIR/summary.txt"
  else echo "MISS $3" | tee -a "$DIR/summary.txt"; missing=1; fi
}
check $R1 "\[populora\] layout: $N GPU\(s\) on 1 node\(s\); actor: $N data-parallel rank\(s\), every adapter sharded over $N; rollout: $REPLICAS vLLM replica\(s\) x $TP GPU" \
  "layout: $N FSDP2 ranks, $REPLICAS replica(s) x TP $TP"
ranks_re=$(for r in $(seq 0 $((N - 1))); do printf 'rank%d:\\[[0-9, ]*\\] ' "$r"; done)
check $R1 "step 1 rank checksums: ${ranks_re}\| trained=.* OK$" "every rank changed exactly the trained slots (step 1)"
check $R2 "step [34] rank checksums: ${ranks_re}\| trained=.* OK$" "every rank changed exactly the trained slots $AFTER"
check $R1 "step 1 replica probe: $REPLICAS replica\(s\), every LoRA id on every replica OK" "every replica serves every LoRA id"
for r in $(seq 0 $((REPLICAS - 1))); do
  check $R1 "step 2 replica $r: [0-9]+/[0-9]+ LoRA ids loaded, [2-9]/[0-9]+ distinct" "replica $r: adapters differ after training"
done
# Only meaningful if step 2 did evolve (the proof sets pbt.min_age=0 and final_quiet_steps=0 so that it does)
if grep -Eq '\[populora\] step 2 evolution: ' "$DIR/$R1" 2>/dev/null; then
  check $R2 "step 3 replica probe: $REPLICAS replica\(s\), every LoRA id on every replica OK" \
    "evolved adapters (step 2) served by every replica $AFTER"
else
  echo "MISS evolved adapters (step 2) served by every replica $AFTER: step 2 did not evolve" \
    | tee -a "$DIR/summary.txt"; missing=1
fi
if grep -q 'rank checksums: .*MISMATCH\|replica probe: .*MISMATCH' "$DIR"/run*.log 2>/dev/null; then
  echo "MISS a per-rank or per-replica MISMATCH was logged" | tee -a "$DIR/summary.txt"; missing=1
fi
grep -hE '\[populora\]' "$DIR"/run*.log > "$DIR/populora_lines.txt" 2>/dev/null || true
exit $missing
