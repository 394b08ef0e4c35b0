"""The learning run: population arms and compute-matched AZR single agents side by side, one GPU per arm or all on one.

``python -m populora_verl.bench.learning_run --model DIR --out ROOT [--arms 2t2s@1,single@1,2t2s@2,single@2]
[--gpus 0,1,2,3] [--stop-after-min M]`` (on a GPU node without network, ``scripts/gpu/learning_run.sh`` starts it in
the background):

1. Arms are recipe names (``2t2s``: recipe ``qwen1.5b_1gpu_2t2s``; ``single``: ``qwen1.5b_1gpu_single``), each with an
   optional ``@SEED`` (``populora.population.seed`` and the rollout's sampling seed; the arm's folder is then
   ``<name>-seed<SEED>``). Each arm is its own ``python -m verl.trainer.main_ppo`` with its own Ray instance; with
   ``--gpus`` arm *i* sees only GPU ``gpus[i % len(gpus)]`` (``CUDA_VISIBLE_DEVICES``). Without ``--seed-file`` the
   first arm runs the seeding phase and every other arm waits at its first step for that seed set
   (``<ROOT>/<first>/seed_tasks.jsonl``): one seed set and one base for every arm. Population metrics go to
   ``<ROOT>/<arm>/metrics.jsonl``, verl's own (timings, actor) to ``verl_metrics.jsonl``, the log to ``train.log``.
2. With ``--stop-at-step N`` each arm ends at step N (the first safe step from N on). ``M`` minutes after the start
   (whichever comes first) it writes each running arm's stop file (:mod:`populora_verl.trainer.stop`): an arm
   ends at its first step where no member is younger than the final quiet window, with a checkpoint.
3. Once every arm trains, ``populora-eval --warm-cache`` computes the benchmarks' expected outputs on spare CPUs.
   When every arm has ended (and its spent stop file is removed): ``populora-eval`` (vLLM, greedy, HumanEval+ and
   MBPP+) on the base model and every arm's living
   members, all at the last step every arm has a checkpoint for (the same number of steps), into ``<ROOT>/eval``
   (with ``--gpus``, one evaluation per benchmark, side by side); then ``populora-report --compare`` of the arms into
   ``<ROOT>/compare``. With ``--stop-at-step`` and a GPU per arm, each arm is instead evaluated on its own GPU as
   soon as it reaches that step (:class:`EarlyEval`, into ``<ROOT>/eval/<arm>``, summary ``eval/arms.md``).

``--status`` prints where the run is (``<ROOT>/progress.json``, the last metrics of each arm). ``--check`` (with the
arguments of a start) starts nothing: it composes every arm's trainer config, runs the start-up checks that need no
GPU and prints each adapter's planned trained trajectories and response tokens per step, exiting 1 unless the arms
are compute matched (docs/tasks-and-rewards.md); it runs on a CPU machine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from populora_verl.bench.progress import alive, read_progress, write_progress
from populora_verl.bench.step_scaling import file_log_rows, main_ppo_command, trainer_env
from populora_verl.diagnostics.metrics import read_metrics
from populora_verl.recipes import recipes_dir

RECIPES = recipes_dir()  # a checkout's recipes/populora, else the installed copy
ARMS = {"2t2s": "qwen1.5b_1gpu_2t2s", "4t4s": "qwen1.5b_1gpu_4t4s", "single": "qwen1.5b_1gpu_single"}
# What the status line shows of an arm's last metrics row.
WATCH = (
    "populora/validity/mean",
    "populora/role/teacher/format_error_rate",
    "populora/role/student/format_error_rate",
    "populora/student/accuracy",
    "populora/role/teacher/reward_mean",
    "populora/role/student/reward_mean",
    "populora/evolution/events",
    "timing_s/step",
)
_CHILDREN: dict[str, subprocess.Popen] = {}
POLL_S = 5.0
SEED_WAIT_S = 1800.0  # how long an arm waits at its first step for the seeding arm's seed set
EVAL_BENCHMARKS = "humaneval_plus,mbpp_plus"
EVAL_KV_CACHE_GIB = 8  # an engine started beside a trainer: ~290k tokens of the 1.5B model, 256 sequences at once


def parse_arm(spec: str) -> tuple[str, int | None]:
    """``NAME`` or ``NAME@SEED`` -> (recipe name, seed or None); ValueError naming the spec if malformed."""
    name, sep, seed = spec.strip().partition("@")
    if name not in ARMS:
        raise ValueError(f"unknown arm {name!r}; known: {sorted(ARMS)}")
    if not sep:
        return name, None
    if not seed.isdigit():
        raise ValueError(f"arm {spec!r}: the seed after '@' must be a non-negative integer")
    return name, int(seed)


def arm_dir(spec: str) -> str:
    """The arm's folder under the run root: its recipe name, plus ``-seed<N>`` when it has a seed."""
    name, seed = parse_arm(spec)
    return name if seed is None else f"{name}-seed{seed}"


def arm_command(
    arm: str, model: str, root: Path, seed_file: str | None, extra: Sequence[str], seed_wait_s: float = SEED_WAIT_S
) -> list[str]:
    """The arm's trainer command: its recipe, the model, its run directory, its seed (and the shared seed set,
    waited for at its first step while the seeding arm is still writing it)."""
    name, seed = parse_arm(arm)
    cmd = main_ppo_command(
        ARMS[name], f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={root / arm_dir(arm)}"
    )
    if seed is not None:  # matchmaking, task draws and buffers (population seed) and vLLM's sampling
        cmd += [f"populora.population.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}"]
    if seed_file:
        # ++: the recipes leave both keys out (null defaults), and hydra refuses a plain override of a new key
        cmd += [f"++populora.buffer.seed_file={seed_file}", f"++populora.buffer.seed_file_wait_s={seed_wait_s:g}"]
    return [*cmd, *extra]


def arm_env(arm: str, root: Path, gpu: str | None = None) -> dict[str, str]:
    """Each arm (a spec, or a folder name such as ``eval``) gets its own Ray instance (``RAY_ADDRESS=local``, its
    own temp dir, so trainers on one host never share Ray's sockets) and, with ``gpu``, only that GPU."""
    folder = arm_dir(arm) if arm.partition("@")[0] in ARMS else arm
    env = trainer_env(
        f"/tmp/ray_{folder}",
        # the trainer itself writes the population metrics to <run>/metrics.jsonl (what populora-report reads)
        VERL_FILE_LOGGER_PATH=str(root / folder / "verl_metrics.jsonl"),
    )
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


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
    from populora_verl.diagnostics.lineage import find_population_dir

    found = find_population_dir(run / f"global_step_{step}" / "populora")
    if found is None:
        raise FileNotFoundError(f"{run}: no population checkpoint at step {step}")
    return found


def eval_cli(
    model: str, benchmarks: str, out: Path, data_dir: str | None, max_new_tokens: int, gpu_memory_utilization: float
) -> list[str]:
    """The ``populora-eval`` command (vLLM, greedy) without its members."""
    cmd = [
        sys.executable,
        "-m",
        "populora_verl.eval.cli",
        "--model",
        model,
        "--backend",
        "vllm",
        "--benchmarks",
        benchmarks,
        "--max-new-tokens",
        str(max_new_tokens),
        "--gpu-memory-utilization",
        str(gpu_memory_utilization),
        "--out",
        str(out),
    ]
    return cmd + (["--data-dir", data_dir] if data_dir else [])


def living_members(pop: Path) -> list[str]:
    """Ids of the members alive in a population checkpoint folder."""
    from populora_verl.diagnostics.lineage import read_population

    return [r["id"] for r in read_population(pop).get("lineage", []) if r.get("death_step") is None]


def eval_command(
    model: str,
    runs: Mapping[str, Path],
    step: int,
    out: Path,
    data_dir: str | None,
    max_new_tokens: int,
    gpu_memory_utilization: float,
    benchmarks: str = EVAL_BENCHMARKS,
) -> list[str]:
    """populora-eval on the base and every arm's living members at ``step``.

    One single agent and one population (the one-GPU run): the single agent is the baseline and the population the
    run dir, so the evaluation's paired differences are population - single agent. Several arms (seeds): every
    member is named ``<arm>@<step>.<member>`` (:func:`arm_adapters`); :mod:`populora_verl.eval.arms` pairs them per
    seed afterwards."""
    cmd = eval_cli(model, benchmarks, out, data_dir, max_new_tokens, gpu_memory_utilization)
    kinds = {folder: folder.split("-seed")[0] for folder in runs}
    if sorted(kinds.values()) == ["2t2s", "single"]:
        for folder, run in runs.items():
            pop = population_dir(run, step)
            if kinds[folder] == "single":
                cmd += ["--baseline", str(pop / "adapters" / living_members(pop)[0]), "--baseline-name", "single"]
            else:
                cmd += ["--run-dir", str(pop)]
        return cmd
    adapters = [a for run in runs.values() for a in arm_adapters(run, step)]
    return [*cmd, "--adapters", *adapters]


def arm_adapters(run: Path, step: int) -> list[str]:
    """``<arm>@<step>.<member>=<adapter folder>`` for every living member of the arm at ``step``: the name says
    which arm and which step it is (``populora_verl.eval.arms`` groups by the arm)."""
    pop = population_dir(run, step)
    return [f"{run.name}@{step}.{m}={pop / 'adapters' / m}" for m in living_members(pop)]


def arm_eval_command(
    model: str,
    run: Path,
    step: int,
    out: Path,
    data_dir: str | None,
    max_new_tokens: int,
    gpu_memory_utilization: float,
    with_base: bool,
) -> list[str]:
    """populora-eval of one arm's members at ``step`` (and the base model when ``with_base``), every benchmark."""
    cmd = eval_cli(model, EVAL_BENCHMARKS, out, data_dir, max_new_tokens, gpu_memory_utilization)
    return [*cmd, *([] if with_base else ["--no-base"]), "--adapters", *arm_adapters(run, step)]


def waiting_eval_command(
    model: str,
    listing: Path,
    wait_s: float,
    slots: tuple[int, int],
    out: Path,
    data_dir: str | None,
    max_new_tokens: int,
    gpu_memory_utilization: float,
    with_base: bool,
) -> list[str]:
    """populora-eval that starts its engine now and evaluates the adapters named in ``listing`` once the driver
    writes it (``slots``: the arm's adapter count and LoRA rank, which the engine must hold)."""
    cmd = eval_cli(model, EVAL_BENCHMARKS, out, data_dir, max_new_tokens, gpu_memory_utilization)
    # A fixed KV cache: vLLM's profiling reads the card's free memory, which the trainer beside it keeps changing.
    return [
        *cmd,
        *([] if with_base else ["--no-base"]),
        "--adapters-file",
        str(listing),
        "--wait",
        f"{wait_s:.0f}",
        "--max-loras",
        str(slots[0]),
        "--max-lora-rank",
        str(slots[1]),
        "--kv-cache-gib",
        str(EVAL_KV_CACHE_GIB),
    ]


def compose_arm(arm: str, overrides: Sequence[str], *, hydra_node: bool = False) -> Any:
    """An arm's recipe under ``overrides``, composed by hydra; ``hydra_node`` keeps the hydra node (the start-up
    callback), as ``verl.trainer.main_ppo`` has it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return compose(config_name=ARMS[parse_arm(arm)[0]], overrides=list(overrides), return_hydra_config=hydra_node)


def arm_lora_slots(arm: str, overrides: Sequence[str]) -> tuple[int, int]:
    """(adapters, LoRA rank) of an arm's recipe under its overrides: what an evaluation engine started before the
    arm's last checkpoint must hold (evolution replaces members, so the count never grows)."""
    from populora_verl.config import load_config

    cfg = compose_arm(arm, overrides)
    return load_config(cfg.populora).population.num_adapters, int(cfg.actor_rollout_ref.model.lora_rank)


def arm_config(arm: str, model: str, root: Path, seed_file: str | None, extra: Sequence[str]) -> Any:
    """The trainer config of an arm's command (:func:`arm_command`), composed by hydra as ``verl.trainer.main_ppo``
    composes it: the arm's recipe, then the command's overrides; the hydra node (the start-up callback) kept."""
    cmd = arm_command(arm, model, root, seed_file, extra)
    return compose_arm(arm, cmd[cmd.index("--config-name") + 2 :], hydra_node=True)


#: Trainer keys two compute-matched arms must share besides the trained trajectories (docs/tasks-and-rewards.md,
#: "Compute matching": one update per adapter, one generation limit for every role and arm, the same LoRA and step).
MATCHED_KEYS = (
    "data.max_response_length",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.lora_alpha",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.ppo_epochs",
    "populora.tasks.types",
    "populora.rollout.student_n",
)


def check_arm(cfg: Any) -> tuple[Any, list[tuple[str, str]]]:
    """The start-up checks an arm's trainer runs before Ray, on its composed config, without a GPU: the settings
    the start-up callback applies, :func:`populora_verl.startup.preflight` (the ``populora`` section, the verl keys
    the plugin relies on, the compute plan, the seed set, the model folder) and verl's own ``validate_config``.
    Returns the compute plan the trainer logs against (``populora/compute/<id>/planned``: ``plan.of_role(role)``)
    and (member id, role) of every founding member. Raises ConfigError naming the key."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from populora_verl.config import load_config
    from populora_verl.population.members import Population
    from populora_verl.startup import preflight
    from populora_verl.step.compute import check_compute_plan
    from populora_verl.trainer.enable import apply_populora_settings

    apply_populora_settings(cfg)  # what the start-up callback sets before verl reads the config (the recipes: none)
    preflight(cfg, check_gpus=False)
    task_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    validate_config(task_cfg, use_reference_policy=need_reference_policy(task_cfg), use_critic=need_critic(task_cfg))
    pcfg = load_config(cfg.populora)
    return check_compute_plan(pcfg), [(m.id, m.role) for m in Population.create(pcfg).members]


def check_arms(args: argparse.Namespace) -> int:
    """``--check``: every arm's trainer config as its command composes it, through the start-up checks
    (:func:`check_arm`); then each adapter's planned trained trajectories and response tokens per step, and whether
    the arms are compute matched (the same member mean and :data:`MATCHED_KEYS`). Starts nothing; 0 when every arm
    passes and all are matched, 1 otherwise."""
    from omegaconf import OmegaConf

    from populora_verl.config import ConfigError

    root = Path(args.out).resolve()
    own = arm_overrides(args.arm_override or [])
    means: dict[str, float] = {}
    shared: dict[str, dict[str, Any]] = {}
    failed = []
    for arm in parse_arms(args.arms):
        folder, name = arm_dir(arm), parse_arm(arm)[0]
        try:
            cfg = arm_config(arm, args.model, root, args.seed_file, [*args.overrides, *own.get(name, [])])
            plan, members = check_arm(cfg)
        except Exception as e:  # noqa: BLE001 - hydra's composition errors, verl's own checks: named, per arm
            # a ConfigError is already the one line the trainer would stop with
            why = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
            print(f"{folder}: FAILED: {why}", flush=True)
            failed.append(folder)
            continue
        answer = int(cfg.data.max_response_length)
        means[folder] = sum(plan.of_role(role) for _, role in members) / len(members)
        shared[folder] = {
            k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v
            for k in MATCHED_KEYS
            for v in [OmegaConf.select(cfg, k)]
        }
        print(
            f"{folder} ({ARMS[name]}, {cfg.populora.population.adapter_layout} adapters): start-up checks passed; "
            "planned per step:",
            flush=True,
        )
        for member, role in members:
            n = plan.of_role(role)
            both = f" ({plan.teacher:g} proposals + {plan.student:g} solver answers)" if role == "both" else ""
            print(
                f"  {member:<4} {role:<8} {n:>5g} trained trajectories, at most {n * answer:>7,.0f} response "
                f"tokens{both}"
            )
        mean = means[folder]
        print(f"  {'mean':<13} {mean:>5g} trained trajectories, at most {mean * answer:>7,.0f} response tokens")
    if failed:
        print(f"start-up checks failed: {', '.join(failed)}")
        return 1
    off = sorted({k for k in MATCHED_KEYS if len({repr(s[k]) for s in shared.values()}) > 1})
    if len(set(means.values())) > 1 or off:
        got = "; ".join(f"{f} {m:g}" for f, m in means.items())
        differ = "; ".join(f"{k}: " + ", ".join(f"{f} {s[k]}" for f, s in shared.items()) for k in off)
        print(f"NOT compute matched: member mean trained trajectories per step {got}" + (f"; {differ}" if off else ""))
        return 1
    first = next(iter(shared.values()))
    mean = next(iter(means.values()))
    print(
        f"compute matched: every arm's member mean is {mean:g} trained trajectories (at most "
        f"{mean * first['data.max_response_length']:,.0f} response tokens) per adapter and step; "
        + ", ".join(f"{k.rsplit('.', 1)[-1]} {first[k]}" for k in MATCHED_KEYS)
    )
    return 0


def median_step_s(run: Path) -> float | None:
    """The arm's median step time so far (verl's ``timing_s/step``), None before its second step."""
    times = [r["timing_s/step"] for r in verl_rows(run)[1:] if isinstance(r.get("timing_s/step"), (int, float))]
    return float(statistics.median(times)) if times else None


class EarlyEval:
    """With ``--stop-at-step`` and one GPU per arm: each arm's evaluation starts on its own GPU as soon as the arm
    ends, while slower arms still train (a 2T2S step takes about twice a single agent's); the first one also
    evaluates the base model. Results land in ``eval/<arm>/``; :mod:`populora_verl.eval.arms` reads them all.

    With ``--eval-prestart-s`` the evaluation's engine starts that long before the arm is expected at its stop step,
    beside the trainer on the same GPU (``--wait``), and evaluates once :meth:`start` writes the members' list: the
    engine's start (about 1.5 min for the 1.5B model) leaves the critical path."""

    def __init__(
        self,
        args: argparse.Namespace,
        root: Path,
        gpu_of: Mapping[str, str | None],
        arms: Mapping[str, tuple[str, Sequence[str]]] | None = None,
    ) -> None:
        self.args, self.root, self.gpu_of = args, root, dict(gpu_of)
        self.arms = dict(arms or {})  # folder -> (arm spec, its overrides): the arms whose engine may start early
        self.slots: dict[str, tuple[int, int] | None] = {}  # folder -> (adapters, LoRA rank), composed when needed
        self.procs: dict[str, subprocess.Popen] = {}
        self.steps: dict[str, int] = {}
        self.waiting: set[str] = set()  # engines started early, their members not written yet

    def _launch(self, folder: str, cmd: list[str]) -> None:
        out = self.root / "eval" / folder
        (out / "eval_command.txt").write_text(" ".join(cmd) + "\n")
        log = open(out / "eval.log", "w")
        self.procs[folder] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=arm_env(f"eval_{folder}", self.root, self.gpu_of.get(folder))
        )
        _CHILDREN[f"eval_{folder}"] = self.procs[folder]

    def prestart_due(self, folder: str) -> bool:
        """Is the arm expected at its stop step within ``--eval-prestart-s``, and can its engine be sized?"""
        if folder in self.procs or folder not in self.arms or not self.args.eval_prestart_s:
            return False
        run = self.root / folder
        step_s = median_step_s(run)
        if step_s is None or (self.args.stop_at_step - len(population_rows(run))) * step_s > self.args.eval_prestart_s:
            return False
        if folder not in self.slots:
            try:
                self.slots[folder] = arm_lora_slots(*self.arms[folder])
            except Exception as e:  # noqa: BLE001 - the evaluation then starts its engine after the arm, as before
                self.slots[folder] = None
                print(f"learning_run: {folder}: no early evaluation engine ({e!r})", flush=True)
        return self.slots[folder] is not None

    def prestart(self, folder: str, wait_s: float) -> None:
        out = self.root / "eval" / folder
        out.mkdir(parents=True, exist_ok=True)
        listing = out / "adapters.txt"
        listing.unlink(missing_ok=True)
        self._launch(
            folder,
            waiting_eval_command(
                self.args.model,
                listing,
                wait_s,
                self.slots[folder],
                out,
                self.args.data_dir,
                self.args.eval_max_new_tokens,
                self.args.eval_gpu_memory_utilization,
                with_base=not self.procs,
            ),
        )
        self.waiting.add(folder)
        print(
            f"learning_run: {folder}: evaluation engine started ahead of the stop step"
            f"{' (with the base model)' if len(self.procs) == 1 else ''}",
            flush=True,
        )

    def start(self, folder: str, step: int | None = None) -> None:
        if folder in self.procs and folder not in self.waiting:
            return
        run = self.root / folder
        if step is None:  # --stop-at-step, or the last checkpoint before it (an arm that was stopped earlier)
            want = self.args.stop_at_step
            usable = [s for s in checkpoint_steps(run) if want is None or s <= want]
            step = usable[-1] if usable else None
        if step is None:
            print(f"learning_run: {folder}: no checkpoint to evaluate", flush=True)
            if folder in self.waiting:  # its engine would wait for a list that never comes
                self.waiting.discard(folder)
                _kill(self.procs.pop(folder))
            return
        self.steps[folder] = step
        if folder in self.waiting:
            listing = self.root / "eval" / folder / "adapters.txt"
            tmp = listing.with_suffix(".tmp")
            tmp.write_text("".join(a + "\n" for a in arm_adapters(run, step)))
            os.replace(tmp, listing)  # whole or absent: the waiting evaluation reads it as soon as it exists
            self.waiting.discard(folder)
            print(f"learning_run: {folder}: evaluation of step {step} handed to its running engine", flush=True)
            return
        out = self.root / "eval" / folder
        out.mkdir(parents=True, exist_ok=True)
        self._launch(
            folder,
            arm_eval_command(
                self.args.model,
                run,
                step,
                out,
                self.args.data_dir,
                self.args.eval_max_new_tokens,
                self.args.eval_gpu_memory_utilization,
                with_base=not self.procs,
            ),
        )
        print(
            f"learning_run: {folder}: evaluation started at step {step}"
            f"{' (with the base model)' if len(self.procs) == 1 else ''}",
            flush=True,
        )

    def wait(self) -> int:
        rc = max((p.wait() for p in self.procs.values()), default=1)
        results = sorted((self.root / "eval").glob("*/results.json"))
        if results:
            try:
                from populora_verl.eval.arms import arm_scores, load_outcomes, markdown

                scores = arm_scores(load_outcomes(results))
                arms = sorted({a for s in scores.values() for a in s} - {"base"})
                (self.root / "eval" / "arms.md").write_text(markdown(scores, [(a, "base") for a in arms]))
            except (OSError, ValueError) as e:  # the per-arm results stay; only the summary is missing
                print(f"learning_run: eval/arms.md not written: {e}", flush=True)
        return rc


def warm_cache_command(data_dir: str | None, workers: int = 4) -> list[str]:
    """The canonical solutions' expected outputs, computed into the eval cache while the arms train (about 1.7 min
    of 16 CPUs on an H100 machine that the evaluation would otherwise wait for)."""
    cmd = [
        sys.executable,
        "-m",
        "populora_verl.eval.cli",
        "--warm-cache",
        "--benchmarks",
        EVAL_BENCHMARKS,
        "--workers",
        str(workers),
    ]
    return cmd + (["--data-dir", data_dir] if data_dir else [])


def _launch(
    arm: str,
    model: str,
    root: Path,
    seed_file: str | None,
    extra: Sequence[str],
    stop_at_step: int | None = None,
    gpu: str | None = None,
    arm_extra: Sequence[str] = (),
) -> subprocess.Popen:
    run = root / arm_dir(arm)
    run.mkdir(parents=True, exist_ok=True)
    (run / "STOP").unlink(missing_ok=True)  # a stale stop file would end the new run at once
    if stop_at_step:  # the run ends at this step (or the first safe one after it)
        (run / "STOP").write_text(f"{stop_at_step}\n")
    log = open(run / "train.log", "w")
    cmd = arm_command(arm, model, root, seed_file, [*extra, *arm_extra])
    (run / "command.txt").write_text(" ".join(cmd) + "\n")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=arm_env(arm, root, gpu), start_new_session=True
    )
    _CHILDREN[run.name] = proc
    print(
        f"learning_run: {run.name} started (pid {proc.pid}{', GPU ' + gpu if gpu is not None else ''}) "
        f"{'with ' + seed_file if seed_file else 'with seeding'}",
        flush=True,
    )
    return proc


def last_line(log: Path) -> str:
    """The last non-empty line of an arm's log: a failed start's one-line reason (``populora: <key>: ...``)."""
    try:
        lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "an empty log"


def group_pids(pgid: int) -> list[int]:
    """Every live process of a process group (an arm: its trainer and all it spawned), from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid):
            pids.append(int(stat.parent.name))
    return sorted(pids)


def dump_stacks(pgid: int, out: Path) -> str:
    """The Python stacks of every process in the group into ``out`` (py-spy, where installed): where a hung arm
    waits. Returns what was done, for the driver's log."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "no py-spy on PATH: no stacks"
    with open(out, "w") as f:
        for pid in group_pids(pgid):
            f.write(f"=== pid {pid}\n")
            f.flush()
            try:
                subprocess.run([spy, "dump", "--pid", str(pid)], stdout=f, stderr=subprocess.STDOUT, timeout=30)
            except subprocess.TimeoutExpired:
                f.write("(py-spy timed out)\n")
    return f"stacks in {out}"


def step_age(run: Path, now: float) -> float | None:
    """Seconds since the arm logged its last step (None before its first)."""
    metrics = run / "metrics.jsonl"
    return now - metrics.stat().st_mtime if metrics.is_file() and population_rows(run) else None


def overdue(run: Path, now: float, hang_after_s: float) -> float | None:
    """Seconds since the arm's last logged step when that is past its limit (``hang_after_s``, or 10 median steps
    if longer: a checkpoint or an evaluation engine beside it may stretch one step), else None. Before the first
    step there is nothing to compare with: start-up is the deadline's business."""
    age = step_age(run, now) if hang_after_s else None
    if age is None:
        return None
    limit = max(hang_after_s, 10 * (median_step_s(run) or 0.0))
    return age if age > limit else None


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


def arm_overrides(specs: Sequence[str]) -> dict[str, list[str]]:
    """``NAME:KEY=VALUE`` items -> {arm name: [hydra overrides]}, for settings that differ between arm kinds (the
    per-type proposals that keep the arms compute-matched at another batch size)."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, override = spec.partition(":")
        if name not in ARMS or not sep or "=" not in override:
            raise ValueError(f"{spec!r}: expected NAME:KEY=VALUE with NAME one of {sorted(ARMS)}")
        out.setdefault(name, []).append(override)
    return out


def parse_arms(spec: str) -> list[str]:
    """The ``--arms`` list: specs (:func:`parse_arm`), each folder once."""
    arms = [a.strip() for a in spec.split(",") if a.strip()]
    for a in arms:
        parse_arm(a)
    folders = [arm_dir(a) for a in arms]
    dup = sorted({f for f in folders if folders.count(f) > 1})
    if dup:
        raise ValueError(f"arms {dup} appear twice (give each its own @SEED)")
    if not arms:
        raise ValueError("no arm given")
    return arms


def run(args: argparse.Namespace) -> int:
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    try:
        arms = parse_arms(args.arms)
    except ValueError as e:
        raise SystemExit(f"learning_run: --arms: {e}") from None
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else []
    gpu_of = {a: (gpus[i % len(gpus)] if gpus else None) for i, a in enumerate(arms)}
    signal.signal(signal.SIGTERM, _on_sigterm)
    t0 = time.time()
    deadline = t0 + args.stop_after_min * 60
    folders = [arm_dir(a) for a in arms]
    gpu_of_folder = {arm_dir(a): g for a, g in gpu_of.items()}
    write_progress(
        root,
        pid=os.getpid(),
        started=t0,
        state="starting",
        arms=folders,
        deadline=deadline,
        model=args.model,
        gpus=gpu_of_folder,
    )
    try:
        own = arm_overrides(args.arm_override or [])
    except ValueError as e:
        raise SystemExit(f"learning_run: --arm-override: {e}") from None
    first, rest = arms[0], arms[1:]
    procs = {
        arm_dir(first): _launch(
            first,
            args.model,
            root,
            args.seed_file,
            args.overrides,
            args.stop_at_step,
            gpu_of[first],
            own.get(parse_arm(first)[0], []),
        )
    }
    seed_file = args.seed_file or str(root / arm_dir(first) / "seed_tasks.jsonl")
    # The other arms start now (start-up overlaps) and wait at their first step for the first arm's seed set.
    for arm in rest:
        procs[arm_dir(arm)] = _launch(
            arm,
            args.model,
            root,
            seed_file,
            args.overrides,
            args.stop_at_step,
            gpu_of[arm],
            own.get(parse_arm(arm)[0], []),
        )
    write_progress(root, state="training", seed_file=seed_file, launched={a: time.time() for a in procs})
    warm = None

    def start_warm_cache() -> subprocess.Popen:
        with open(root / "warm_cache.log", "w") as f:  # low priority: the arms' executors come first
            proc = subprocess.Popen(
                warm_cache_command(args.data_dir),
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda: os.nice(10),
            )
        _CHILDREN["warm_cache"] = proc
        return proc

    stopped: set[str] = set()
    hung: dict[str, int] = {}  # arm -> its last logged step, for arms killed for making no progress
    seeding = arm_dir(first)
    early = (
        EarlyEval(
            args, root, gpu_of_folder, {arm_dir(a): (a, [*args.overrides, *own.get(parse_arm(a)[0], [])]) for a in arms}
        )
        if args.stop_at_step and not args.no_eval and len(set(gpus)) >= len(arms)
        else None
    )

    def early_failure() -> str | None:
        """Why the run cannot give a comparison any more, or None. An arm that fails before its first step (a config
        mistake, an OOM at start-up) leaves nothing to compare, so the others stop too instead of burning GPU time;
        the seeding arm ending without its seed set leaves the others waiting for nothing."""
        for arm, p in procs.items():
            if p.poll() not in (None, 0) and not population_rows(root / arm):
                log = root / arm / "train.log"
                return f"{arm} ended (rc {p.returncode}) before its first step: {last_line(log)} (whole log: {log})"
        if rest and procs[seeding].poll() is not None and not Path(seed_file).exists():
            return f"{seeding} ended (rc {procs[seeding].returncode}) before writing its seed set {seed_file}"
        return None

    while any(p.poll() is None for p in procs.values()) and not early_failure():
        # The expected-output cache (on the order of 100 MB) is written once every arm trains: a run that fails at
        # start-up (a config mistake, a machine without GPUs) leaves none behind.
        if warm is None and not args.no_eval and all(population_rows(root / a) for a in procs):
            warm = start_warm_cache()
        if early is not None:  # an arm that reached --stop-at-step frees its GPU for its own evaluation
            for arm, p in procs.items():
                if p.poll() is None and early.prestart_due(arm):
                    early.prestart(arm, wait_s=max(60.0, deadline + args.grace_min * 60 - time.time()))
                if (
                    (arm not in early.procs or arm in early.waiting)
                    and p.poll() == 0
                    and args.stop_at_step in checkpoint_steps(root / arm)
                ):
                    early.start(arm)
        now = time.time()
        for arm, p in procs.items():  # a hung arm (a stuck weight sync) would otherwise hold its GPU to the deadline
            age = overdue(root / arm, now, args.hang_after_s) if p.poll() is None else None
            if age is not None:
                last = len(population_rows(root / arm))
                print(
                    f"learning_run: {arm}: no step for {age:.0f} s after step {last}; "
                    f"{dump_stacks(p.pid, root / arm / 'hang_stacks.txt')}; killed",
                    flush=True,
                )
                _kill(p)
                hung[arm] = last
                write_progress(root, hung=hung)
        if now >= deadline:
            for arm, p in procs.items():
                if p.poll() is None and arm not in stopped:
                    (root / arm / "STOP").write_text("")  # end at the next safe step, even before --stop-at-step
                    stopped.add(arm)
                    print(f"learning_run: {arm}: stop file written at {now - t0:.0f} s", flush=True)
        if now >= deadline + args.grace_min * 60:  # an arm that never reached a safe step
            for arm, p in procs.items():
                if p.poll() is None:
                    print(
                        f"learning_run: {arm} still running {args.grace_min} min after its stop file: killed",
                        flush=True,
                    )
                    _kill(p)
        time.sleep(POLL_S)
    reason = early_failure()
    for arm in procs:  # spent: left behind, a stop file would end the arm's next start (a resume) at once
        (root / arm / "STOP").unlink(missing_ok=True)
    if reason:
        for p in [*procs.values(), *([warm] if warm is not None else [])]:
            _kill(p)
        write_progress(root, state="failed", reason=reason)
        print(f"learning_run: {reason}; the other arms were stopped", flush=True)
        return 1
    rcs = {a: p.returncode for a, p in procs.items()}
    runs = {a: root / a for a in folders}
    step = common_step(runs)
    write_progress(
        root,
        state="trained",
        rcs=rcs,
        trained_s=time.time() - t0,
        common_step=step,
        checkpoints={a: checkpoint_steps(p) for a, p in runs.items()},
    )
    print(f"learning_run: arms ended {rcs}; last common checkpoint step {step}", flush=True)
    _compare(runs, root)
    if args.no_eval or (step is None and early is None):
        write_progress(root, state="finished", wall_s=time.time() - t0)
        return 0 if step is not None else 1
    if warm is not None and warm.poll() is None:  # normally long done; the eval would redo what is missing
        try:
            warm.wait(timeout=300)
        except subprocess.TimeoutExpired:
            _kill(warm)
    write_progress(root, state="evaluating", eval_started=time.time())
    if early is not None:  # the arms not evaluated yet (the last to end), each at its step (named in the results)
        for arm in folders:
            early.start(arm)
        rc = early.wait()
        write_progress(root, state="finished", eval_rc=rc, wall_s=time.time() - t0, eval_steps=early.steps)
        print(f"learning_run: eval exit {rc}; finished after {time.time() - t0:.0f} s", flush=True)
        return rc
    rc = _evaluate(args, runs, step, root, gpus)
    write_progress(root, state="finished", eval_rc=rc, wall_s=time.time() - t0)
    print(f"learning_run: eval exit {rc}; finished after {time.time() - t0:.0f} s", flush=True)
    return rc


def _evaluate(args: argparse.Namespace, runs: Mapping[str, Path], step: int, root: Path, gpus: Sequence[str]) -> int:
    """One populora-eval over every benchmark, or with several GPUs one per benchmark side by side (each into
    ``eval/<benchmark>``); the worst exit status."""
    benches = EVAL_BENCHMARKS.split(",")
    jobs = (
        [(",".join(benches), root / "eval", None)]
        if len(gpus) < 2
        else [(b, root / "eval" / b, gpus[i % len(gpus)]) for i, b in enumerate(benches)]
    )
    procs = []
    for bench, out, gpu in jobs:
        cmd = eval_command(
            args.model,
            runs,
            step,
            out,
            args.data_dir,
            args.eval_max_new_tokens,
            args.eval_gpu_memory_utilization,
            benchmarks=bench,
        )
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval_command.txt").write_text(" ".join(cmd) + "\n")
        log = open(out / "eval.log" if gpu is not None else root / "eval.log", "w")
        procs.append(
            subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=arm_env(f"eval_{bench.split(',')[0]}", root, gpu)
            )
        )
    return max(p.wait() for p in procs)


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
    lines = [
        f"learning_run pid {prog.get('pid')} {'running' if alive(prog.get('pid')) else 'not running'}; "
        f"state {prog.get('state')}; "
        f"{now - prog.get('started', now):.0f} s since start; stop files at "
        f"{prog.get('deadline', now) - prog.get('started', now):.0f} s"
    ]
    for arm in prog.get("arms", []):
        rows, timings = population_rows(root / arm), verl_rows(root / arm)
        last = {**(timings[-1] if timings else {}), **(rows[-1] if rows else {})}
        watch = " ".join(f"{k.split('/', 1)[-1]}={last[k]:.3g}" for k in WATCH if isinstance(last.get(k), (int, float)))
        # A step that is long overdue (a hung weight sync, a dead worker) shows as a growing age here.
        age = step_age(root / arm, now)
        lines.append(
            f"  {arm}: {len(rows)} steps; checkpoints {checkpoint_steps(root / arm)}; "
            f"last{'' if age is None else f' {age:.0f} s ago'}: {watch}"
        )
    for k in ("hung", "rcs", "common_step", "eval_rc", "reason"):
        if k in prog:
            lines.append(f"  {k}: {prog[k]}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, help="run root: one folder per arm, eval/, compare/, progress.json")
    ap.add_argument("--status", action="store_true", help="print the progress of the run under --out and exit")
    ap.add_argument("--model", help="the base model folder (HF format)")
    ap.add_argument(
        "--arms",
        default="2t2s,single",
        help="comma list of NAME or NAME@SEED ("
        + ", ".join(ARMS)
        + "); the first runs the seeding phase unless --seed-file is given",
    )
    ap.add_argument(
        "--gpus",
        help="comma list of GPU ids: arm i runs alone on GPU i (cycled when fewer GPUs than "
        "arms); default: every arm sees every GPU",
    )
    ap.add_argument(
        "--arm-override",
        action="append",
        metavar="NAME:KEY=VALUE",
        help="a hydra override for the arms of one kind only (repeatable), e.g. "
        "single:populora.rollout.proposals_per_type=5",
    )
    ap.add_argument("--seed-file", help="start every arm from this seed set instead of the first arm's seeding")
    ap.add_argument("--stop-after-min", type=float, default=17.0, help="minutes after start to write the stop files")
    ap.add_argument(
        "--stop-at-step",
        type=int,
        help="every arm ends at this step (the first safe one from it on), or at the deadline, whichever comes first",
    )
    ap.add_argument("--grace-min", type=float, default=6.0, help="minutes after the stop files before a kill")
    ap.add_argument(
        "--hang-after-s",
        type=float,
        default=600.0,
        help="an arm with no new step for this long (or 10 median steps, if longer) is hung: its stacks "
        "are dumped (py-spy) and it is killed, the others go on, and its last checkpoint is "
        "evaluated; 0: never",
    )
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--data-dir", help="benchmark folder for populora-eval (default: the package's copy)")
    ap.add_argument("--eval-max-new-tokens", type=int, default=768)
    ap.add_argument(
        "--eval-gpu-memory-utilization",
        type=float,
        default=0.3,
        help="of the GPU's memory, for each evaluation engine (it may share the GPU with its arm's "
        "trainer, see --eval-prestart-s)",
    )
    ap.add_argument(
        "--eval-prestart-s",
        type=float,
        default=120.0,
        help="with --stop-at-step and one GPU per arm: start an arm's evaluation engine this many seconds "
        "before the arm is expected at its stop step (from its median step time), beside its "
        "trainer; 0: start it after the arm ends",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="start nothing: compose every arm's trainer config as its command would, run the start-up checks "
        "that need no GPU, print each adapter's planned trained trajectories and response tokens per step, "
        "and exit 1 unless the arms are compute matched",
    )
    ap.add_argument("overrides", nargs="*", help="hydra overrides for every arm")
    args = ap.parse_args(argv)
    if args.status:
        print(status(Path(args.out)))
        return 0
    if not args.model:
        ap.error("--model is required to start a run")
    if args.check:
        try:
            return check_arms(args)
        except ValueError as e:  # a malformed --arms or --arm-override
            raise SystemExit(f"learning_run: {e}") from None
    if args.stop_after_min <= 0:
        ap.error("--stop-after-min must be > 0")
    if args.hang_after_s < 0:
        ap.error("--hang-after-s must be >= 0 (0: never)")
    if args.eval_prestart_s < 0:
        ap.error("--eval-prestart-s must be >= 0 (0: the engine starts after the arm)")
    if not 0 < args.eval_gpu_memory_utilization <= 1:
        ap.error("--eval-gpu-memory-utilization must be in (0, 1]")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
