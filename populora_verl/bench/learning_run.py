"""The learning run on one GPU (issue 13): the population arm and the compute-matched single agent side by side.

``python -m populora_verl.bench.learning_run --model DIR --out ROOT [--stop-after-min M]`` (usually started in the
background by ``scripts/gpu/learning_run.sh``) runs, on one GPU:

1. every arm at once: the first (default ``2t2s``: recipe ``qwen1.5b_1gpu_2t2s``) runs the seeding phase; every
   other arm (default ``single``) waits at its first step for that seed set (``<ROOT>/2t2s/seed_tasks.jsonl``, via
   ``populora.buffer.seed_file`` and ``seed_file_wait_s``): one seed set and one base for every arm. Each arm is its own
   ``python -m verl.trainer.main_ppo`` with its own Ray instance; population metrics go to
   ``<ROOT>/<arm>/metrics.jsonl``, verl's own (timings, actor) to ``verl_metrics.jsonl``, the log to ``train.log``.
2. With ``--stop-at-step N`` each arm ends at step N (the first safe step from N on). ``M`` minutes after the start
   (whichever comes first) it writes each running arm's stop file (:mod:`populora_verl.trainer.stop`): an arm
   ends at its first step where no member is younger than the final quiet window, with a checkpoint.
3. Meanwhile ``populora-eval --warm-cache`` computes the benchmarks' expected outputs on spare CPUs. When every arm
   has ended: ``populora-eval`` (vLLM, greedy, HumanEval+ and MBPP+) on the base model, the single
   agent and every population member, all at the last step every arm has a checkpoint for (the same number of
   steps), into ``<ROOT>/eval``; then ``populora-report --compare`` of the arms into ``<ROOT>/compare``.

``--status`` prints where the run is (``<ROOT>/progress.json``, the last metrics of each arm).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from populora_verl.bench.progress import alive, read_progress, write_progress
from populora_verl.bench.step_scaling import file_log_rows
from populora_verl.diagnostics.metrics import read_metrics

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "populora"
ARMS = {"2t2s": "qwen1.5b_1gpu_2t2s", "single": "qwen1.5b_1gpu_single"}
# What the status line shows of an arm's last metrics row.
WATCH = ("populora/validity/mean", "populora/role/teacher/format_error_rate", "populora/role/student/format_error_rate",
         "populora/student/accuracy", "populora/role/teacher/reward_mean", "populora/role/student/reward_mean",
         "populora/evolution/events", "timing_s/step")
_CHILDREN: dict[str, subprocess.Popen] = {}
POLL_S = 5.0
SEED_WAIT_S = 1800.0  # how long an arm waits at its first step for the seeding arm's seed set
EVAL_BENCHMARKS = "humaneval_plus,mbpp_plus"


def arm_command(arm: str, model: str, root: Path, seed_file: str | None, extra: Sequence[str],
                seed_wait_s: float = SEED_WAIT_S) -> list[str]:
    """The arm's trainer command: its recipe, the model, its run directory (and the shared seed set, waited for
    at its first step while the seeding arm is still writing it)."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; known: {sorted(ARMS)}")
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(RECIPES), "--config-name", ARMS[arm],
           f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={root / arm}"]
    if seed_file:
        # ++: the recipes leave both keys out (null defaults), and hydra refuses a plain override of a new key
        cmd += [f"++populora.buffer.seed_file={seed_file}", f"++populora.buffer.seed_file_wait_s={seed_wait_s:g}"]
    return [*cmd, *extra]


def arm_env(arm: str, root: Path) -> dict[str, str]:
    """Each arm gets its own Ray instance (``RAY_ADDRESS=local``, its own temp dir): two trainers share one GPU."""
    return dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_USE_FLASHINFER_SAMPLER="0",
                RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                RAY_ADDRESS="local", RAY_TMPDIR=f"/tmp/ray_{arm}",
                # the trainer itself writes the population metrics to <run>/metrics.jsonl (what populora-report reads)
                VERL_FILE_LOGGER_PATH=str(root / arm / "verl_metrics.jsonl"))


def population_rows(run: Path) -> list[dict[str, Any]]:
    """The trainer's population metrics of an arm so far (``<run>/metrics.jsonl``; [] before its first step)."""
    path = run / "metrics.jsonl"
    return read_metrics(path) if path.is_file() else []


def verl_rows(run: Path) -> list[dict[str, Any]]:
    """verl's own metrics of an arm so far (timings, actor; its ``file`` logger, ``verl_metrics.jsonl``)."""
    path = run / "verl_metrics.jsonl"
    return [row for _, row in file_log_rows(path.read_text(errors="replace"))] if path.is_file() else []


def checkpoint_steps(run: Path) -> list[int]:
    """Steps with a complete PopuLoRA checkpoint (population.json written) under ``<run>/global_step_<N>``."""
    out = []
    for d in run.glob("global_step_*"):
        m = re.fullmatch(r"global_step_(\d+)", d.name)
        if m and list((d / "populora").glob("**/population.json")):
            out.append(int(m.group(1)))
    return sorted(out)


def common_step(runs: Mapping[str, Path]) -> int | None:
    """The last step every arm has a checkpoint for (compare arms after the same number of steps)."""
    sets = [set(checkpoint_steps(p)) for p in runs.values()]
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None


def population_dir(run: Path, step: int) -> Path:
    from populora_verl.eval.report import find_population_dir

    found = find_population_dir(run / f"global_step_{step}" / "populora")
    if found is None:
        raise FileNotFoundError(f"{run}: no population checkpoint at step {step}")
    return found


def eval_command(model: str, runs: Mapping[str, Path], step: int, out: Path, data_dir: str | None,
                 max_new_tokens: int, gpu_memory_utilization: float) -> list[str]:
    """populora-eval on the base, the single agent (as the baseline) and the population's alive members."""
    from populora_verl.eval.report import read_population

    cmd = [sys.executable, "-m", "populora_verl.eval.cli", "--model", model, "--backend", "vllm",
           "--benchmarks", EVAL_BENCHMARKS, "--max-new-tokens", str(max_new_tokens),
           "--gpu-memory-utilization", str(gpu_memory_utilization), "--out", str(out)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    for arm, run in runs.items():
        pop = population_dir(run, step)
        living = [r["id"] for r in read_population(pop).get("lineage", []) if r.get("death_step") is None]
        if arm == "single":
            cmd += ["--baseline", str(pop / "adapters" / living[0]), "--baseline-name", "single"]
        else:
            cmd += ["--run-dir", str(pop)]
    return cmd



def warm_cache_command(data_dir: str | None, workers: int = 4) -> list[str]:
    """The canonical solutions' expected outputs, computed into the eval cache while the arms train (about 1.7 min
    of 16 CPUs on an H100 machine that the evaluation would otherwise wait for)."""
    cmd = [sys.executable, "-m", "populora_verl.eval.cli", "--warm-cache", "--benchmarks", EVAL_BENCHMARKS,
           "--workers", str(workers)]
    return cmd + (["--data-dir", data_dir] if data_dir else [])


def _launch(arm: str, model: str, root: Path, seed_file: str | None, extra: Sequence[str],
            stop_at_step: int | None = None) -> subprocess.Popen:
    (root / arm).mkdir(parents=True, exist_ok=True)
    (root / arm / "STOP").unlink(missing_ok=True)  # a stale stop file would end the new run at once
    if stop_at_step:  # the run ends at this step (or the first safe one after it)
        (root / arm / "STOP").write_text(f"{stop_at_step}\n")
    log = open(root / arm / "train.log", "w")
    cmd = arm_command(arm, model, root, seed_file, extra)
    (root / arm / "command.txt").write_text(" ".join(cmd) + "\n")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=arm_env(arm, root), start_new_session=True)
    _CHILDREN[arm] = proc
    print(f"learning_run: {arm} started (pid {proc.pid}) {'with ' + seed_file if seed_file else 'with seeding'}",
          flush=True)
    return proc


def _kill(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            continue


def _on_sigterm(signum: int, frame: Any) -> None:
    for proc in _CHILDREN.values():
        _kill(proc)
    sys.exit(143)


def run(args: argparse.Namespace) -> int:
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ARMS:
            raise SystemExit(f"learning_run: --arms: unknown arm {a!r}; known: {sorted(ARMS)}")
    signal.signal(signal.SIGTERM, _on_sigterm)
    t0 = time.time()
    deadline = t0 + args.stop_after_min * 60
    write_progress(root, pid=os.getpid(), started=t0, state="starting", arms=arms, deadline=deadline, model=args.model)
    first, rest = arms[0], arms[1:]
    procs = {first: _launch(first, args.model, root, args.seed_file, args.overrides, args.stop_at_step)}
    seed_file = args.seed_file or str(root / first / "seed_tasks.jsonl")
    # The other arms start now (start-up overlaps) and wait at their first step for the first arm's seed set.
    for arm in rest:
        procs[arm] = _launch(arm, args.model, root, seed_file, args.overrides, args.stop_at_step)
    write_progress(root, state="training", seed_file=seed_file, launched={a: time.time() for a in procs})
    warm = None
    if not args.no_eval:  # low priority: the arms' executors come first
        with open(root / "warm_cache.log", "w") as f:
            warm = subprocess.Popen(warm_cache_command(args.data_dir), stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=lambda: os.nice(10))
        _CHILDREN["warm_cache"] = warm
    stopped: set[str] = set()

    def early_failure() -> str | None:
        """Why the run cannot give a comparison any more, or None. An arm that fails before its first step (a config
        mistake, an OOM at start-up) leaves nothing to compare, so the others stop too instead of burning the lease;
        the seeding arm ending without its seed set leaves the others waiting for nothing."""
        for arm, p in procs.items():
            if p.poll() not in (None, 0) and not population_rows(root / arm):
                return f"{arm} ended (rc {p.returncode}) before its first step; see {root / arm / 'train.log'}"
        if rest and procs[first].poll() is not None and not Path(seed_file).exists():
            return f"{first} ended (rc {procs[first].returncode}) before writing its seed set {seed_file}"
        return None

    while any(p.poll() is None for p in procs.values()) and not early_failure():
        now = time.time()
        if now >= deadline:
            for arm, p in procs.items():
                if p.poll() is None and arm not in stopped:
                    (root / arm / "STOP").write_text("")  # end at the next safe step, even before --stop-at-step
                    stopped.add(arm)
                    print(f"learning_run: {arm}: stop file written at {now - t0:.0f} s", flush=True)
        if now >= deadline + args.grace_min * 60:  # an arm that never reached a safe step
            for arm, p in procs.items():
                if p.poll() is None:
                    print(f"learning_run: {arm} still running {args.grace_min} min after its stop file: killed",
                          flush=True)
                    _kill(p)
        time.sleep(POLL_S)
    reason = early_failure()
    if reason:
        for p in [*procs.values(), *([warm] if warm is not None else [])]:
            _kill(p)
        write_progress(root, state="failed", reason=reason)
        print(f"learning_run: {reason}; the other arms were stopped", flush=True)
        return 1
    rcs = {a: p.returncode for a, p in procs.items()}
    runs = {a: root / a for a in arms}
    step = common_step(runs)
    write_progress(root, state="trained", rcs=rcs, trained_s=time.time() - t0, common_step=step,
                   checkpoints={a: checkpoint_steps(p) for a, p in runs.items()})
    print(f"learning_run: arms ended {rcs}; last common checkpoint step {step}", flush=True)
    _compare(runs, root)
    if step is None or args.no_eval:
        write_progress(root, state="finished", wall_s=time.time() - t0)
        return 0 if step is not None else 1
    if warm is not None and warm.poll() is None:  # normally long done; the eval would redo what is missing
        try:
            warm.wait(timeout=300)
        except subprocess.TimeoutExpired:
            _kill(warm)
    cmd = eval_command(args.model, runs, step, root / "eval", args.data_dir, args.eval_max_new_tokens,
                       args.eval_gpu_memory_utilization)
    (root / "eval_command.txt").write_text(" ".join(cmd) + "\n")
    write_progress(root, state="evaluating", eval_started=time.time())
    with open(root / "eval.log", "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=arm_env("eval", root))
    write_progress(root, state="finished", eval_rc=rc, wall_s=time.time() - t0)
    print(f"learning_run: eval exit {rc}; finished after {time.time() - t0:.0f} s", flush=True)
    return rc


def _compare(runs: Mapping[str, Path], root: Path) -> None:
    """Figures of every arm on shared axes (populora-report --compare); a failure here must not cost the eval."""
    have = [p for p in runs.values() if (p / "metrics.jsonl").is_file()]
    if not have:
        return
    try:
        from populora_verl.eval.report import build_compare_report

        build_compare_report(have, root / "compare", labels=[p.name for p in have])
    except Exception as e:  # noqa: BLE001 - figures are a by-product; the run's data is what matters
        print(f"learning_run: compare figures failed: {e!r}", flush=True)


def status(root: Path) -> str:
    """Progress and, per arm, its steps so far and the last row's key metrics."""
    prog = read_progress(root)
    if prog is None:
        return f"learning_run: no run under {root}"
    now = time.time()
    lines = [f"learning_run pid {prog.get('pid')} {'running' if alive(prog.get('pid')) else 'not running'}; "
             f"state {prog.get('state')}; "
             f"{now - prog.get('started', now):.0f} s since start; stop files at "
             f"{prog.get('deadline', now) - prog.get('started', now):.0f} s"]
    for arm in prog.get("arms", []):
        rows, timings = population_rows(root / arm), verl_rows(root / arm)
        last = {**(timings[-1] if timings else {}), **(rows[-1] if rows else {})}
        watch = " ".join(f"{k.split('/', 1)[-1]}={last[k]:.3g}" for k in WATCH if isinstance(last.get(k), (int, float)))
        lines.append(f"  {arm}: {len(rows)} steps; checkpoints {checkpoint_steps(root / arm)}; last: {watch}")
    for k in ("rcs", "common_step", "eval_rc", "reason"):
        if k in prog:
            lines.append(f"  {k}: {prog[k]}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="run root: one folder per arm, eval/, compare/, progress.json")
    ap.add_argument("--status", action="store_true", help="print the progress of the run under --out and exit")
    ap.add_argument("--model", help="the base model folder (HF format)")
    ap.add_argument("--arms", default="2t2s,single", help="comma list, the first seeds: " + ", ".join(ARMS))
    ap.add_argument("--seed-file", help="start every arm from this seed set instead of the first arm's seeding")
    ap.add_argument("--stop-after-min", type=float, default=17.0, help="minutes after start to write the stop files")
    ap.add_argument("--stop-at-step", type=int, help="every arm ends at this step (the first safe one from it on), "
                    "or at the deadline, whichever comes first")
    ap.add_argument("--grace-min", type=float, default=6.0, help="minutes after the stop files before a kill")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--data-dir", help="benchmark folder for populora-eval (default: the package's copy)")
    ap.add_argument("--eval-max-new-tokens", type=int, default=768)
    ap.add_argument("--eval-gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("overrides", nargs="*", help="hydra overrides for every arm")
    args = ap.parse_args(argv)
    if args.status:
        print(status(Path(args.out)))
        return 0
    if not args.model:
        ap.error("--model is required to start a run")
    if args.stop_after_min <= 0:
        ap.error("--stop-after-min must be > 0")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
