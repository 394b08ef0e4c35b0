#!/usr/bin/env bash
# The two-seed learning run on one 4-GPU node: 2T2S and the AZR single agent, seeds 1 and 2, each arm alone on its
# own GPU, one seed set for all (run A's, in the repo), then HumanEval+/MBPP+ of every arm at the last common
# checkpoint. Run from the repo root after staging the bundle and the 1.5B model (scripts/gpu/README.md):
#   bash scripts/gpu/learning_run_4gpu.sh [minutes before the stop files, default 24]
#   ARMS=2t2s@1,2t2s@2,2t2s@3,2t2s@4 bash scripts/gpu/learning_run_4gpu.sh   # other arms, one per GPU
#   ARMS=2t2s@3,2t2s@4 GPUS=0,1 bash scripts/gpu/learning_run_4gpu.sh         # two GPUs, the others left free
#   ARMS=4t4s@1,4t4s@2,single@1,single@2 bash scripts/gpu/learning_run_4gpu.sh  # the paper's 4T4S (qwen1.5b_1gpu_4t4s)
# Four seeds per arm (the fewest for which the permutation across seeds can reach p < 0.05: 4 + 4 give 1/35) take two
# nodes' runs: seeds 1-2 on one, 3-4 on the other, with the same SEEDS file (learning_run_v5.sh 1|2 does both halves).
# A 4T4S step trains twice the 2T2S work: about 37 s with resident adapters against 2T2S's 21 s, so its 40 steps and
# the evaluation of its 8 members need about 28 min beside the start-up (learning_v5.md): more than 30 min of a node.
#   CHECK=1 MODEL=/path/with/config.json bash scripts/gpu/learning_run_4gpu.sh   # starts nothing: checks the arms
# The minutes are a safety net: an arm stopped by them ends at its next safe step, short of STOP_AT. With 6.3 min of
# start-up and 14.7-16 min for 40 population steps on an H200, 24 leaves the stop step to STOP_AT.
# Every arm ends at step STOP_AT (default 40) or at the deadline; an arm that reaches STOP_AT is evaluated at once on
# its own GPU while the others still train (the single agents take about half a population step). Each evaluation
# engine starts about 2 min before its arm's stop step, beside the trainer, so only generation and grading follow it.
#   bash scripts/gpu/learning_run.sh wait 540        # repeat until "state finished"; $OUT/learn.tgz has it all
#
# The batch is cut from the recipes' 90 to 30 trained trajectories per adapter and step, so that 40 population steps
# fit 30 minutes of one node: 2T2S at 4 proposals per type and 4 answers per task, the single agent at 5 proposals per
# type (tests/project/test_recipes.py keeps the two compute-matched). A checkpoint every 20 steps instead of 5 (each
# takes 8-14 s): the stop at STOP_AT saves its own, and step 20 is the fallback should an arm die.
set -euo pipefail
minutes=${1:-24}
MODEL=${MODEL:-/tmp/models/qwen-coder-1.5b}
SEEDS=${SEEDS:-docs/results/2026-11-26-qwen1.5b/run-a-1024/seed_tasks.jsonl}
ROOT=${LEARN_OUT:-/tmp/learn}
mkdir -p "$ROOT" && cp "$SEEDS" "$ROOT/seed_tasks.jsonl"  # the checkout under a running driver is replaced per call
args=(--model "$MODEL" --seed-file "$ROOT/seed_tasks.jsonl"
  --arms "${ARMS:-2t2s@1,2t2s@2,single@1,single@2}" --gpus "${GPUS:-0,1,2,3}"
  --stop-after-min "$minutes" --grace-min 4 --stop-at-step "${STOP_AT:-40}"
  --arm-override 2t2s:populora.rollout.proposals_per_type=4
  --arm-override 4t4s:populora.rollout.proposals_per_type=4
  --arm-override single:populora.rollout.proposals_per_type=5
  populora.rollout.student_n=4 trainer.save_freq="${SAVE_FREQ:-20}")
# CHECK=1: start nothing; compose each arm's config as its command would, run the start-up checks that need no GPU
# and print every adapter's planned trajectories and tokens per step (a CPU machine with the package will do; MODEL
# must name a folder with a config.json). PYTHON picks the interpreter.
if [ "${CHECK:-0}" = 1 ]; then exec "${PYTHON:-python3}" -m populora_verl.bench.learning_run --check --out "$ROOT" "${args[@]}"; fi
exec bash scripts/gpu/learning_run.sh start "${args[@]}"
