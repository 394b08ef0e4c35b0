# Shared by the background GPU drivers (step_scaling_bg.sh, learning_run.sh, gpu_plan.sh); source it, don't run it.
# Each driver keeps its files in $ROOT: driver.pid, driver.log, gpu.txt, gpu_mem.log.

# bg_refuse_if_running: exit 1 if this $ROOT's driver still runs
bg_refuse_if_running() {
  if [ -f "$ROOT/driver.pid" ] && kill -0 "$(cat "$ROOT/driver.pid")" 2>/dev/null; then
    echo "already running (pid $(cat "$ROOT/driver.pid")); use status, stop or kill"; exit 1
  fi
}

# bg_launch MODULE ARGS...: run `python3 -m MODULE ARGS` from a private copy of the code ($BG_SRC, default
# /tmp/populora-src: a new copy of the checkout may replace the one under a running driver) in its own session, plus a
# GPU-memory log every 10 s. Runs in the caller's shell: it leaves the current directory at the copy.
bg_launch() {
  local module=$1 src=${BG_SRC:-/tmp/populora-src}; shift
  rm -rf "$src" && mkdir -p "$src/.gpub"
  cp -r populora_verl recipes scripts "$src/"
  [ -d .gpub/tool ] && cp -r .gpub/tool "$src/.gpub/"
  [ -d .gpuwork ] && cp -r .gpuwork "$src/"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$ROOT/gpu.txt" 2>/dev/null
  cd "$src" || return 1
  PYTHONPATH="$src:${PYTHONPATH:-}" setsid nohup python3 -m "$module" "$@" \
    > "$ROOT/driver.log" 2>&1 < /dev/null &
  echo $! > "$ROOT/driver.pid"
  setsid nohup bash -c "while kill -0 $(cat "$ROOT/driver.pid") 2>/dev/null; do
    echo \"\$(date +%s) \$(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits | tr '\n' ' ')\"
    sleep 10; done" > "$ROOT/gpu_mem.log" 2>&1 < /dev/null &
  sleep "${BG_START_WAIT_S:-5}"
  echo "started pid $(cat "$ROOT/driver.pid") at $(date -u +%T)"; tail -3 "$ROOT/driver.log"
}

# bg_wait SECONDS: block until the driver ends or SECONDS pass. One long call instead of many short ones: the
# machine stays held and nothing idles between polls.
bg_wait() {
  local limit=${1:-420} t=0 pid
  pid=$(cat "$ROOT/driver.pid" 2>/dev/null || echo 0)
  while [ "$t" -lt "$limit" ] && kill -0 "$pid" 2>/dev/null; do sleep 10; t=$((t + 10)); done
}
