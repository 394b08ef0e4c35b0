#!/usr/bin/env bash
# Multi-GPU proof of PopuLoRA on N GPUs of one host, run from the repo root on the GPU node after staging
# (scripts/gpu/README.md). Results go to $OUT (a folder you copy back from the node) or ./gpu-out.
#
#   bash scripts/gpu/multi_gpu_proof.sh shard_check N
#       the adapter bank under verl's FSDP2 on N NCCL ranks (no vLLM, ~1 min): per-slot training vs one process,
#       weight-sync gather, per-rank save/load, evolution (populora_verl.workers.shard_check)
#   bash scripts/gpu/multi_gpu_proof.sh proof N replicas|tp [hydra overrides...]
#       4T4S through verl + Ray on N GPUs: `replicas` = N vLLM replicas with TP 1, `tp` = N/2 replicas with TP 2.
#       Run 1: steps 1-2 (evolution + checkpoint at 2); run 2: resume to step 4. MGPU_PHASE=run1|run2 splits the two
#       runs over two calls on a warm machine (logs kept in /tmp/mgpu_<N>_<layout>); MGPU_PHASE=one is one run to
#       step 3 (evolution and checkpoint at 2, no resume), half the GPU time.
#   bash scripts/gpu/multi_gpu_proof.sh scaling G [TP] [hydra overrides...]
#       the same 4T4S config on the first G GPUs (populora_verl.bench.gpu_scaling); one G per call, rows merge in
#       /tmp/gpu_scaling (MGPU_SCALING_STEPS steps per row, default 5, step 1 left out; the varlen profile, 1,024-token
#       forced answers: gpu_scaling --help). Run G=1 on the same machine first: it is the baseline of the speed-up.
#
# Checks of `proof` (each an OK/MISS line in summary.txt; exit != 0 if one is missing): those of scripts/gpu_proof.sh
# (greedy outputs differ by LoRA id, per-adapter rollout-vs-trainer log-prob diff, only trained slots changed,
# evolution, checkpoint, resume), plus: the layout line shows N GPUs and the expected replicas; every rank changed
# exactly the trained slots; every replica holds every LoRA id of the step (evolved ids included) and gives distinct
# greedy log-probs per adapter once trained.
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
job=${1:?job: shard_check | proof | scaling}; shift
N=${1:?number of GPUs}; shift
have=$(nvidia-smi --list-gpus | wc -l)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
[ "$have" -ge "$N" ] || { echo "multi_gpu_proof: needs $N GPUs, this machine has $have"; exit 2; }
# The first N GPUs, unless the caller chose them (populora_verl.bench.gpu_plan runs jobs side by side on one host)
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((N - 1)))}
[ "$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)" -ge "$N" ] \
  || { echo "multi_gpu_proof: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES has fewer than $N GPUs"; exit 2; }

case "$job" in
  shard_check)
    rm -rf /tmp/shard_check
    python3 -m torch.distributed.run --standalone --nproc-per-node "$N" -m populora_verl.workers.shard_check \
      --out /tmp/shard_check 2>&1 \
      | grep -v -i "warn" | tee "$OUT/shard_check_${N}gpu.log"
    exit "${PIPESTATUS[0]}" ;;
  scaling)
    # rows of runs made side by side go to their own folders (MGPU_SCALING_OUT); gpu_scaling --merge joins them
    SCALING_OUT=${MGPU_SCALING_OUT:-/tmp/gpu_scaling}
    TP=1
    if [[ ${1:-} =~ ^[0-9]+$ ]]; then TP=$1; shift; fi
    python3 -m populora_verl.bench.gpu_scaling --model "$MODEL_DIR" --gpus "$N" --tp "$TP" \
      --steps "${MGPU_SCALING_STEPS:-5}" --out "$SCALING_OUT" "$@" 2>&1 | grep -v "Warning\|warn(" \
      | tee "$OUT/gpu_scaling_${N}gpu_tp${TP}.log"
    rc=${PIPESTATUS[0]}
    cp "$SCALING_OUT"/results.md "$SCALING_OUT"/results.json "$OUT/" 2>/dev/null
    exit "$rc" ;;
  proof) ;;
  *) echo "unknown job $job" >&2; exit 2 ;;
esac

layout=${1:?layout: replicas | tp}; shift
case "$layout" in
  replicas) TP=1 ;;
  tp) TP=2 ;;
  *) echo "layout must be replicas or tp, got $layout" >&2; exit 2 ;;
esac
REPLICAS=$((N / TP))
DIR=${MGPU_DIR:-/tmp/mgpu_${N}_${layout}}
PHASE=${MGPU_PHASE:-all}
[ "$PHASE" = run2 ] || rm -rf "$DIR"
mkdir -p "$DIR"
overrides=(
  trainer.n_gpus_per_node="$N" trainer.nnodes=1
  actor_rollout_ref.rollout.tensor_model_parallel_size="$TP"
  populora.population.num_teachers=4 populora.population.num_students=4
  actor_rollout_ref.rollout.agent.num_workers=$((2 * REPLICAS))
  data.max_response_length=256
)
# The whole output to $DIR/$PHASE.out; the step lines also live on stdout, so a background runner's log
# (populora_verl.bench.gpu_plan) shows how far the proof got while it runs.
# Ray's logical CPUs: the task runner and TransferQueue's actors take one each, the actor's placement group asks 3 per
# GPU, and the agent-loop and reward workers one each; with verl's 8 storage units gpu_proof.sh's 16 left a 4-GPU
# group pending forever
GPU_PROOF_NUM_CPUS=${GPU_PROOF_NUM_CPUS:-$((16 * N))} \
GPU_PROOF_PHASE=$PHASE GPU_PROOF_TIMEOUT_S=${GPU_PROOF_TIMEOUT_S:-540} \
  bash scripts/gpu_proof.sh "$MODEL_DIR" "$DIR" "${overrides[@]}" "$@" 2>&1 | tee "$DIR/$PHASE.out" \
  | grep --line-buffered -aE '\[populora\] (layout|seeding|resumed|step [0-9]+(:| evolution| rank| replica probe))|=== gpu_proof|exit=' \
  | cut -c1-300
rc=${PIPESTATUS[0]}
echo "--- summary of $DIR/$PHASE.out"
grep -hE '\[populora\]|^(OK|MISS|SKIP) |exit=' "$DIR/$PHASE.out" | cut -c1-400 | tail -60
grep -hE 'Traceback|Error' "$DIR/$PHASE.out" | head -5
if [ "$PHASE" != run1 ] && { [ -f "$DIR/run2_resume_to4.log" ] || [ -f "$DIR/run1_steps1-3.log" ]; }; then
  bash scripts/gpu/multi_gpu_checks.sh "$DIR" "$N" "$TP"
  checks=$?
  [ "$rc" -eq 0 ] && rc=$checks
fi
for f in "$DIR"/*.log; do tail -c 3000000 "$f" > "$OUT/${N}gpu_${layout}_$(basename "$f")"; done
for f in summary.txt populora_lines.txt rollout_probs_diff.txt; do
  [ -f "$DIR/$f" ] && cp "$DIR/$f" "$OUT/${N}gpu_${layout}_$f"
done
cat "$DIR/summary.txt" 2>/dev/null
exit $rc
