"""Start-up benchmark: a recipe's timeline from launch to the end of step 1, N times, median and spread per phase.

Each run is ``python -m verl.trainer.main_ppo`` with the recipe, a fresh run directory and its own Ray instance; it
ends once the trainer prints its start-up line (``[populora] start-up: ... | total N s``, printed at the end of
step 1): the process group is ended then, and a stop file ends the run at step 1 should that fail. The phases come
from that line (:func:`populora_verl.trainer.timeline.parse_line`), so a regression shows in the phase it is in.

Each run's table also splits step 1 by verl's own timings of it (``step 1: gen``, ``step 1: update_actor``, ...),
read from verl's console line for step 1, which the run is given up to a minute to print after the start-up line, and
shows what vLLM's engine reports of its own start inside "workers + vLLM" (``vLLM: init engine``, weights, compile,
CUDA graphs; the slowest engine where there are several): the runs log vLLM at INFO for this.

``--lever NAME`` runs an A/B of one start-up lever: arm A without it, arm B with it, alternating A B / B A per round so
that drift of the machine falls on both alike. The first run on a node fills the caches every later run reads (vLLM's
compile cache, Triton's kernels, the page cache of the model's files), so an A/B starts with ``--first-runs`` runs of
arm A (default 1) that are reported as their own row, ``first``: the cold figure, kept out of the A/B. As many runs of
arm B follow (``first_B``, also kept out): a B that changes vLLM's configuration (its capture sizes, the model's path)
changes vLLM's compile-cache key, so its first run compiles from scratch even on a warm node. ``--arms A`` or
``--arms B`` runs one arm only: on a host of several GPUs, one job per arm side by side (then the arms swapped) puts
both arms under the same load, and ``--from-logs`` reads their folders together.

Levers (``--b-override`` replaces B's overrides):

* ``early_agent_loop``: the agent-loop workers and the request load balancer started while vLLM starts (B) against
  verl's order (A, the default);
* ``early_servers``: vLLM's server actors created with the FSDP workers, their processes importing while the model
  loads (B, ``trainer.populora_early_servers``, the recipes' default), against verl's order (A);
* ``early_transfer_queue``: TransferQueue started by the launching process as soon as Ray is up, beside the task
  runner's start (B, ``trainer.populora_early_transfer_queue``, the recipes' default) against by the task runner (A);
* ``compile_cache``: vLLM's torch.compile cache kept across the runs in one folder (B; its first run fills it) against
  the cache off (A);
* ``capture_sizes``: CUDA-graph capture sizes limited to the batch sizes the recipe can reach (B,
  :mod:`populora_verl.rollout.capture_sizes`) against the recipe's own;
* ``use_shm``: the model read from shared memory (``actor_rollout_ref.model.use_shm=true``, B);
* ``uni_executor``: vLLM's model runner inside its engine-core process (B, ``distributed_executor_backend=uni``, the
  recipes' default, one GPU per engine) against verl's ``mp`` (A), which starts one more process that imports vLLM
  and torch;
* ``weight_sync``: the first weight sync; no default B, give it with ``--b-override``.

    python -m populora_verl.bench.startup --config-name qwen1.5b_1gpu_2t2s --model /tmp/models/qwen-coder-1.5b
    python -m populora_verl.bench.startup --config-name qwen1.5b_1gpu_2t2s --model ... --lever compile_cache
    python -m populora_verl.bench.startup --from-logs /tmp/startup      # the table again from a run's logs
    python -m populora_verl.bench.startup --from-logs /tmp/gpu0 /tmp/gpu1   # arms run side by side, one per GPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from populora_verl.bench import child
from populora_verl.bench.step_scaling import console_rows, main_ppo_command, trainer_env
from populora_verl.recipes import recipes_dir
from populora_verl.trainer.timeline import LINE_PREFIX, parse_line

__all__ = [
    "LEVERS",
    "Lever",
    "arm_overrides",
    "run_command",
    "summarize",
    "table",
    "read_logs",
    "parse_args",
    "main",
]

RECIPES = recipes_dir()
#: What every run adds to the recipe: no evaluation, no checkpoint before step 1 ends.
BASE_OVERRIDES = ("trainer.save_freq=-1", "trainer.val_before_train=false")
POLL_S = 2.0
#: How long a run may take, after its start-up line, to print verl's console line for step 1.
STEP_LINE_WAIT_S = 60.0
#: verl's timings of step 1 that the table shows under "step 1" (those present in the line).
STEP1_TIMINGS = ("gen", "populora_score", "old_log_prob", "update_actor", "update_weights")
_LOG = re.compile(r"^(?P<arm>[A-Za-z0-9_]+)-r(?P<round>\d+)\.log$")
ENV = "ray_kwargs.ray_init.runtime_env.env_vars"
UNI_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend"


@dataclass(frozen=True)
class Lever:
    """One start-up lever: the overrides of arm A (without) and arm B (with). ``b`` may be a function of the
    composed recipe (and the output folder); None: B must come from ``--b-override``."""

    what: str
    a: tuple[str, ...]
    b: tuple[str, ...] | Callable[..., tuple[str, ...]] | None


def _capture_b(config, out: Path) -> tuple[str, ...]:
    from populora_verl.rollout.capture_sizes import capture_sizes_override

    override = capture_sizes_override(config)
    if override is None:
        raise ValueError(
            "--lever capture_sizes: every capture size of this recipe is reachable (its largest phase fills "
            "rollout.max_num_seqs) or vLLM runs eager, so the lever changes nothing; give B's sizes with --b-override"
        )
    return (override,)


def _uni_b(config, out: Path) -> tuple[str, ...]:
    # vLLM's "uni" executor runs one worker only: one GPU per replica (the layout the trainer checks at start-up).
    from populora_verl.config import load_config
    from populora_verl.trainer.verl_config import parallel_layout

    layout = parallel_layout(config, load_config(config.get("populora")))
    if layout.rollout_world > 1:
        raise ValueError(
            f"--lever uni_executor: a vLLM replica of this recipe spans {layout.rollout_world} GPUs "
            f"(tensor_model_parallel_size={layout.rollout_tp}); uni runs one"
        )
    return (f"{UNI_KEY}=uni",)


LEVERS: dict[str, Lever] = {
    "early_agent_loop": Lever(
        "agent-loop workers and request load balancer started beside vLLM (B) against verl's order (A, the default)",
        ("++trainer.populora_early_agent_loop=false",),
        ("++trainer.populora_early_agent_loop=true",),
    ),
    "early_servers": Lever(
        "vLLM's server actors started with the FSDP workers (B, the recipes' default) against verl's order (A)",
        ("++trainer.populora_early_servers=false",),
        ("++trainer.populora_early_servers=true",),
    ),
    "early_transfer_queue": Lever(
        "TransferQueue started by the launching process beside the task runner's start (B, the recipes' default) "
        "against by the task runner (A)",
        ("++trainer.populora_early_transfer_queue=false",),
        ("++trainer.populora_early_transfer_queue=true",),
    ),
    "compile_cache": Lever(
        "vLLM's compile cache kept across runs in one folder (B) against the cache off (A)",
        (f"++{ENV}.VLLM_DISABLE_COMPILE_CACHE='1'",),
        lambda config, out: (
            f"++{ENV}.VLLM_DISABLE_COMPILE_CACHE='0'",
            f"++{ENV}.VLLM_CACHE_ROOT={out / 'vllm_cache'}",
        ),
    ),
    "capture_sizes": Lever("capture sizes limited to the reachable batch sizes (B)", (), _capture_b),
    "use_shm": Lever("the model read from shared memory (B)", (), ("actor_rollout_ref.model.use_shm=true",)),
    "uni_executor": Lever(
        "vLLM's model runner inside its engine-core process (B, the recipes' default) against a process of its own",
        (f"{UNI_KEY}=mp",),
        _uni_b,
    ),
    "weight_sync": Lever("the first weight sync: B from --b-override", (), None),
    # Several levers in one B when a node's time allows one A/B only: each acts on its own phase of the timeline
    # (vLLM's reports split weights, compile and CUDA graphs), which is where its share is read.
    "stack": Lever("several levers at once, B from --b-override, each read off the phase it acts on", (), None),
}


def compose(config_name: str, overrides: Sequence[str] = ()):
    """The recipe composed as ``verl.trainer.main_ppo --config-path <recipes> --config-name`` would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def arm_overrides(
    lever: str | None, arm: str, config=None, out: Path = Path("."), b_override: Sequence[str] = ()
) -> list[str]:
    """The Hydra overrides of ``arm`` (``A`` or ``B``; ``base`` without a lever) for ``lever``; ``config`` is the
    composed recipe (for a B that depends on it). ValueError names what is missing."""
    if lever is None:
        return []
    spec = LEVERS[lever]
    if arm == "A":
        return list(spec.a)
    if b_override:
        return list(b_override)
    if spec.b is None:
        raise ValueError(f"--lever {lever}: {spec.what}; give the B arm's overrides with --b-override KEY=VALUE")
    return list(spec.b(config, out) if callable(spec.b) else spec.b)


def run_command(config_name: str, model: str, run_dir: Path, overrides: Sequence[str]) -> list[str]:
    return main_ppo_command(
        config_name,
        f"actor_rollout_ref.model.path={model}",
        f"trainer.default_local_dir={run_dir}",
        *BASE_OVERRIDES,
        *overrides,
    )


def run_env(name: str, gpu: str | None) -> dict[str, str]:
    """Its own Ray instance per run (two runs never share a cluster, a killed one leaves no socket behind)."""
    env = trainer_env(f"/tmp/ray_startup_{name}")
    # verl keeps a variable set in the launching environment: vLLM then logs its own start-up times
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def _end_group(proc: subprocess.Popen) -> None:
    from populora_verl.bench.learning_run import group_pids

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            continue
        if not group_pids(proc.pid):
            break
    deadline = time.monotonic() + 60  # the GPU is free only once every process of the run is gone
    while group_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(1)


def step1_timings(log: str) -> dict[str, float]:
    """verl's timings of step 1 from its console line in a trainer's log (empty without the line)."""
    for step, metrics in console_rows(log):
        if step == 1:
            return {f"step 1: {k}": metrics[f"timing_s/{k}"] for k in STEP1_TIMINGS if f"timing_s/{k}" in metrics}
    return {}


#: vLLM's own start-up reports (INFO), by the name the table gives them; each engine prints its own.
VLLM_REPORTS = {
    "vLLM: loading weights": re.compile(r"Loading weights took ([\d.]+) s"),
    "vLLM: model loading": re.compile(r"Model loading took [\d.]+ ?GiB(?: memory)? and ([\d.]+) s"),
    "vLLM: torch.compile": re.compile(r"torch\.compile takes ([\d.]+) s in total"),
    "vLLM: CUDA graphs": re.compile(r"Graph capturing finished in ([\d.]+) s"),
    "vLLM: init engine": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
}


def vllm_timings(log: str) -> dict[str, float]:
    """What vLLM's engines report of their start in a trainer's log: per report, the slowest engine's seconds."""
    out = {}
    for name, pattern in VLLM_REPORTS.items():
        found = [float(x) for x in pattern.findall(log)]
        if found:
            out[name] = max(found)
    return out


def log_phases(log: str) -> dict[str, float] | None:
    """The start-up line's phases, with step 1 split by verl's timings and vLLM's own start-up reports where the log
    has them (None: no start-up line)."""
    phases = parse_line(log)
    return None if phases is None else {**phases, **vllm_timings(log), **step1_timings(log)}


def run_once(cmd: Sequence[str], log: Path, env: Mapping[str, str], timeout_s: float) -> dict[str, float] | None:
    """One run to its start-up line and verl's line for step 1; the phases (None: it ended or timed out without
    the start-up line)."""
    run_dir = Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("trainer.default_local_dir=")))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "STOP").write_text("1\n")  # the trainer's stop file: the run ends at step 1 if the kill fails
    with open(log, "w") as f:
        f.write("# " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if LINE_PREFIX in text:
                # verl prints step 1's metrics just after the start-up line; wait for them a little
                deadline = min(deadline, time.monotonic() + STEP_LINE_WAIT_S)
                if step1_timings(text):
                    break
            time.sleep(POLL_S)
    finally:
        _end_group(proc)
    return log_phases(log.read_text(errors="replace"))


def summarize(runs: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per phase (in the order they appear): median, min, max and the number of runs that had it."""
    names: list[str] = []
    for r in runs:
        names += [n for n in r if n not in names]
    if "total" in names:  # last, whatever order the runs printed their phases in
        names.remove("total")
        names.append("total")
    out = {}
    for n in names:
        vals = [float(r[n]) for r in runs if n in r]
        out[n] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
    return out


def table(arms: Mapping[str, Sequence[Mapping[str, float]]]) -> str:
    """A markdown table: per phase, each arm's median and spread (min-max over its runs); with two arms, B - A."""
    stats = {arm: summarize(runs) for arm, runs in arms.items()}
    names: list[str] = []
    for s in stats.values():
        names += [n for n in s if n not in names]
    if "total" in names:
        names.remove("total")
        names.append("total")
    labels = list(stats)
    ab = ("A", "B") if {"A", "B"} <= set(labels) else tuple(labels) if len(labels) == 2 else None
    head = ["phase"]
    for arm in labels:
        n = max((v["n"] for v in stats[arm].values()), default=0)
        head += [f"{arm} median (s, {n} runs)", f"{arm} min-max"]
    if ab:
        head.append(f"{ab[1]} - {ab[0]} (s)")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        cells = [name]
        for arm in labels:
            v = stats[arm].get(name)
            cells += [f"{v['median']:.0f}", f"{v['min']:.0f}-{v['max']:.0f}"] if v else ["-", "-"]
        if ab:
            a, b = (stats[arm].get(name) for arm in ab)
            cells.append(f"{b['median'] - a['median']:+.0f}" if a and b else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def read_logs(*folders: Path) -> tuple[dict[str, list[dict[str, float]]], list[str]]:
    """The phases of every ``<arm>-r<round>.log`` in ``folders`` (the arms of one A/B run side by side, one folder
    per GPU), by arm (rounds in order), and the logs without a start-up line."""
    arms: dict[str, list[tuple[int, dict[str, float]]]] = {}
    missing = []
    for log in sorted(log for folder in folders for log in folder.iterdir()):
        m = _LOG.match(log.name)
        if not m:
            continue
        phases = log_phases(log.read_text(errors="replace"))
        if phases is None:
            missing.append(str(log) if len(folders) > 1 else log.name)
            continue
        arms.setdefault(m["arm"], []).append((int(m["round"]), phases))
    order = {"first": 0, "first_B": 1, "base": 2, "A": 3, "B": 4}
    return {
        arm: [p for _, p in sorted(runs, key=lambda x: x[0])]
        for arm, runs in sorted(arms.items(), key=lambda kv: (order.get(kv[0], 9), kv[0]))
    }, missing


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m populora_verl.bench.startup", description=__doc__.split("\n")[0])
    p.add_argument("--config-name", help="a recipe of recipes/populora (qwen1.5b_1gpu_2t2s, ...)")
    p.add_argument("--model", help="actor_rollout_ref.model.path")
    p.add_argument("--runs", type=int, default=3, help="runs per arm (default 3)")
    p.add_argument(
        "--first-runs",
        type=int,
        default=None,
        help="runs of each arm before an A/B, reported as 'first' and 'first_B' (cold caches) and kept out of it "
        "(default 1; 0 without --lever)",
    )
    p.add_argument("--lever", choices=sorted(LEVERS), help="A/B of one lever (arm A without, B with)")
    p.add_argument("--b-override", action="append", default=[], metavar="KEY=VALUE", help="B's overrides instead")
    p.add_argument(
        "--arms",
        default="A,B",
        help="with --lever, the arms to run (default A,B; A or B runs one arm's first runs and rounds only, so that "
        "two GPUs of one host can run the arms side by side, each arm under the same load)",
    )
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="for every run")
    p.add_argument("--out", type=Path, default=Path("/tmp/populora_startup"), help="logs, run folders, results")
    p.add_argument("--gpu", help="CUDA_VISIBLE_DEVICES of every run (default: inherited)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run, to the start-up line")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument(
        "--from-logs", type=Path, nargs="+", metavar="DIR", help="the table from earlier --out folders' logs"
    )
    args = p.parse_args(argv)
    if args.from_logs is not None:
        for folder in args.from_logs:
            if not folder.is_dir():
                p.error(f"--from-logs {folder}: not a folder")
        return args
    if args.first_runs is None:
        args.first_runs = 1 if args.lever else 0
    if args.first_runs < 0:
        p.error("--first-runs must be 0 or more")
    if args.runs < (0 if args.first_runs else 1):
        p.error("--runs must be at least 1 (0 only with --first-runs)")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not args.arms or not set(args.arms) <= {"A", "B"} or len(set(args.arms)) != len(args.arms):
        p.error(f"--arms {','.join(args.arms)}: A, B or A,B")
    if args.arms != ["A", "B"] and not args.lever:
        p.error("--arms needs --lever")
    if not args.config_name:
        p.error("--config-name is required (a recipe of recipes/populora)")
    if not (RECIPES / f"{args.config_name}.yaml").is_file():
        known = sorted(x.stem for x in RECIPES.glob("*.yaml"))
        p.error(f"--config-name {args.config_name}: no such recipe in {RECIPES} (known: {', '.join(known)})")
    if not args.model and not args.dry_run:
        p.error("--model is required (actor_rollout_ref.model.path)")
    if args.b_override and not args.lever:
        p.error("--b-override needs --lever")
    for item in [*args.override, *args.b_override]:
        if "=" not in item:
            p.error(f"{item!r}: an override is KEY=VALUE")
    return args


def plan_runs(args: argparse.Namespace) -> list[tuple[str, int, list[str]]]:
    """(arm, round, overrides) in the order they run; ValueError when the lever cannot run for the recipe."""
    arms = list(args.arms) if args.lever else ["base"]
    config = compose(args.config_name, args.override) if args.lever else None
    per_arm = {arm: arm_overrides(args.lever, arm, config, args.out, args.b_override) for arm in arms}
    # The first runs fill the caches (B's config may compile anew), so they stay out of the A/B: "first" is arm A's
    # (or the recipe as it stands without a lever), "first_B" arm B's.
    first = [
        ("first" if arm in ("A", "base") else "first_B", r, [*args.override, *per_arm[arm]])
        for arm in arms
        for r in range(args.first_runs)
    ]
    return first + [(arm, r, [*args.override, *per_arm[arm]]) for r, arm in child.alternating(arms, args.runs)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_logs is not None:
        arms, missing = read_logs(*args.from_logs)
        print(table(arms) if arms else "no start-up line in any log")
        if missing:
            print(f"no start-up line: {', '.join(missing)}")
        return 0 if arms else 1
    try:
        runs = plan_runs(args)
    except ValueError as e:
        print(f"startup: {e}", file=sys.stderr)
        return 2
    model = args.model or "<model>"
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, float]]] = {}
    for arm, r, overrides in runs:
        name = f"{arm}-r{r}"
        cmd = run_command(args.config_name, model, args.out / "runs" / name, overrides)
        if args.dry_run:
            print(" ".join(cmd))
            continue
        t0 = time.time()
        phases = run_once(cmd, args.out / f"{name}.log", run_env(name, args.gpu), args.timeout_s)
        if phases is None:
            print(f"startup: {name}: no start-up line after {time.time() - t0:.0f} s (see {name}.log)", flush=True)
            continue
        results.setdefault(arm, []).append(phases)
        print(f"startup: {name}: " + " | ".join(f"{k} {v:.0f} s" for k, v in phases.items()), flush=True)
    if args.dry_run:
        return 0
    text = table(results) if results else "no run printed its start-up line"
    if args.lever:
        text = f"lever {args.lever}: {LEVERS[args.lever].what}\n\n{text}"
    print(text)
    (args.out / "results.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps({"lever": args.lever, "runs": results}, indent=1) + "\n")
    expected = {arm: args.first_runs if arm.startswith("first") else args.runs for arm, _, _ in runs}
    return 0 if results and all(len(results.get(arm, ())) == n for arm, n in expected.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
