#!/usr/bin/env bash
# Learning run v5 on one 4 x H200 node: the population against the AZR single agent on Qwen2.5-Coder-1.5B-Instruct,
# two seeds of each arm per node, one arm per GPU, 40 steps, every final member and the base model evaluated
# (HumanEval+, MBPP+, greedy pass@1). Four seeds per arm take two nodes' runs:
#   bash scripts/gpu/learning_run_v5.sh 1         # seeds 1 and 2: single@1 single@2 2t2s@1 2t2s@2 (GPUs 0-3)
#   bash scripts/gpu/learning_run_v5.sh 2         # seeds 3 and 4
#   bash scripts/gpu/learning_run.sh wait 540     # poll until "state finished"; each poll leaves $OUT/learn.tgz
#   bash scripts/gpu/learning_run_v5.sh 1 check   # start nothing: compose and check the four arms' configs and
#                                                 # print each adapter's planned work per step (CPU is enough)
# The time budget, and why the population is 2T2S rather than the paper's 4T4S: scripts/gpu/learning_v5.md.
# Both arms train at v4's per-adapter budget (30 trained trajectories per adapter and step on average, answers up
# to 1,024 tokens): learning_run_4gpu.sh holds those keys for every arm. POP=4t4s runs the paper's population at the
# same budget, which needs about 40 minutes of the node (learning_v5.md) and MINUTES=30.
# MINUTES (default 23) is when the stop files are written, counted from the launch: a safety net for an arm that
# has not reached step 40 by then (the estimate puts 2T2S at step 40 about 20 minutes after the launch).
set -euo pipefail
half=${1:-}
case "$half" in
  1) seeds=(1 2) ;;
  2) seeds=(3 4) ;;
  *) echo "usage: learning_run_v5.sh 1|2 [check]   (1: seeds 1 and 2; 2: seeds 3 and 4)" >&2; exit 2 ;;
esac
case "${2:-start}" in
  start) ;;
  check) export CHECK=1 ;;
  *) echo "usage: learning_run_v5.sh 1|2 [check]" >&2; exit 2 ;;
esac
pop=${POP:-2t2s}
case "$pop" in 2t2s|4t4s) ;; *) echo "POP must be 2t2s or 4t4s, not $pop" >&2; exit 2 ;; esac
# The single agents first: they end first, and the first evaluation also scores the base model.
export ARMS="single@${seeds[0]},single@${seeds[1]},$pop@${seeds[0]},$pop@${seeds[1]}" STOP_AT=40 GPUS=${GPUS:-0,1,2,3}
exec bash scripts/gpu/learning_run_4gpu.sh "${MINUTES:-23}"
