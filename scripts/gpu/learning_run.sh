#!/usr/bin/env bash
# The learning run in the background on one staged GPU machine (populora_verl.bench.learning_run): the arms side by
# side, stop files after --stop-after-min, then the evaluation. Poll it with short device calls.
#   bash scripts/gpu/learning_run.sh start --model /tmp/models/qwen-coder-1.5b --stop-after-min 15 [args...]
#   bash scripts/gpu/learning_run.sh wait 420     # block until done or 420 s passed, then status (+ files to $OUT)
#   bash scripts/gpu/learning_run.sh status
#   bash scripts/gpu/learning_run.sh stop         # stop files now (arms end at their next safe step)
#   bash scripts/gpu/learning_run.sh kill         # end everything at once
# The code runs from a private copy (/tmp/populora-src): a new copy of the checkout may replace the one under the run.
set -uo pipefail
ROOT=${LEARN_OUT:-/tmp/learn}
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT" "$ROOT"
cmd=${1:-status}; shift || true
source scripts/gpu/bg_lib.sh
case "$cmd" in
  start)
    bg_refuse_if_running
    source scripts/gpu/env.sh
    # both arms share the card: gpu_mem.log is the run's memory record
    bg_launch populora_verl.bench.learning_run --out "$ROOT" --data-dir "$PWD/.gpuwork/benchmarks" "$@" ;;
  status)
    source scripts/gpu/env.sh >/dev/null 2>&1
    PYTHONPATH="/tmp/populora-src:${PYTHONPATH:-}" python3 -m populora_verl.bench.learning_run --status --out "$ROOT" \
      | tee "$OUT/status.txt"
    echo "--- driver.log (tail)"; tail -6 "$ROOT/driver.log" 2>/dev/null
    for a in "$ROOT"/*/train.log; do
      [ -f "$a" ] || continue
      echo "--- $a: errors and populora lines (tail)"
      grep -a "\[populora\]\|Error\|error:\|Traceback\|OOM\|out of memory" "$a" \
        | grep -av "Warning\|warn(\|_moe_C\|engine is not available" | tail -6
    done
    echo "--- GPU (MiB used, util %):"; tail -2 "$ROOT/gpu_mem.log" 2>/dev/null
    # Everything small in one archive (the device returns at most 8 files): metrics, logs' tails, seed set,
    # eval results, compare figures, progress; never the checkpoints.
    tmp=$(mktemp -d); mkdir -p "$tmp/learn"
    (cd "$ROOT" && for f in progress.json gpu.txt driver.log gpu_mem.log eval.log eval_command.txt; do
       [ -f "$f" ] && cp "$f" "$tmp/learn/"; done
     for d in */; do d=${d%/}; case "$d" in eval|compare) cp -r "$d" "$tmp/learn/" ;; *)
       mkdir -p "$tmp/learn/$d"
       for f in metrics.jsonl verl_metrics.jsonl seed_tasks.jsonl command.txt events.jsonl evolution.jsonl; do
         [ -f "$d/$f" ] && cp "$d/$f" "$tmp/learn/$d/"; done
       [ -f "$d/train.log" ] && tail -c 3000000 "$d/train.log" > "$tmp/learn/$d/train.log"
       ls "$d" > "$tmp/learn/$d/ls.txt" 2>/dev/null ;; esac; done) 2>/dev/null
    tar -czf "$OUT/learn.tgz" -C "$tmp" learn && rm -rf "$tmp"
    ls -la "$OUT/learn.tgz" ;;
  wait)
    bg_wait "${1:-420}"
    exec bash "$0" status ;;
  stop)
    for d in "$ROOT"/*/; do [ -f "$d/train.log" ] && : > "$d/STOP" && echo "stop file: $d/STOP"; done ;;
  kill)
    pid=$(cat "$ROOT/driver.pid" 2>/dev/null) || { echo "no run"; exit 0; }
    kill -TERM "$pid" 2>/dev/null   # the driver ends each arm's process group
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null; echo "killed $pid" ;;
  *) echo "usage: learning_run.sh start|status|wait [seconds]|stop|kill [args]" >&2; exit 2 ;;
esac
