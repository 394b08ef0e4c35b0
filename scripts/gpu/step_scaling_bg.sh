#!/usr/bin/env bash
# The step-scaling benchmark in the background on the GPU machine, so one staged machine runs every configuration
# while the caller polls with short calls. Results and logs land incrementally in /tmp/step_scaling.
#   bash scripts/gpu/step_scaling_bg.sh start [step_scaling args...]   # returns at once
#   bash scripts/gpu/step_scaling_bg.sh status                         # progress + tables so far (copied to $OUT)
#   bash scripts/gpu/step_scaling_bg.sh wait 420                       # block until done or 420 s passed, then status
#   bash scripts/gpu/step_scaling_bg.sh stop                           # ends the run's process group
# The code runs from a private copy (/tmp/populora-src): a new copy of the checkout may arrive while it runs.
set -uo pipefail
ROOT=${STEP_SCALING_OUT:-/tmp/step_scaling}
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT" "$ROOT"
cmd=${1:-status}; shift || true
source scripts/gpu/bg_lib.sh
case "$cmd" in
  start)
    bg_refuse_if_running
    source scripts/gpu/env.sh
    bg_launch populora_verl.bench.step_scaling --out "$ROOT" "$@" ;;
  status)
    source scripts/gpu/env.sh >/dev/null 2>&1
    python3 -m populora_verl.bench.step_scaling --status --out "$ROOT" | tee "$OUT/status.txt"
    echo "--- driver.log (tail)"; tail -5 "$ROOT/driver.log" 2>/dev/null
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    # the evidence so far: tables, per-step metrics, the tail of each log, ceiling results
    for d in "$ROOT"/*/; do
      [ -d "$d" ] || continue; t=$(basename "$d"); mkdir -p "$OUT/$t"
      cp "$d"/results.* "$d"/*.metrics.jsonl "$d"/ceiling*.json "$OUT/$t/" 2>/dev/null
      for f in "$d"/*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$OUT/$t/$(basename "$f")"; done
    done
    cp "$ROOT"/gpu.txt "$ROOT"/progress.json "$ROOT"/driver.log "$OUT/" 2>/dev/null
    # --profile-steps: the traces are too large to bring back; their summaries are not
    traces=$(find "$ROOT/profile" -name '*.json.gz' 2>/dev/null)
    [ -n "$traces" ] && python3 -m populora_verl.bench.trace_summary $traces --out "$OUT/profile_summary.md"
    true ;;
  wait)
    bg_wait "${1:-420}"
    exec bash "$0" status ;;
  stop)
    pid=$(cat "$ROOT/driver.pid" 2>/dev/null) || { echo "no run"; exit 0; }
    # SIGTERM: the driver ends the running configuration and saves what it logged, then exits
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null
    ray stop --force >/dev/null 2>&1; echo "stopped $pid" ;;
  *) echo "usage: step_scaling_bg.sh start|status|wait [seconds]|stop [args]" >&2; exit 2 ;;
esac
