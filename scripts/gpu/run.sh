#!/usr/bin/env bash
# GPU jobs, run from the repo root on the GPU node after staging (scripts/gpu/README.md). Results go to $OUT
# (a folder you copy back from the node) or ./gpu-out.
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
job=${1:?job: bench_operators | eval_base | proof | step_scaling | validity | retention}; shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
case "$job" in
  bench_operators)
    python3 -m populora_verl.bench.operators --device cuda --ranks 16 64 --repeats 10 --warmup 3 \
      --out "$OUT/operators_gpu.md" "$@" 2>&1 | tee "$OUT/bench_operators.log" ;;
  eval_base)
    start=$(date +%s)
    python3 -m populora_verl.eval.cli --model "$MODEL_DIR" --backend vllm --benchmarks humaneval_plus,mbpp_plus \
      --data-dir "$PWD/.gpuwork/benchmarks" --max-new-tokens 768 --gpu-memory-utilization 0.6 \
      --out "$OUT/eval_base" "$@" 2>&1 | tee "$OUT/eval_base.log"
    echo "eval wall-clock: $(( $(date +%s) - start )) s" | tee -a "$OUT/eval_base.log" ;;
  proof)
    bash scripts/gpu_proof.sh "$MODEL_DIR" "$OUT" "$@" ;;
  step_scaling)
    # Foreground (fits only a few configurations in ten minutes); for the full table run
    # scripts/gpu/step_scaling_bg.sh start ... and poll it. /tmp keeps earlier rows while the machine is warm.
    python3 -m populora_verl.bench.step_scaling --model "${STEP_SCALING_MODEL:-0.5b=$MODEL_DIR}" \
      --out /tmp/step_scaling "$@" 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/step_scaling.log"
    cp -r /tmp/step_scaling/*/results.md /tmp/step_scaling/*/results.json "$OUT/" 2>/dev/null ;;
  validity)
    # Valid-proposal rate per task type with failure reasons, and student solve rates, for both training templates.
    # Later arguments override these (argparse keeps the last), e.g. `bash scripts/gpu/run.sh validity --lengths 1024 2048`.
    start=$(date +%s)
    python3 -m populora_verl.bench.validity --model "$MODEL_DIR" --engine vllm --templates azr chat \
      --lengths 1024 --temperatures 1.0 --proposals 64 --student-n 4 --gpu-memory-utilization 0.85 \
      --out "$OUT/validity" "$@" 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/validity.log"
    echo "validity wall-clock: $(( $(date +%s) - start )) s" | tee -a "$OUT/validity.log" ;;
  retention)
    # Operator retention on Qwen2.5-Coder-0.5B-Instruct with 3 fine-tuned adapters (BENCHMARKS.md); < 4 min on H100.
    start=$(date +%s)
    python3 -m populora_verl.bench.retention_real --model "$MODEL_DIR" --out "$OUT/retention_real.md" "$@" 2>&1 \
      | grep -v "Warning\|warn(" | tee "$OUT/retention_real.log"
    echo "retention wall-clock: $(( $(date +%s) - start )) s" | tee -a "$OUT/retention_real.log" ;;
  *) echo "unknown job $job" >&2; exit 2 ;;
esac
