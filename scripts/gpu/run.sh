#!/usr/bin/env bash
# GPU jobs, run from the repo root on the GPU machine after staging (scripts/gpu/README.md). Results go to $OUT
# (the device tool's return folder) or ./gpu-out.
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
job=${1:?job: bench_operators | eval_base | proof | step_scaling}; shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
case "$job" in
  bench_operators)
    python3 -m populora_verl.bench.operators --device cuda --ranks 16 64 --repeats 10 --warmup 3 \
      --out "$OUT/operators_gpu.md" "$@" 2>&1 | tee "$OUT/bench_operators.log" ;;
  eval_base)
    start=$(date +%s)
    python3 -m populora_verl.eval.cli --model "$MODEL_DIR" --backend vllm --benchmarks humanevalplus,mbppplus \
      --data-dir "$PWD/.gpuwork/benchmarks" --max-new-tokens 768 --gpu-memory-utilization 0.6 \
      --out "$OUT/eval_base" "$@" 2>&1 | tee "$OUT/eval_base.log"
    echo "eval wall-clock: $(( $(date +%s) - start )) s" | tee -a "$OUT/eval_base.log" ;;
  proof)
    bash scripts/gpu_proof.sh "$MODEL_DIR" "$OUT" "$@" ;;
  step_scaling)
    python3 -m populora_verl.bench.step_scaling --model "$MODEL_DIR" --out "$OUT/step_scaling.md" "$@" 2>&1 \
      | tee "$OUT/step_scaling.log" ;;
  *) echo "unknown job $job" >&2; exit 2 ;;
esac
