#!/usr/bin/env bash
# A plan of GPU jobs (populora_verl.bench.gpu_plan) in the background on one staged GPU machine: the jobs of a
# phase side by side on their own GPUs, phase after phase, while the caller polls with short commands.
#   bash scripts/gpu/gpu_plan.sh start scripts/gpu/plans/4gpu_proofs_and_scaling.plan   # returns at once
#   bash scripts/gpu/gpu_plan.sh wait 420     # block until done or 420 s passed, then status (+ plan.tgz to $OUT)
#   bash scripts/gpu/gpu_plan.sh status
#   bash scripts/gpu/gpu_plan.sh stop         # start no further phase (running jobs finish)
#   bash scripts/gpu/gpu_plan.sh kill         # end everything now
# The code runs from a private copy (/tmp/populora-src): a new copy of the checkout may arrive while it runs.
set -uo pipefail
ROOT=${GPU_PLAN_OUT:-/tmp/gpu_plan}
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT" "$ROOT"
cmd=${1:-status}; shift || true
source scripts/gpu/bg_lib.sh
case "$cmd" in
  start)
    plan=${1:?usage: gpu_plan.sh start PLAN_FILE}
    bg_refuse_if_running
    source scripts/gpu/env.sh
    cp "$plan" "$ROOT/plan.txt"
    bg_launch populora_verl.bench.gpu_plan --plan "$ROOT/plan.txt" --out "$ROOT" \
      --gpu-count "$(nvidia-smi --list-gpus | wc -l)" ;;
  status)
    source scripts/gpu/env.sh >/dev/null 2>&1
    PYTHONPATH="/tmp/populora-src:${PYTHONPATH:-}" python3 -m populora_verl.bench.gpu_plan --status --out "$ROOT" \
      | tee "$OUT/status.txt"
    echo "--- driver.log (tail)"; tail -4 "$ROOT/driver.log" 2>/dev/null
    for log in "$ROOT"/*.log; do
      case "$(basename "$log")" in driver.log|gpu_mem.log) continue ;; esac
      echo "--- $(basename "$log"): populora lines, checks and errors (tail)"
      grep -a "\[populora\] \(layout\|step\|resumed\|seeding\|dry run\|start-up\|vLLM engine core\)\|^OK \|^MISS \|exit=\|Error\|Traceback\|out of memory" "$log" \
        | grep -av "Warning\|warn(\|_moe_C\|engine is not available" | cut -c1-300 | tail -8
    done
    echo "--- GPU (MiB used, util % per GPU):"; tail -1 "$ROOT/gpu_mem.log" 2>/dev/null
    # Everything small in one archive (the device returns at most 8 files); logs cut to their last 3 MB.
    tmp=$(mktemp -d); mkdir -p "$tmp/plan"
    (cd "$ROOT" && for f in *; do
       if [ -d "$f" ]; then mkdir -p "$tmp/plan/$f"
         find "$f" -maxdepth 1 -type f -size -3M -exec cp {} "$tmp/plan/$f/" \;
         for big in $(find "$f" -maxdepth 1 -type f -size +3M); do tail -c 3000000 "$big" > "$tmp/plan/$big"; done
       else tail -c 3000000 "$f" > "$tmp/plan/$f"; fi; done) 2>/dev/null
    tar -czf "$OUT/plan.tgz" -C "$tmp" plan && rm -rf "$tmp"
    ls -la "$OUT/plan.tgz" ;;
  wait)
    bg_wait "${1:-420}"
    exec bash "$0" status ;;
  stop) : > "$ROOT/STOP"; echo "no further phase will start" ;;
  kill)
    pid=$(cat "$ROOT/driver.pid" 2>/dev/null) || { echo "no run"; exit 0; }
    kill -TERM "$pid" 2>/dev/null   # the driver ends each job's process group
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null; echo "killed $pid" ;;
  *) echo "usage: gpu_plan.sh start PLAN|status|wait [seconds]|stop|kill" >&2; exit 2 ;;
esac
