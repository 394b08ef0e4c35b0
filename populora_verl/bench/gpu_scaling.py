"""Scaling of one PopuLoRA configuration over 1, 2, 4, ... GPUs of one host (goals: >= 1.7x at 2, >= 3.2x at 4).

    python -m populora_verl.bench.gpu_scaling --model /path/to/qwen-coder-0.5b --gpus 1,2,4 [--config 4t4s] \
        [--tp 1] [--steps 5] [--profile varlen] [--answer-tokens 1024] [--per-gpu-proposals N] [--out DIR] \
        [--recipe NAME] [hydra overrides...]

Runs a recipe (default ``smoke_0.5b``; ``--recipe qwen1.5b_4gpu_4t4s`` measures the 4-GPU recipe itself) with
the same population and per-step work on the first G visible GPUs
(``CUDA_VISIBLE_DEVICES``, ``trainer.n_gpus_per_node=G``): G FSDP2 ranks for the actor and G / TP vLLM replicas.
Only the GPU count changes, so tokens per step stay the same and the speed-up is a throughput ratio. The speed
settings are ``step_scaling``'s profiles (default ``varlen``, what docs/verl-integration.md recommends), and every
answer is forced to ``--answer-tokens`` (vLLM ``ignore_eos``), so every row generates the same tokens.
``--per-gpu-proposals N`` instead scales the step's work with the GPUs (``populora.rollout.proposals_per_type =
N x G``): weak scaling, where the figure is tokens/s per GPU against the 1-GPU row (goal >= 0.85). Per GPU count:

* seconds per step and tokens per second (``perf/total_num_tokens`` / ``timing_s/step``), over steps 2..N;
* the speed-up against the 1-GPU row **of the same machine** (the GPU name is recorded; a 1-GPU row from another
  machine kind is never used as the baseline), and the goal for that count;
* the step's phases (generation, old log-probs, update, weight sync) and peak GPU memory (``nvidia-smi``, summed);
* the start-up, launch to the end of step 1 (step 1 included, unlike ``step_scaling``'s start-up column), from the
  trainer's own ``[populora] start-up:`` line.

Rows of earlier invocations with the same ``--out`` are kept (a GPU count run again replaces its row), so each GPU
count can go in its own call on one warm machine and still land in one table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from populora_verl.bench import step_scaling as ss
from populora_verl.trainer.timeline import total_seconds

#: Throughput goals against one GPU of the same machine (near-linear: 85 % and 80 % of ideal).
GOALS = {2: 1.7, 4: 3.2}
#: Weak scaling (the work grows with the GPUs): tokens/s per GPU against the 1-GPU row.
WEAK_GOAL = 0.85
PHASES = ("gen", "old_log_prob", "update_actor", "update_weights")


@dataclass
class ScalingRow:
    gpus: int
    tp: int
    config: str
    gpu_name: str
    rc: int
    wall_s: float
    step_s: dict[int, float] = field(default_factory=dict)
    tokens: dict[int, float] = field(default_factory=dict)
    phases_s: dict[str, float] = field(default_factory=dict)
    smi_peak_mib: float | None = None
    profile: str = ""  # step_scaling's speed profile ("" in rows from before profiles were recorded)
    per_gpu_proposals: int | None = None  # weak scaling: proposals_per_type = this x gpus; None: the recipe's, fixed
    recipe: str = ss.BENCH_RECIPE
    startup_s: float | None = None  # launch to the END of step 1 (the trainer's timeline total), step 1 included

    @property
    def key(self) -> str:
        weak = f"_w{self.per_gpu_proposals}" if self.per_gpu_proposals else ""
        recipe = "" if self.recipe == ss.BENCH_RECIPE else f"_{self.recipe}"
        return f"{self.config}@{self.gpus}gpu_tp{self.tp}{weak}{recipe}"

    def steady(self) -> list[int]:
        return sorted(k for k in self.step_s if k >= 2 and k in self.tokens)

    @property
    def mean_step_s(self) -> float | None:
        steps = self.steady()
        return sum(self.step_s[k] for k in steps) / len(steps) if steps else None

    @property
    def tokens_per_s(self) -> float | None:
        steps = self.steady()
        time_s = sum(self.step_s[k] for k in steps)
        return sum(self.tokens[k] for k in steps) / time_s if steps and time_s > 0 else None

    def tokens_per_s_range(self) -> tuple[float, float, float] | None:
        """``(min, median, max)`` of the steady steps' own tokens/s: the spread behind :attr:`tokens_per_s`."""
        per_step = sorted(self.tokens[k] / self.step_s[k] for k in self.steady() if self.step_s[k] > 0)
        return (per_step[0], statistics.median(per_step), per_step[-1]) if per_step else None


def figures(
    rows: Iterable[tuple[int, Mapping[str, Any]]],
) -> tuple[dict[int, float], dict[int, float], dict[str, float]]:
    """``({step: s}, {step: tokens}, {phase: mean s over steps >= 2})`` from verl's ``(step, metrics)`` rows."""
    step_s, tokens, phases = {}, {}, {}
    for step, data in rows:
        num = {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "timing_s/step" in num:
            step_s[step] = num["timing_s/step"]
        if "perf/total_num_tokens" in num:
            tokens[step] = num["perf/total_num_tokens"]
        if step >= 2:
            for ph in PHASES:
                if f"timing_s/{ph}" in num:
                    phases.setdefault(ph, []).append(num[f"timing_s/{ph}"])
    return step_s, tokens, {ph: sum(v) / len(v) for ph, v in phases.items()}


def overrides_for(gpus: int, tp: int) -> list[str]:
    """What changes with the GPU count (everything else is the configuration's own)."""
    return [
        f"trainer.n_gpus_per_node={gpus}",
        "trainer.nnodes=1",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
    ]


def baseline(rows: Sequence[ScalingRow], row: ScalingRow) -> ScalingRow | None:
    """The 1-GPU row of the same recipe, configuration, profile and work per GPU on the same GPU model, if measured."""
    return next(
        (
            b
            for b in rows
            if b.gpus == 1
            and b.config == row.config
            and b.gpu_name == row.gpu_name
            and b.profile == row.profile
            and b.per_gpu_proposals == row.per_gpu_proposals
            and b.recipe == row.recipe
            and b.tokens_per_s
        ),
        None,
    )


def speedup_text(row: ScalingRow, base: ScalingRow | None) -> tuple[str, str]:
    """The speed-up column and its goal: total tokens/s for the same work, also per GPU when the work grows."""
    tps = row.tokens_per_s
    ratio = tps / base.tokens_per_s if tps and base else None
    if row.per_gpu_proposals:
        speed = f"{ratio:.2f}x ({ratio / row.gpus:.2f} per GPU)" if ratio else "-"
        return speed, f">= {WEAK_GOAL} per GPU" if row.gpus > 1 else "-"
    return (f"{ratio:.2f}x" if ratio else "-"), (f">= {GOALS[row.gpus]}x" if row.gpus in GOALS else "-")


def report(rows: Sequence[ScalingRow]) -> str:
    lines = [
        "| recipe | config | profile | work | GPUs | rollout | GPU | s/step (2..N) | tokens/s | speed-up vs 1 GPU "
        "| goal | "
        "tokens/s per step: min / median / max | steps | "
        + " | ".join(f"{p} s" for p in PHASES)
        + " | start-up to end of step 1 s | peak MiB | exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(PHASES) + "---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.recipe, r.config, r.profile, r.per_gpu_proposals or 0, r.gpus, r.tp)):
        tps, s = r.tokens_per_s, r.mean_step_s
        speed, goal = speedup_text(r, baseline(rows, r))
        layout = f"{r.gpus // r.tp} x TP{r.tp}"
        spread = " / ".join(f"{x:.0f}" for x in r.tokens_per_s_range() or ()) or "-"
        work = f"{r.per_gpu_proposals * r.gpus} proposals/type" if r.per_gpu_proposals else "fixed"
        lines.append(
            f"| {r.recipe} | {r.config} | {r.profile or '-'} | {work} | {r.gpus} | {layout} | "
            f"{r.gpu_name or '-'} | "
            f"{f'{s:.1f}' if s else '-'} | {f'{tps:.0f}' if tps else '-'} | {speed} | {goal} | {spread} | "
            f"{len(r.steady())} | "
            + " | ".join(f"{r.phases_s[p]:.1f}" if p in r.phases_s else "-" for p in PHASES)
            + f" | {f'{r.startup_s:.0f}' if r.startup_s else '-'}"
            + f" | {f'{r.smi_peak_mib:.0f}' if r.smi_peak_mib else '-'} | {r.rc} |"
        )
    return "\n".join(lines)


def _gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        ).stdout.splitlines()
        return out[0].strip() if out else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def run_one(
    model: str,
    config: str,
    gpus: int,
    tp: int,
    steps: int,
    out: Path,
    extra: list[str],
    timeout_s: int,
    profile: str = "",
    per_gpu_proposals: int | None = None,
    recipe: str = ss.BENCH_RECIPE,
) -> ScalingRow:
    """One row: ``config`` on the first ``gpus`` visible GPUs; ``extra`` holds the profile's overrides (and, for weak
    scaling, the step's work), ``profile`` names it (its environment, ``step_scaling.PROFILE_ENV``, reaches the
    trainer) and ``per_gpu_proposals`` is recorded with the row."""
    row = ScalingRow(
        gpus,
        tp,
        config,
        _gpu_name(),
        rc=-1,
        wall_s=0.0,
        profile=profile,
        per_gpu_proposals=per_gpu_proposals,
        recipe=recipe,
    )
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or [
        str(i) for i in range(gpus)
    ]
    metrics = out / f"{row.key}.metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES=",".join(visible[:gpus]),
        VLLM_WORKER_MULTIPROC_METHOD="spawn",
        VLLM_USE_FLASHINFER_SAMPLER="0",
        RAY_AUTH_MODE="disabled",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        VERL_FILE_LOGGER_PATH=str(metrics),
        **ss.PROFILE_ENV.get(profile, {}),
    )
    cmd = ss.command(model, config, steps, out / row.key, [*overrides_for(gpus, tp), *extra], recipe=recipe)
    t0 = time.time()
    with ss.GpuMemoryPoller() as poller, open(out / f"{row.key}.log", "w") as f:
        try:
            row.rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            row.rc = 124
    row.wall_s, row.smi_peak_mib = time.time() - t0, poller.peak or None
    if metrics.exists():
        row.step_s, row.tokens, row.phases_s = figures(ss.file_log_rows(metrics.read_text(errors="replace")))
    log = (out / f"{row.key}.log").read_text(errors="replace")
    if not row.step_s:  # no file logger output: verl's console lines
        row.step_s, row.tokens, row.phases_s = figures(ss.console_rows(log))
    row.startup_s = total_seconds(log)
    return row


def load_rows(path: Path) -> list[ScalingRow]:
    if not path.exists():
        return []
    rows = []
    for raw in json.loads(path.read_text()):
        raw = {k: v for k, v in raw.items() if k in ScalingRow.__dataclass_fields__}
        for k in ("step_s", "tokens"):
            raw[k] = {int(s): float(v) for s, v in raw.get(k, {}).items()}
        rows.append(ScalingRow(**raw))
    return rows


def save_rows(path: Path, rows: Sequence[ScalingRow]) -> None:
    path.write_text(
        json.dumps([asdict(r) | {"mean_step_s": r.mean_step_s, "tokens_per_s": r.tokens_per_s} for r in rows], indent=1)
    )


def upsert(rows: Sequence[ScalingRow], row: ScalingRow) -> list[ScalingRow]:
    """``rows`` with ``row`` replacing any row of the same configuration, GPU count, work, profile and GPU model."""
    return [r for r in rows if (r.key, r.gpu_name, r.profile) != (row.key, row.gpu_name, row.profile)] + [row]


def write_table(out: Path, rows: Sequence[ScalingRow]) -> str:
    """``out/results.md`` from ``rows``; returns the table."""
    table = report(rows)
    (out / "results.md").write_text(table + "\n")
    return table


def merge(dirs: Sequence[str], out: Path) -> int:
    """Rows of several ``--out`` folders in one table (a later folder's row replaces an earlier one's as
    :func:`upsert` says); written to ``out/results.{json,md}``."""
    rows: list[ScalingRow] = []
    for d in dirs:
        path = Path(d) / "results.json"
        if not path.exists():
            print(f"gpu_scaling: {path} is missing; its rows are left out", file=sys.stderr)
            continue
        for row in load_rows(path):
            rows = upsert(rows, row)
    if not rows:
        print("gpu_scaling: no rows to merge", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    save_rows(out / "results.json", rows)
    print(write_table(out, rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (required unless --merge)")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        help="no run: join the results.json of these --out folders (rows measured side by side in "
        "separate folders) into --out and print the table",
    )
    ap.add_argument("--gpus", default="1,2,4", help="comma-separated GPU counts (each <= the visible GPUs)")
    ap.add_argument("--config", default="4t4s", choices=sorted(ss.CONFIGS))
    ap.add_argument("--tp", type=int, default=1, help="rollout tensor parallel size (1-GPU rows always use 1)")
    ap.add_argument("--steps", type=int, default=5, help="steps per run (step 1 is warm-up)")
    ap.add_argument("--profile", default="varlen", choices=sorted(ss.PROFILES), help="step_scaling's speed settings")
    ap.add_argument("--answer-tokens", type=int, default=1024, help="answer length (data.max_response_length)")
    ap.add_argument(
        "--force-length",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every answer exactly --answer-tokens long (vLLM ignore_eos)",
    )
    ap.add_argument(
        "--per-gpu-proposals",
        type=int,
        default=None,
        metavar="N",
        help="weak scaling: populora.rollout.proposals_per_type = N x GPUs (default: the recipe's, the "
        "same work on every GPU count)",
    )
    ap.add_argument("--recipe", default=ss.BENCH_RECIPE, help="the recipe every row runs (a name in recipes/populora)")
    ap.add_argument("--out", default="bench_gpu_scaling")
    ap.add_argument("--timeout-s", type=int, default=1800)
    ap.add_argument("overrides", nargs="*", help="extra hydra overrides for every run")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.out))
    if not args.model:
        ap.error("--model is required")
    counts = [int(x) for x in args.gpus.split(",") if x.strip()]
    if args.steps < 2:
        ap.error("--steps must be >= 2 (step 1 is warm-up)")
    if args.per_gpu_proposals is not None and args.per_gpu_proposals < 1:
        ap.error("--per-gpu-proposals must be >= 1")
    if not (ss.RECIPES / f"{args.recipe}.yaml").is_file():
        ap.error(f"--recipe {args.recipe!r}: no {args.recipe}.yaml in {ss.RECIPES}")
    bad_tp = [g for g in counts if g > 1 and g % args.tp]
    if bad_tp:
        ap.error(f"--tp {args.tp} does not divide GPU counts {bad_tp}")
    try:
        import torch

        available = torch.cuda.device_count()
    except ImportError:
        available = 0
    if available < max(counts):
        print(f"gpu_scaling: needs {max(counts)} CUDA GPU(s), found {available}; nothing was run.", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    rows = load_rows(results)
    for g in counts:
        tp = 1 if g == 1 else args.tp
        print(f"gpu_scaling: {args.config} on {g} GPU(s), rollout TP {tp} ...", flush=True)
        extra = [*ss.plan_overrides(args.profile, args.answer_tokens, args.force_length), *args.overrides]
        if args.per_gpu_proposals:
            extra.append(f"populora.rollout.proposals_per_type={args.per_gpu_proposals * g}")
        row = run_one(
            args.model,
            args.config,
            g,
            tp,
            args.steps,
            out,
            extra,
            args.timeout_s,
            args.profile,
            args.per_gpu_proposals,
            args.recipe,
        )
        print(
            f"  exit={row.rc} wall={row.wall_s:.0f}s s/step={row.mean_step_s} tokens/s={row.tokens_per_s}", flush=True
        )
        rows = upsert(rows, row)
        save_rows(results, rows)
    print(write_table(out, rows))
    return 0 if all(r.rc == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
