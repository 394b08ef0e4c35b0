#!/usr/bin/env bash
# GPU proof of the verl trainer `populora` (smoke_0.5b: 2 teachers + 2 students on one GPU).
#   scripts/gpu_proof.sh MODEL_DIR OUT_DIR [extra hydra overrides...]
# Run 1: steps 1-2 (evolution + checkpoint at step 2). Run 2: resume from step 2 to step 4 (evolution again at 4).
# With +trainer.populora_debug_probes=true the trainer prints, per step: a greedy probe under every LoRA id,
# per-adapter rollout-vs-trainer log-prob diffs, and per-slot bank checksums (only trained slots may change).
# Run from the repository root with verl and vLLM importable (scripts/gpu/env.sh). Exit status != 0 if a proof line is missing.
set -euo pipefail
MODEL_DIR=${1:?usage: scripts/gpu_proof.sh MODEL_DIR OUT_DIR [overrides...]}
OUT_DIR=${2:?usage: scripts/gpu_proof.sh MODEL_DIR OUT_DIR [overrides...]}
shift 2
TIMEOUT_S=${GPU_PROOF_TIMEOUT_S:-1500}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 RAY_AUTH_MODE=disabled
export TOKENIZERS_PARALLELISM=false HYDRA_FULL_ERROR=1 PYTHONUNBUFFERED=1

python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_proof: no CUDA device')"
python -c "import populora_verl.trainer as t; t.register()"   # fails fast if the plugin or verl is broken

common=(
  --config-path "$PWD/recipes/populora" --config-name smoke_0.5b
  actor_rollout_ref.model.path="$MODEL_DIR"
  ++actor_rollout_ref.model.override_config.attn_implementation=sdpa
  trainer.default_local_dir="$OUT_DIR/ckpt"
  trainer.logger=[console]
  trainer.save_freq=2
  populora.pbt.interval_steps=2
  ++populora.pbt.min_age=0            # evolve at step 2 although every member is 2 steps old (default min_age 20)
  ++populora.pbt.final_quiet_steps=0  # and although step 2 is run 1's last step (default: no evolution in the last interval)
  +trainer.populora_debug_probes=true
  ray_kwargs.ray_init.num_cpus=${GPU_PROOF_NUM_CPUS:-16}
)

run() {  # run <name> <total_steps>
  local name=$1 steps=$2; shift 2
  echo "=== gpu_proof: $name (total_training_steps=$steps) ===" | tee -a "$OUT_DIR/summary.txt"
  set +e
  timeout "$TIMEOUT_S" python -m verl.trainer.main_ppo "${common[@]}" trainer.total_training_steps="$steps" "$@" \
    2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  set -e
  echo "$name exit=$rc" | tee -a "$OUT_DIR/summary.txt"
  [ "$rc" -eq 0 ] || { echo "gpu_proof: $name failed (see $OUT_DIR/$name.log)"; exit "$rc"; }
}

# GPU_PROOF_PHASE=run1 | run2 | all: the two runs can go in separate calls (each under a call's time limit) when
# OUT_DIR persists between them (e.g. under /tmp on a warm machine); the checks run after run2.
# GPU_PROOF_PHASE=one: a single run to step 3 (evolution and checkpoint at 2, the evolved members served at 3), no
# resume: half the GPU time of `all`, for when resume is already proven on that layout.
PHASE=${GPU_PROOF_PHASE:-all}
case "$PHASE" in all | run1 | run2 | one) ;; *) echo "gpu_proof: GPU_PROOF_PHASE must be all, run1, run2 or one, got '$PHASE'" >&2; exit 2 ;; esac
if [ "$PHASE" = one ]; then
  rm -f "$OUT_DIR/summary.txt"; run run1_steps1-3 3 "$@"
  R1=run1_steps1-3.log R2=run1_steps1-3.log LAST=3
else
  if [ "$PHASE" != run2 ]; then rm -f "$OUT_DIR/summary.txt"; run run1_steps1-2 2 "$@"; fi
  [ "$PHASE" = run1 ] && exit 0
  LAST=${GPU_PROOF_RESUME_TO:-4}
  run run2_resume_to4 "$LAST" "$@"
  R1=run1_steps1-2.log R2=run2_resume_to4.log
fi

check() {  # check <log> <grep -E pattern> <what>
  if grep -Eq "$2" "$OUT_DIR/$1"; then echo "OK   $3" | tee -a "$OUT_DIR/summary.txt"
  else echo "MISS $3" | tee -a "$OUT_DIR/summary.txt"; missing=1; fi
}
missing=0
check $R1 '\[populora\] seeding: [0-9]+ rounds, [0-9]+ seed tasks' "seeding phase from the base policy before step 1"
check $R1 '\[populora\] step 1 greedy probe' "start-up greedy probe under every LoRA id"
check $R1 '\[populora\] step 2 greedy probe: .*, [2-9]/[0-9]+ distinct greedy log-probs' "vLLM serves each adapter under its own LoRA id (distinct log-probs after step 1)"
if grep -q '\[populora\] step 2 evolution:' "$OUT_DIR/$R1"; then
  check $R2 '\[populora\] step [34] greedy probe: [2-9]/' "greedy outputs differ by LoRA id after evolution"
else echo "MISS greedy outputs differ by LoRA id after evolution: step 2 did not evolve" | tee -a "$OUT_DIR/summary.txt"; missing=1; fi
check $R1 'rollout_vs_trainer=\{"[a-z_]*rollout_probs_diff' "per-adapter rollout-vs-trainer log-prob diff"
check $R1 'bank checksums: .* OK$' "only trained slots changed"
check $R1 '\[populora\] step 2 evolution:' "evolution at step 2"
check $R1 '\[populora\] step 2: checkpoint' "checkpoint at step 2"
if [ "$R2" = "$R1" ]; then
  echo "SKIP resume from step 2: one run (GPU_PROOF_PHASE=one)" | tee -a "$OUT_DIR/summary.txt"
else
  check $R2 '\[populora\] resumed step 2' "resume from step 2"
  if grep -q '\[populora\] seeding:' "$OUT_DIR/$R2"; then echo "MISS a resumed run seeded again" | tee -a "$OUT_DIR/summary.txt"; missing=1; fi
fi
check $R2 "step:$LAST " "reached step $LAST"
if grep -q 'MISMATCH' "$OUT_DIR"/run*.log; then echo "MISS a bank checksum MISMATCH was logged" | tee -a "$OUT_DIR/summary.txt"; missing=1; fi
grep -hE '\[populora\]' "$OUT_DIR"/run*.log > "$OUT_DIR/populora_lines.txt" || true
grep -hoE 'populora/[a-z0-9]+/training/rollout_probs_diff_(mean|max):[-0-9.e]+' "$OUT_DIR"/run*.log \
  > "$OUT_DIR/rollout_probs_diff.txt" || true
cat "$OUT_DIR/summary.txt"
exit "$missing"
