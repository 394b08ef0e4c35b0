"""Step-time and GPU-memory scaling of the verl trainer with population size, next to vLLM's own throughput.

    python -m populora_verl.bench.step_scaling --model 1.5b=/tmp/models/qwen-coder-1.5b \\
        --model 0.5b=/tmp/models/qwen-coder-0.5b --configs single,4t4s,2t2s,1t1s,8t8s --steps 6 --out DIR
    python -m populora_verl.bench.step_scaling --status --out DIR      # progress of a run (e.g. in the background)

Runs ``python -m verl.trainer.main_ppo`` with the ``smoke_0.5b`` recipe once per (model, configuration), one after
another on this machine's GPU(s): the single agent (AZR baseline, 1 adapter), 1T1S, 2T2S, 4T4S and 8T8S. Every
adapter gets the same per-step budget (``proposals_per_type`` x task types teacher prompts, ``student_n`` answers per
task), so a population's step does N times the single agent's generation and update work. Evolution and checkpoints
are off (they are not per-step costs). The ``fast`` profile (default) serves with CUDA graphs, trains without
gradient checkpointing and fuses the per-adapter worker calls; ``--profile baseline`` is the configuration measured
before (eager vLLM, checkpointing, one call per adapter). ``--force-length`` (default) makes every answer exactly
``--answer-tokens`` long (vLLM ``ignore_eos``), so every configuration generates a known number of tokens.

Per configuration, from verl's ``file`` logger (one JSON line per step) and a clock on the metrics file:

* seconds per step over the steps after ``--warmup`` (mean, standard deviation, min, max), ``x single``, and the mean
  of each phase (generation, validation, scoring, old log-probs, update, weight sync);
* start-up (process start to the first step's start), the warm-up step, and tear-down, separately;
* generated tokens per step and generation tokens/s (both rollout phases: ``timing_s/gen`` less the proposal
  validation nested in it);
* peak GPU memory (``nvidia-smi`` polled every 0.5 s: vLLM and the FSDP worker are separate processes) and verl's
  ``actor/perf/max_memory_allocated_gb`` (the trainer worker's own peak).

After a model's configurations, :mod:`populora_verl.bench.ceiling` runs plain vLLM offline ``generate`` with the same
model, LoRA count, request counts and prompt/answer lengths as each measured configuration, and the report gives our
generation tokens/s as a fraction of it. Everything is written as it lands (``results.json``/``results.md`` per model,
``progress.json``), so a run started with ``setsid`` survives the shell that started it and ``--status`` can be polled.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from populora_verl.bench.progress import alive, read_progress, write_progress
from populora_verl.recipes import recipes_dir
from populora_verl.trainer.timeline import START_ENV

RECIPES = recipes_dir()  # a checkout's recipes/populora, else the installed copy
#: The recipe the benchmarks run unless told otherwise; each configuration and profile overrides on top of it.
BENCH_RECIPE = "smoke_0.5b"
CONFIGS: dict[str, list[str]] = {
    "single": ["populora.population.mode=single_agent", "populora.pbt.enabled=false"],
    "1t1s": ["populora.population.num_teachers=1", "populora.population.num_students=1"],
    "2t2s": ["populora.population.num_teachers=2", "populora.population.num_students=2"],
    "4t4s": ["populora.population.num_teachers=4", "populora.population.num_students=4"],
    # 16 adapters: vLLM must hold all of them in one batch.
    "8t8s": [
        "populora.population.num_teachers=8",
        "populora.population.num_students=8",
        "actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras=16",
        "actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras=32",
    ],
}
ADAPTERS = {"single": 1, "1t1s": 2, "2t2s": 4, "4t4s": 8, "8t8s": 16}
# Adapters serving each rollout phase (teachers, students); the single agent does both with one.
PHASE_ADAPTERS = {"single": (1, 1), "1t1s": (1, 1), "2t2s": (2, 2), "4t4s": (4, 4), "8t8s": (8, 8)}
# Decode batch sizes captured as CUDA graphs: every request count of these configurations fits; capturing vLLM's
# default list (up to 512, times the LoRA cases) costs start-up for batch sizes a step never reaches.
CUDAGRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256]
# Each profile adds to the one before it (later overrides win in hydra, so the order is kept).
_FAST = [
    "actor_rollout_ref.rollout.enforce_eager=false",
    f"actor_rollout_ref.rollout.cudagraph_capture_sizes=[{','.join(map(str, CUDAGRAPH_SIZES))}]",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "++trainer.populora_fused_rpc=true",
]
# fast + packed training rows (verl's remove-padding path) with torch's varlen flash kernel
# (populora_verl.workers.varlen_attention): no padding and no quadratic packed mask.
_VARLEN = [
    *_FAST,
    "actor_rollout_ref.model.use_remove_padding=true",
    "++actor_rollout_ref.model.override_config.attn_implementation=populora_varlen",
]
# varlen + verl's fused LM-head kernels (torch backend): log-probs and entropy from the hidden states in chunks
# of 512 tokens. On an H100 it failed at the first log-prob call for Qwen2.5-Coder-1.5B, whose converted checkpoint
# has an untied LM head: verl's FSDP2 wrapping shards lm_head as its own unit, and the fused forward reads
# lm_head.weight directly, still a DTensor ("mixed torch.Tensor and DTensor"). Tied heads (0.5B) are unaffected;
# for untied ones the start-up check (populora_verl.startup) now stops the run in one line.
_FUSED = [
    *_VARLEN,
    "actor_rollout_ref.model.use_fused_kernels=true",
    "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch",
]
# varlen with twice the tokens per training micro-batch and four times per log-prob micro-batch: the trainer is
# launch-bound (GPU busy about 30% inside verl's micro-batches on 1.5B, docs/gpu/step_scaling_qwen1.5b_h100_chunked),
# so fewer, larger micro-batches do the same work in fewer kernel launches. Costs trainer memory (53-59 GiB on
# 1.5B at 1,024-token answers): for a GPU of its own, not for two runs sharing one.
_VARLEN_WIDE = [
    *_VARLEN,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768",
]
# varlen_wide with the parameters kept unsharded after the forward: on one GPU FSDP's all-gather is a copy, and
# resharding after every micro-batch's forward repeats that copy (and its cast to bf16) in the backward; keeping them
# costs one bf16 copy of the model (3 GB at 1.5B). Useful where each trainer has its GPU to itself.
_VARLEN_WIDE_KEEP = [*_VARLEN_WIDE, "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false"]
# varlen_wide_keep with Liger's Triton kernels for RMSNorm, RoPE and SwiGLU (verl's model.use_liger): about a third
# fewer kernel launches per decoder layer, forward and backward, in a trainer that waits on launches.
_VARLEN_WIDE_KEEP_LIGER = [*_VARLEN_WIDE_KEEP, "actor_rollout_ref.model.use_liger=true"]
# varlen_wide with Liger and torch's fused AdamW (one kernel per group instead of a foreach op per list, each going
# through DTensor's dispatch tensor by tensor): the next A/B for the fixed cost of each adapter's update call.
_VARLEN_WIDE_LIGER_FUSED = [
    *_VARLEN_WIDE,
    "actor_rollout_ref.model.use_liger=true",
    "++actor_rollout_ref.actor.optim.override_optimizer_config={fused:true}",
]
# varlen_wide_keep with vLLM's model runner inside its engine-core process (the "uni" executor) instead of a process
# of its own: verl asks for "mp", which spawns one more process importing vLLM and torch even for TP 1 (about 30 s of
# start-up). Without Liger, so that beside varlen_wide_keep_liger it also tells what Liger did to the update. The
# recipes now set uni themselves (BENCHMARKS.md §5), so on them every profile runs uni; this one keeps its name and
# its lean LoRA forward for the figures measured with it.
_UNI_EXECUTOR = "++actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend=uni"
_VARLEN_WIDE_KEEP_UNI = [*_VARLEN_WIDE_KEEP, _UNI_EXECUTOR]
# varlen with vLLM's CUDA graphs kept but its torch.compile pass off: verl starts vLLM with the compile cache
# disabled (VLLM_DISABLE_COMPILE_CACHE=1), so every start compiles from scratch; full graphs of the decode batches
# need no compilation (FlashAttention 3 on Hopper), prefills then run eagerly. The start-up/step-time A/B for that.
VLLM_NO_COMPILE = '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}'
_NO_COMPILE = f"++actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config='{VLLM_NO_COMPILE}'"
_VARLEN_NOCOMPILE = [*_VARLEN, _NO_COMPILE]
# varlen_wide_keep_liger without vLLM's torch.compile pass: beside varlen_wide_keep_liger, the compilation's share of
# the start-up (cold caches) and its price in generation speed.
_VARLEN_WIDE_KEEP_LIGER_NOCOMPILE = [*_VARLEN_WIDE_KEEP_LIGER, _NO_COMPILE]
# varlen_wide_keep_liger with every adapter resident in the trainer (docs/resident-adapters.md): one forward and
# backward per micro-batch for all adapters, one optimizer step, one weight transfer. The A/B of the adapter layout.
_VARLEN_WIDE_KEEP_LIGER_RESIDENT = [*_VARLEN_WIDE_KEEP_LIGER, "populora.population.adapter_layout=resident"]
PROFILES: dict[str, list[str]] = {
    "fast": _FAST,
    "varlen": _VARLEN,
    "varlen_wide": _VARLEN_WIDE,
    "varlen_wide_keep": _VARLEN_WIDE_KEEP,
    "varlen_wide_keep_liger": _VARLEN_WIDE_KEEP_LIGER,
    "varlen_wide_keep_uni": _VARLEN_WIDE_KEEP_UNI,
    "varlen_wide_liger_fused": _VARLEN_WIDE_LIGER_FUSED,
    "varlen_wide_peft": _VARLEN_WIDE,
    "varlen_nocompile": _VARLEN_NOCOMPILE,
    "varlen_wide_keep_liger_nocompile": _VARLEN_WIDE_KEEP_LIGER_NOCOMPILE,
    "varlen_wide_keep_liger_resident": _VARLEN_WIDE_KEEP_LIGER_RESIDENT,
    "varlen_wide_keep_liger_resident_verlmb": _VARLEN_WIDE_KEEP_LIGER_RESIDENT,
    "verl_logprobs": _VARLEN,
    "fused": _FUSED,
    "baseline": [
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "++trainer.populora_fused_rpc=false",
    ],
}
# Environment of a profile's trainer (Ray's local workers inherit it). Every profile but these runs our chunked
# log-probs (populora_verl.workers.logprobs, installed by the worker where verl would loop per token);
# verl_logprobs is varlen with verl's own per-token fallback, the A/B for that change.
PROFILE_ENV: dict[str, dict[str, str]] = {
    "verl_logprobs": {"POPULORA_LOGPROBS": "verl"},
    # the A/B of the trainer's speed levers (BENCHMARKS.md §5): PEFT's LoRA forward against the lean one
    # (populora_verl.workers.lora_forward)
    "varlen_wide_peft": {"POPULORA_LORA_FORWARD": "peft"},
    "varlen_wide_keep_liger": {"POPULORA_LORA_FORWARD": "lean"},
    "varlen_wide_keep_uni": {"POPULORA_LORA_FORWARD": "lean"},
    "varlen_wide_keep_liger_nocompile": {"POPULORA_LORA_FORWARD": "lean"},
    "varlen_wide_keep_liger_resident": {"POPULORA_LORA_FORWARD": "lean"},
    # resident adapters with verl's balanced micro-batches (rows of many slots in each) instead of each slot's rows
    # packed together (populora_verl.workers.resident_engine): the A/B of the micro-batching
    "varlen_wide_keep_liger_resident_verlmb": {
        "POPULORA_LORA_FORWARD": "lean",
        "POPULORA_RESIDENT_MICRO_BATCHES": "verl",
    },
    "baseline": {"POPULORA_LOGPROBS": "verl", "POPULORA_LORA_FORWARD": "peft"},
}
# What a trainer process needs on the GPU image (scripts/gpu/env.sh sets the same): vLLM's workers spawned, not
# forked, after CUDA is up; no FlashInfer sampler (not in the image); Ray without its token check.
TRAINER_ENV: dict[str, str] = {
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "RAY_AUTH_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


def main_ppo_command(recipe: str, *overrides: str) -> list[str]:
    """``python -m verl.trainer.main_ppo`` on one of the package's recipes, with hydra overrides (every benchmark
    that starts a trainer starts it this way)."""
    return [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        "--config-path",
        str(RECIPES),
        "--config-name",
        recipe,
        *overrides,
    ]


def trainer_env(ray_tmpdir: str | None = None, **extra: str) -> dict[str, str]:
    """A trainer's environment: this one plus :data:`TRAINER_ENV`; with ``ray_tmpdir``, a Ray instance of its own
    (``RAY_ADDRESS=local`` and its own temp dir), so trainers on one host never share Ray's sockets.

    Without this process's start time: importing the plugin here set it, and a trainer that inherited it would time
    its start-up from this benchmark's launch (its own command sets it when it imports the plugin)."""
    env = dict(os.environ, **TRAINER_ENV)
    env.pop(START_ENV, None)
    if ray_tmpdir is not None:
        env.update(RAY_ADDRESS="local", RAY_TMPDIR=ray_tmpdir)
    env.update(extra)
    return env


# verl's console logger line, possibly behind Ray's "(TaskRunnerV1 pid=...)" prefix.
_STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - ")
_METRIC = re.compile(r"([\w/@.\-]+):([-+0-9.eE]+|nan|inf)")
# a trainer log line that says why it stopped
_ERROR_LINE = re.compile(r"Traceback|Error|error:|OutOfMemory|CUDA out of memory")
# Step phases worth a column: verl's and ours (trainer.step's marked_timer names).
PHASES = ("gen", "populora_validate", "populora_score", "old_log_prob", "update_actor", "update_weights")
ROLLOUT_PHASES = ("teacher", "student")
# The configuration's process (own session: verl, Ray, vLLM under it), ended with the driver on SIGTERM.
_CHILDREN: list[subprocess.Popen] = []


@dataclass
class RunResult:
    name: str
    adapters: int
    rc: int
    wall_s: float
    step_s: dict[int, float] = field(default_factory=dict)
    verl_peak_gb: float | None = None
    smi_peak_mib: float | None = None
    phases_s: dict[str, float] = field(default_factory=dict)
    warmup: int = 1
    startup_s: float | None = None  # process start -> first step starts
    teardown_s: float | None = None  # last step's metrics row -> process end
    gen_tokens: float | None = None  # mean generated tokens per measured step (both phases)
    rollout: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> mean sequences/prompt/response tokens
    ceiling_tok_s: float | None = None
    model: str = ""
    mfu: float | None = None  # verl's perf/mfu/actor, mean over measured steps (the update's model FLOPs utilisation)
    trained_tokens: float | None = None  # verl's perf/total_num_tokens: tokens the update trained on, per step
    probs_diff: float | None = None  # verl's rollout-vs-trainer |p_rollout - p_trainer| mean: the trainer's numerics

    @property
    def steady(self) -> list[float]:
        return [v for k, v in sorted(self.step_s.items()) if k > self.warmup]

    @property
    def mean_step_s(self) -> float | None:
        s = self.steady
        return sum(s) / len(s) if s else None

    @property
    def std_step_s(self) -> float | None:
        s = self.steady
        return statistics.stdev(s) if len(s) > 1 else (0.0 if s else None)

    @property
    def gen_s(self) -> float | None:
        """Rollout time: verl's ``gen`` timer less the proposal validation nested in it (sandboxed execution)."""
        gen = self.phases_s.get("gen")
        return None if gen is None else gen - self.phases_s.get("populora_validate", 0.0)

    @property
    def gen_tok_s(self) -> float | None:
        gen = self.gen_s
        return self.gen_tokens / gen if self.gen_tokens and gen and gen > 0 else None

    @property
    def trained_tok_s(self) -> float | None:
        """Trained tokens per second of the whole step: the population's throughput against the single agent's."""
        s = self.mean_step_s
        return self.trained_tokens / s if self.trained_tokens and s else None

    @classmethod
    def from_figures(
        cls, name: str, fig: Figures, *, rc: int, wall_s: float, smi_peak_mib: float | None, warmup: int, model: str
    ) -> RunResult:
        """One configuration's result from what its metric rows say (:func:`summarize`)."""
        return cls(
            name,
            ADAPTERS[name],
            rc,
            wall_s,
            fig.step_s,
            fig.peak_gb,
            smi_peak_mib,
            fig.phases_s,
            warmup=warmup,
            gen_tokens=fig.gen_tokens,
            rollout=fig.rollout,
            model=model,
            mfu=fig.mfu,
            trained_tokens=fig.trained_tokens,
            probs_diff=fig.probs_diff,
        )

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> RunResult:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in row.items() if k in names}
        kw["step_s"] = {int(k): float(v) for k, v in (row.get("step_s") or {}).items()}
        return cls(**kw)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {
            "mean_step_s": self.mean_step_s,
            "std_step_s": self.std_step_s,
            "gen_tok_s": self.gen_tok_s,
            "trained_tok_s": self.trained_tok_s,
        }


@dataclass
class Figures:
    """What one run's metric rows say (see :func:`summarize`)."""

    step_s: dict[int, float] = field(default_factory=dict)
    peak_gb: float | None = None
    phases_s: dict[str, float] = field(default_factory=dict)
    gen_tokens: float | None = None
    rollout: dict[str, dict[str, float]] = field(default_factory=dict)
    mfu: float | None = None
    trained_tokens: float | None = None
    probs_diff: float | None = None

    def __iter__(self):  # (steps, peak, phases), the shape earlier callers unpack
        return iter((self.step_s, self.peak_gb, self.phases_s))


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _step_gen_tokens(num: Mapping[str, float]) -> float | None:
    """Generated tokens of one step: our per-phase counters, else verl's means over the trained batch."""
    ours = [num.get(f"populora/rollout/{p}/response_tokens") for p in ROLLOUT_PHASES]
    if all(v is not None for v in ours):
        return float(sum(ours))
    resp, prompt, total = (num.get(k) for k in ("response_length/mean", "prompt_length/mean", "perf/total_num_tokens"))
    if resp and total and (prompt or 0) + resp > 0:
        return resp * total / ((prompt or 0) + resp)  # mean response x number of trained sequences
    return None


def summarize(rows: Iterable[tuple[int, Mapping[str, Any]]], warmup: int = 1) -> Figures:
    """A run's figures from ``(step, metrics)`` rows: ``{step: timing_s/step}``, the max trainer peak memory, and the
    means over steps after ``warmup`` of each phase's ``timing_s/<phase>``, of the generated tokens and of each rollout
    phase's sequences / prompt tokens / response tokens. verl logs the worker's peak as
    ``actor/perf/max_memory_allocated_gb`` and we add ``populora/<member>/actor/perf/...`` per adapter."""
    fig = Figures()
    phases: dict[str, list[float]] = {}
    tokens: list[float] = []
    mfu: list[float] = []
    trained: list[float] = []
    diff: list[float] = []
    rollout: dict[str, dict[str, list[float]]] = {}
    for step, data in rows:
        num = {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "timing_s/step" in num:
            fig.step_s[step] = num["timing_s/step"]
        mem = [v for k, v in num.items() if k.endswith("perf/max_memory_allocated_gb")]
        if mem:
            fig.peak_gb = max(fig.peak_gb or 0.0, *mem)
        if step <= warmup:
            continue
        for ph in PHASES:
            if f"timing_s/{ph}" in num:
                phases.setdefault(ph, []).append(num[f"timing_s/{ph}"])
        t = _step_gen_tokens(num)
        if t is not None:
            tokens.append(t)
        if "perf/mfu/actor" in num:
            mfu.append(num["perf/mfu/actor"])
        if "perf/total_num_tokens" in num:
            trained.append(num["perf/total_num_tokens"])
        for key in ("populora/all/training/rollout_probs_diff_mean", "training/rollout_probs_diff_mean"):
            if key in num:  # ours over every adapter's rows where we log it, else verl's
                diff.append(num[key])
                break
        for p in ROLLOUT_PHASES:
            for what in ("sequences", "prompt_tokens", "response_tokens"):
                v = num.get(f"populora/rollout/{p}/{what}")
                if v is not None:
                    rollout.setdefault(p, {}).setdefault(what, []).append(v)
    fig.phases_s = {ph: sum(v) / len(v) for ph, v in phases.items()}
    fig.gen_tokens = _mean(tokens)
    fig.mfu, fig.trained_tokens, fig.probs_diff = _mean(mfu), _mean(trained), _mean(diff)
    fig.rollout = {p: {w: sum(v) / len(v) for w, v in d.items()} for p, d in rollout.items()}
    return fig


def file_log_rows(text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(step, metrics)`` from verl's ``file`` logger (``{"step": n, "data": {...}}`` per line); a torn last line
    (a killed run) is skipped."""
    for line in text.splitlines():
        try:
            row = json.loads(line)
            yield int(row["step"]), dict(row["data"])
        except (ValueError, KeyError, TypeError):
            continue


def console_rows(text: str) -> Iterator[tuple[int, dict[str, float]]]:
    """``(step, metrics)`` from verl's console logger lines (possibly behind Ray's actor prefix)."""
    for line in text.splitlines():
        m = _STEP_LINE.search(line)
        if m:
            yield int(m.group(1)), {k: float(v) for k, v in _METRIC.findall(line)}


class GpuMemoryPoller:
    """``memory.used`` (MiB, summed over the visible GPUs: ``CUDA_VISIBLE_DEVICES`` where set) from ``nvidia-smi``,
    polled in a thread, with the time each step's metrics row first appears in the watched file (start-up ends at the
    first; windows split a schedule)."""

    def __init__(self, interval_s: float = 0.5, watch: Path | None = None) -> None:
        self.interval_s, self._stop = interval_s, threading.Event()
        self.watch, self._size = watch, 0
        self.samples: list[tuple[float, float]] = []
        self.row_t: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def peak(self) -> float:
        return max((m for _, m in self.samples), default=0.0)

    @property
    def first_row_t(self) -> float | None:
        return min(self.row_t.values()) if self.row_t else None

    @property
    def last_row_t(self) -> float | None:
        return max(self.row_t.values()) if self.row_t else None

    def peak_between(self, start: float, end: float) -> float | None:
        vals = [m for t, m in self.samples if start <= t <= end]
        return max(vals) if vals else None

    def _sample(self) -> float | None:
        # nvidia-smi ignores CUDA_VISIBLE_DEVICES: ask for this run's GPUs only (other runs may share the host)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        only = ["-i", visible] if re.fullmatch(r"\d+(,\d+)*", visible) else []
        try:
            out = subprocess.run(
                ["nvidia-smi", *only, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        vals = [float(x) for x in out.stdout.split() if x.strip().replace(".", "", 1).isdigit()]
        return sum(vals) if vals else None

    def _watch(self) -> None:
        try:
            size = self.watch.stat().st_size if self.watch is not None else 0
            if size <= self._size:
                return
            text = self.watch.read_text(errors="replace")
        except OSError:
            return
        now, self._size = time.time(), size
        for step, _ in file_log_rows(text):
            self.row_t.setdefault(step, now)

    def _run(self) -> None:
        while not self._stop.is_set():
            v = self._sample()
            if v is not None:
                self.samples.append((time.time(), v))
            self._watch()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> GpuMemoryPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
        self._watch()


def plan_overrides(profile: str | None, answer_tokens: int | None, force_length: bool) -> list[str]:
    """The hydra overrides every configuration of a run shares (besides the model and the configuration); with
    ``profile`` None, the recipe's own settings with only the seeding and the lengths changed."""
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known: {sorted(PROFILES)}")
    # The seeding phase runs once before step 1 (and after every schedule switch): not a per-step cost.
    out = [*PROFILES.get(profile, []), "populora.buffer.seed_programs=0"]
    # Ray's workers get the profile's environment from the runtime env too, not only by inheritance from the driver
    out += [f"++ray_kwargs.ray_init.runtime_env.env_vars.{k}={v}" for k, v in PROFILE_ENV.get(profile, {}).items()]
    if answer_tokens:
        out.append(f"data.max_response_length={int(answer_tokens)}")
    if force_length:
        out.append("actor_rollout_ref.rollout.ignore_eos=true")
    return out


def command(
    model: str, name: str, steps: int, out_dir: Path, extra: list[str], recipe: str = BENCH_RECIPE
) -> list[str]:
    return main_ppo_command(
        recipe,
        f"actor_rollout_ref.model.path={model}",
        "trainer.logger=[console,file]",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "populora.pbt.enabled=false",
        "populora.buffer.seed_programs=0",  # the seeding phase is a one-off before step 1, not a step cost
        f"trainer.default_local_dir={out_dir / name / 'ckpt'}",
        "++actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        *CONFIGS[name],
        *extra,
    )


def run_one(
    model: str, name: str, steps: int, out_dir: Path, extra: list[str], timeout_s: int, warmup: int = 1
) -> RunResult:
    metrics = out_dir / f"{name}.metrics.jsonl"
    metrics.unlink(missing_ok=True)  # a rerun must not read the previous run's rows
    env = trainer_env(VERL_FILE_LOGGER_PATH=str(metrics))
    log = out_dir / f"{name}.log"
    t0 = time.time()
    with GpuMemoryPoller(watch=metrics) as poller, open(log, "w") as f:
        proc = subprocess.Popen(
            command(model, name, steps, out_dir, extra),
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        rc = _wait(proc, timeout_s)
    end = time.time()
    fig = read_results(out_dir, name, warmup)
    r = RunResult.from_figures(
        name, fig, rc=rc, wall_s=end - t0, smi_peak_mib=poller.peak or None, warmup=warmup, model=model
    )
    first = fig.step_s.get(min(fig.step_s)) if fig.step_s else None
    if poller.first_row_t is not None and first is not None:
        r.startup_s = max(0.0, poller.first_row_t - t0 - first)
    if poller.last_row_t is not None:
        r.teardown_s = max(0.0, end - poller.last_row_t)
    return r


def population_of(name: str) -> dict[str, Any]:
    """``populora.population`` keys of a configuration (for a population schedule)."""
    if name == "single":
        return {"mode": "single_agent"}
    m = re.fullmatch(r"(\d+)t(\d+)s", name)
    if not m:
        raise ValueError(f"no population for configuration {name!r}")
    return {"mode": "population", "num_teachers": int(m.group(1)), "num_students": int(m.group(2))}


def schedule_command(model: str, names: Sequence[str], steps: int, out_dir: Path, extra: list[str]) -> list[str]:
    """One trainer process for all ``names`` (``trainer.populora_population_schedule``): the first configuration's
    command with the schedule added, the steps summed, and vLLM sized for the largest population."""
    sched = json.dumps(
        [{"name": n, "steps": steps, "population": population_of(n)} for n in names], separators=(",", ":")
    )
    cmd = command(model, names[0], steps * len(names), out_dir, [])
    cmd[cmd.index(f"trainer.default_local_dir={out_dir / names[0] / 'ckpt'}")] = (
        f"trainer.default_local_dir={out_dir / 'schedule' / 'ckpt'}"
    )
    engine = [x for n in names for x in CONFIGS[n] if "engine_kwargs" in x]
    return [*cmd, *dict.fromkeys(engine), f"++trainer.populora_population_schedule='{sched}'", *extra]


def split_schedule(
    rows: list[tuple[int, dict[str, Any]]],
    names: Sequence[str],
    steps: int,
    warmup: int,
    poller: GpuMemoryPoller | None,
    t0: float,
    model: str = "",
) -> list[RunResult]:
    """Per-configuration results of a schedule run from its metrics rows (global steps ``i*steps+1 ..``): steps
    renumbered from 1, the first configuration's start-up from the clock, later ones' switch time as their start-up,
    GPU peaks over each configuration's window."""
    out = []
    for i, name in enumerate(names):
        lo, hi = i * steps + 1, (i + 1) * steps
        mine = [(g - lo + 1, d) for g, d in rows if lo <= g <= hi]
        if not mine:
            continue
        fig = summarize(mine, warmup)
        complete = len(fig.step_s) == steps
        r = RunResult.from_figures(
            name,
            fig,
            rc=0 if complete else 1,
            wall_s=sum(fig.step_s.values()),
            smi_peak_mib=None,
            warmup=warmup,
            model=model,
        )
        first = dict(mine).get(1, {})
        if i == 0 and poller is not None and poller.row_t.get(lo) is not None and 1 in fig.step_s:
            r.startup_s = max(0.0, poller.row_t[lo] - t0 - fig.step_s[1])
        elif i > 0 and isinstance(first.get("timing_s/populora_switch"), (int, float)):
            r.startup_s = float(first["timing_s/populora_switch"])
        if poller is not None:
            start = poller.row_t.get(lo - 1, t0)
            end = poller.row_t.get(max(g for g, _ in rows if lo <= g <= hi), time.time())
            r.smi_peak_mib = poller.peak_between(start, end)
        out.append(r)
    return out


def run_schedule(
    model: str, names: Sequence[str], steps: int, out_dir: Path, extra: list[str], timeout_s: int, warmup: int = 1
) -> tuple[list[RunResult], int]:
    """All configurations in one trainer process; ``(per-configuration results, exit code)``."""
    metrics = out_dir / "schedule.metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = trainer_env(VERL_FILE_LOGGER_PATH=str(metrics))
    t0 = time.time()
    with GpuMemoryPoller(watch=metrics) as poller, open(out_dir / "schedule.log", "w") as f:
        proc = subprocess.Popen(
            schedule_command(model, names, steps, out_dir, extra),
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        rc = _wait(proc, timeout_s * len(names))
    rows = list(file_log_rows(metrics.read_text(errors="replace"))) if metrics.exists() else []
    results = split_schedule(rows, names, steps, warmup, poller, t0, model)
    if results and poller.last_row_t is not None:
        results[-1].teardown_s = max(0.0, time.time() - poller.last_row_t)
    return results, rc


def _wait(proc: subprocess.Popen, timeout_s: int) -> int:
    _CHILDREN.append(proc)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return 124
    finally:
        _CHILDREN.remove(proc)


_STOP = threading.Event()


def _on_sigterm(signum: int, frame: Any) -> None:
    # Stop after the running configuration: end it, then save what it logged (a schedule's finished entries too).
    _STOP.set()
    for proc in list(_CHILDREN):
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    # verl starts Ray, vLLM and worker processes under the trainer: end the whole session we started.
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    _ray_stop()


def _ray_stop() -> None:
    try:  # Ray's daemons can outlive a killed or finished trainer and hold GPU memory; the next run starts its own
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        pass


def read_results(out_dir: Path, name: str, warmup: int = 1) -> Figures:
    """A configuration's figures from its file-logger output, else from its console log."""
    for path, rows in ((out_dir / f"{name}.metrics.jsonl", file_log_rows), (out_dir / f"{name}.log", console_rows)):
        if path.exists():
            found = summarize(rows(path.read_text(errors="replace")), warmup)
            if found.step_s:
                return found
    return Figures()


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def report(results: list[RunResult]) -> str:
    """Markdown tables: step time and memory, phases, and generation against the vLLM ceiling."""
    base = next((r for r in results if r.name == "single" and r.mean_step_s), None)
    lines = [
        "| config | adapters | s/step (mean) | sd | min-max | n | x single | s/step/adapter | start-up s | "
        "warm-up step s | peak GPU MiB (nvidia-smi) | x single | trainer peak GiB (verl) | exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r.mean_step_s
        ratio = f"{s / base.mean_step_s:.2f}" if s and base else "-"
        mem_ratio = (
            f"{r.smi_peak_mib / base.smi_peak_mib:.2f}" if r.smi_peak_mib and base and base.smi_peak_mib else "-"
        )
        st = r.steady
        first = r.step_s.get(min(r.step_s)) if r.step_s else None
        lines.append(
            f"| {r.name} | {r.adapters} | {_fmt(s)} | {_fmt(r.std_step_s)} | "
            f"{f'{min(st):.1f}-{max(st):.1f}' if st else '-'} | {len(st)} | {ratio} | "
            f"{_fmt(s / r.adapters if s else None)} | {_fmt(r.startup_s, '.0f')} | {_fmt(first)} | "
            f"{_fmt(r.smi_peak_mib, '.0f')} | {mem_ratio} | {_fmt(r.verl_peak_gb, '.2f')} | {r.rc} |"
        )
    phase_rows = [r for r in results if r.phases_s]
    if phase_rows:
        cols = [ph for ph in PHASES if any(ph in r.phases_s for r in phase_rows)]
        lines += ["", "| config | " + " | ".join(f"{c} s" for c in cols) + " |", "|---|" + "---|" * len(cols)]
        lines += [
            f"| {r.name} | " + " | ".join(f"{r.phases_s[c]:.1f}" if c in r.phases_s else "-" for c in cols) + " |"
            for r in phase_rows
        ]
    train_rows = [r for r in results if r.trained_tokens or r.mfu is not None]
    if train_rows:
        lines += [
            "",
            "| config | trained tokens/step | trained tok/s | x single | actor MFU (verl) | "
            "rollout-vs-trainer prob diff |",
            "|---|---|---|---|---|---|",
        ]
        for r in train_rows:
            tput = (
                f"{r.trained_tok_s / base.trained_tok_s:.2f}"
                if r.trained_tok_s and base and base.trained_tok_s
                else "-"
            )
            lines.append(
                f"| {r.name} | {_fmt(r.trained_tokens, '.0f')} | {_fmt(r.trained_tok_s, '.0f')} | {tput} | "
                f"{_fmt(r.mfu, '.3f')} | {_fmt(r.probs_diff, '.4f')} |"
            )
    gen_rows = [r for r in results if r.gen_tokens]
    if gen_rows:
        lines += [
            "",
            "| config | teacher seqs | student seqs | tokens/step | rollout s | our gen tok/s | "
            "vLLM ceiling tok/s | fraction |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in gen_rows:
            seqs = [_fmt(r.rollout.get(p, {}).get("sequences"), ".0f") for p in ROLLOUT_PHASES]
            frac = r.gen_tok_s / r.ceiling_tok_s if r.gen_tok_s and r.ceiling_tok_s else None
            lines.append(
                f"| {r.name} | {seqs[0]} | {seqs[1]} | {r.gen_tokens:.0f} | {_fmt(r.gen_s)} | "
                f"{_fmt(r.gen_tok_s, '.0f')} | {_fmt(r.ceiling_tok_s, '.0f')} | {_fmt(frac, '.2f')} |"
            )
    return "\n".join(lines)


# --- ceiling -------------------------------------------------------------------------------------------------------


def ceiling_spec(results: Iterable[RunResult], answer_tokens: int | None, force_length: bool) -> dict[str, Any]:
    """What :mod:`populora_verl.bench.ceiling` must generate for each measured configuration: per rollout phase the
    request count, the mean prompt length and the answer length (``answer_tokens`` when lengths were forced, else
    the measured mean), and the adapters serving it."""
    out = {}
    for r in results:
        phases = []
        for p, loras in zip(ROLLOUT_PHASES, PHASE_ADAPTERS[r.name], strict=True):
            d = r.rollout.get(p) or {}
            n = int(round(d.get("sequences") or 0))
            if n < 1:
                continue
            answer = answer_tokens if force_length and answer_tokens else d.get("response_tokens", 0) / n
            phases.append(
                {
                    "phase": p,
                    "requests": n,
                    "prompt_tokens": max(1, round(d.get("prompt_tokens", n) / n)),
                    "answer_tokens": max(1, round(answer)),
                    "loras": loras,
                }
            )
            if r.name == "single":
                phases[-1]["first_lora"] = 0  # one adapter proposes and solves
        if phases:
            out[r.name] = {"adapters": r.adapters, "phases": phases}
    return out


def attach_ceiling(results: Iterable[RunResult], ceiling: Mapping[str, Any]) -> None:
    for r in results:
        c = (ceiling.get("configs") or {}).get(r.name) or {}
        if c.get("tok_s"):
            r.ceiling_tok_s = float(c["tok_s"])


def run_ceiling(
    model: str,
    out_dir: Path,
    results: list[RunResult],
    answer_tokens: int | None,
    force_length: bool,
    timeout_s: int,
    extra: Sequence[str] = (),
) -> int:
    spec = ceiling_spec([r for r in results if r.rc == 0], answer_tokens, force_length)
    if not spec:
        return 0
    (out_dir / "ceiling_spec.json").write_text(json.dumps(spec, indent=1))
    _ray_stop()  # vLLM checks free GPU memory at start: nothing of the trainer's cluster may linger
    cmd = [
        sys.executable,
        "-m",
        "populora_verl.bench.ceiling",
        "--model",
        model,
        "--spec",
        str(out_dir / "ceiling_spec.json"),
        "--out",
        str(out_dir / "ceiling.json"),
        *extra,
    ]
    with open(out_dir / "ceiling.log", "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        rc = _wait(proc, timeout_s)
    if (out_dir / "ceiling.json").exists():
        attach_ceiling(results, json.loads((out_dir / "ceiling.json").read_text()))
    return rc


# --- bookkeeping ---------------------------------------------------------------------------------------------------


def parse_models(
    specs: Sequence[str], default_configs: Sequence[str] = ()
) -> list[tuple[str, str, list[str], list[str]]]:
    """``TAG=PATH[:cfg,cfg[+cfg,cfg]]`` (or a bare path, tagged by its folder name) -> ``[(tag, path, configs,
    extras)]``. ``extras`` (after ``+``) are optional rows (e.g. 8T8S) run after every model's main rows and ceiling,
    so a run cut short has those; a model without its own list gets ``default_configs``; tags unique, names known."""
    out: list[tuple[str, str, list[str], list[str]]] = []
    for s in specs:
        tag, sep, rest = s.partition("=")
        if not sep:
            tag, rest = "", s
        path, _, cfgs = rest.partition(":")
        main_cfgs, _, extra_cfgs = cfgs.partition("+")
        tag = tag or Path(path).name or "model"
        names = [c.strip() for c in main_cfgs.split(",") if c.strip()] or list(default_configs)
        extras = [c.strip() for c in extra_cfgs.split(",") if c.strip()]
        if not path or not re.fullmatch(r"[\w.\-]+", tag):
            raise ValueError(f"--model {s!r}: expected TAG=PATH[:configs] with a tag of letters, digits, '.', '_', '-'")
        if tag in {t for t, *_ in out}:
            raise ValueError(f"--model tag {tag!r} given twice")
        unknown = [n for n in names + extras if n not in CONFIGS]
        if unknown or not names or len(set(names + extras)) != len(names + extras):
            raise ValueError(
                f"--model {s!r}: configurations {unknown or names + extras} not in {list(CONFIGS)} (or repeated)"
            )
        out.append((tag, path, names, extras))
    return out


def load_results(out: Path, keep: Iterable[str] = ()) -> list[RunResult]:
    """Earlier rows of ``out/results.json`` for configurations not being rerun (a config run again replaces its row),
    so configurations can be split over several invocations and still land in one table."""
    prev = out / "results.json"
    if not prev.exists():
        return []
    rerun = set(keep)
    rows = []
    for row in json.loads(prev.read_text()):
        if row.get("name") in rerun or row.get("name") not in CONFIGS:
            continue
        rows.append(RunResult.from_json(row))
    return rows


def save_results(out: Path, results: list[RunResult]) -> str:
    results.sort(key=lambda r: list(CONFIGS).index(r.name))
    (out / "results.json").write_text(json.dumps([r.to_json() for r in results], indent=1))
    table = report(results)
    (out / "results.md").write_text(table + "\n")
    return table


def status(root: Path) -> str:
    """One screen: the driver, the configuration in flight (steps logged so far), finished rows, recent errors."""
    p = read_progress(root)
    if p is None:
        return f"step_scaling: no run under {root} (no progress.json)"
    now = time.time()
    lines = [
        f"step_scaling driver pid {p.get('pid')} {'running' if alive(p.get('pid')) else 'not running'}; "
        f"state {p.get('state')}; started {now - p.get('started', now):.0f} s ago; "
        f"plan {p.get('plan')}; done {p.get('done', [])}"
    ]
    cur = p.get("current")
    if cur and p.get("state") == "running":
        mdir = root / cur["model"]
        rows = (
            list(file_log_rows((mdir / f"{cur['config']}.metrics.jsonl").read_text(errors="replace")))
            if (mdir / f"{cur['config']}.metrics.jsonl").exists()
            else []
        )
        steps = [round(float(d["timing_s/step"]), 1) for _, d in rows if "timing_s/step" in d]
        lines.append(
            f"now: {cur['model']}/{cur['config']} for {now - cur.get('since', now):.0f} s, "
            f"steps done {len(steps)}/{cur.get('steps')}: {steps}"
        )
        if cur.get("configs") and cur.get("steps"):
            per = int(cur["steps"]) // len(cur["configs"])
            lines.append(
                f"  schedule {cur['configs']}, {per} steps each: in "
                f"{cur['configs'][min(len(steps) // per, len(cur['configs']) - 1)]}"
            )
        log = mdir / f"{cur['config']}.log"
        if log.exists():
            errs = [ln for ln in log.read_text(errors="replace").splitlines() if _ERROR_LINE.search(ln)]
            lines += [f"  log: {e.strip()[:300]}" for e in errs[-3:]]
    for d in sorted(x for x in root.iterdir() if (x / "results.md").exists()):
        lines += ["", f"## {d.name}", (d / "results.md").read_text().rstrip()]
    return "\n".join(lines)


def failure_excerpt(log: Path, max_lines: int = 40) -> str:
    """Why a trainer exited: its last traceback (at most ``max_lines`` lines, each cut to 300 characters), or its
    last error lines when it printed none. A run's own log stays where it is; this goes into the driver's output,
    which is often the only part of a remote run that comes back."""
    if not log.exists():
        return f"  (no log at {log})"
    text = log.read_text(errors="replace").splitlines()
    starts = [i for i, ln in enumerate(text) if "Traceback (most recent call last)" in ln]
    picked = text[starts[-1] : starts[-1] + max_lines] if starts else [ln for ln in text if _ERROR_LINE.search(ln)][-5:]
    if not picked:
        picked = text[-5:]
    return "\n".join(f"  | {ln.rstrip()[:300]}" for ln in picked)


def _mark_done(root: Path, names: Iterable[str]) -> None:
    done = json.loads((root / "progress.json").read_text()).get("done", [])
    write_progress(root, done=done + list(names))


def _run_configs(
    args: argparse.Namespace,
    root: Path,
    tag: str,
    path: str,
    names: list[str],
    out: Path,
    results: list[RunResult],
    extra: list[str],
) -> tuple[list[RunResult], bool]:
    """``names`` of one model: in one trainer process (a population schedule) when asked and there are several,
    then whatever that did not finish one process each; every row saved as it lands."""
    ok, todo = True, list(names)
    if args.one_process and len(names) > 1 and not _STOP.is_set():
        write_progress(
            root,
            current={
                "model": tag,
                "config": "schedule",
                "since": time.time(),
                "steps": args.steps * len(names),
                "configs": names,
            },
        )
        print(f"step_scaling: {tag} {names} in one trainer process ({args.steps} steps each) ...", flush=True)
        got, rc = run_schedule(path, names, args.steps, out, extra, args.timeout_s, args.warmup)
        print(f"  exit={rc}; complete: {[r.name for r in got if r.rc == 0]}", flush=True)
        if rc != 0:
            print(failure_excerpt(out / "schedule.log"), flush=True)
        for r in got:
            results = [x for x in results if x.name != r.name] + [r]
        save_results(out, results)
        finished = [r.name for r in got if r.rc == 0]
        _mark_done(root, [f"{tag}/{n}" for n in finished])
        todo = [n for n in names if n not in finished]
    for name in todo:
        if _STOP.is_set():
            break
        write_progress(root, current={"model": tag, "config": name, "since": time.time(), "steps": args.steps})
        print(f"step_scaling: {tag}/{name} ({ADAPTERS[name]} adapters, {args.steps} steps) ...", flush=True)
        r = run_one(path, name, args.steps, out, extra, args.timeout_s, args.warmup)
        print(
            f"  exit={r.rc} wall={r.wall_s:.0f}s start-up={_fmt(r.startup_s, '.0f')}s steps={r.step_s} "
            f"peak={r.smi_peak_mib} MiB",
            flush=True,
        )
        if r.rc != 0:
            print(failure_excerpt(out / f"{name}.log"), flush=True)
        ok = ok and r.rc == 0
        results = [x for x in results if x.name != name] + [r]
        save_results(out, results)
        _mark_done(root, [f"{tag}/{name}"])
    return results, ok


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def profiler_overrides(steps: str, save_path: Path) -> list[str]:
    """verl's own torch profiler on the actor (rank 0) for the given trainer steps ('' = none).

    verl's trainer starts and stops it around those steps; every worker call of the step lands in one trace
    (``*.json.gz`` under ``save_path``), with verl's stage markers (``update_actor``, ``compute_log_prob``)."""
    if not steps.strip():
        return []
    try:
        nums = sorted({int(x) for x in steps.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--profile-steps must be comma-separated step numbers, got {steps!r}") from None
    if not nums or nums[0] < 1:
        raise ValueError(f"--profile-steps must be step numbers >= 1, got {steps!r}")
    return [
        "global_profiler.tool=torch",
        f"global_profiler.steps=[{','.join(map(str, nums))}]",
        f"global_profiler.save_path={save_path}",
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.ranks=[0]",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        action="append",
        default=[],
        help="TAG=PATH[:cfg,cfg[+cfg]] of an HF checkpoint, optionally with its own configurations; those "
        "after '+' are optional and run after every model's main rows and ceiling (repeatable; "
        "models run in the order given)",
    )
    ap.add_argument("--steps", type=int, default=6, help="steps per configuration (the first --warmup are excluded)")
    ap.add_argument("--warmup", type=int, default=1, help="leading steps left out of the means (kernel JIT etc.)")
    ap.add_argument(
        "--configs",
        default="single,4t4s,2t2s,1t1s",
        help=f"comma-separated, in run order, of {list(CONFIGS)} (for models without their own list)",
    )
    ap.add_argument("--profile", default="fast", choices=sorted(PROFILES))
    ap.add_argument("--answer-tokens", type=int, default=1024, help="data.max_response_length (0: the recipe's)")
    ap.add_argument(
        "--force-length",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every answer exactly --answer-tokens long (vLLM ignore_eos)",
    )
    ap.add_argument(
        "--ceiling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after each model's configurations, measure plain vLLM generate on the same work",
    )
    ap.add_argument(
        "--one-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a model's configurations in one trainer process (population schedule: start-up paid once); "
        "configurations it does not finish are rerun one process each",
    )
    ap.add_argument("--ceiling-models", default="", help="tags of the models to run the ceiling for (default: all)")
    ap.add_argument(
        "--out", default="bench_step_scaling", help="folder for logs and results (one sub-folder per model)"
    )
    ap.add_argument("--timeout-s", type=int, default=1200, help="per configuration")
    ap.add_argument(
        "--profile-steps",
        default="",
        help="comma-separated trainer steps to record with verl's torch profiler (rank 0 of the actor; "
        "in a schedule, configuration i's step k is i*--steps+k); traces go to OUT/profile, "
        "summarise them with python -m populora_verl.bench.trace_summary",
    )
    ap.add_argument("--status", action="store_true", help="print the progress of a run writing to --out, then exit")
    ap.add_argument("overrides", nargs="*", help="extra hydra overrides for every run")
    args = ap.parse_args(argv)
    root = Path(args.out).resolve()
    if args.status:
        print(status(root))
        return 0
    if not args.model:
        ap.error("--model TAG=PATH is required (repeatable)")
    try:
        default = [n.strip() for n in args.configs.split(",") if n.strip()]
        models = parse_models(args.model, default)
        extra = plan_overrides(args.profile, args.answer_tokens, args.force_length) + list(args.overrides)
        extra += profiler_overrides(args.profile_steps, root / "profile")
    except ValueError as e:
        ap.error(str(e))
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup (the warm-up steps are left out)")
    if not _has_cuda():
        print(
            "step_scaling: needs a CUDA GPU (verl's FSDP engine and vLLM do not run on CPU); nothing was run.",
            file=sys.stderr,
        )
        return 2
    root.mkdir(parents=True, exist_ok=True)
    profile_env = PROFILE_ENV.get(args.profile, {})
    os.environ.update(profile_env)  # the trainer processes inherit it
    signal.signal(signal.SIGTERM, _on_sigterm)
    plan = [f"{tag}/{n}" for tag, _, names, extras in models for n in names + extras]
    write_progress(
        root,
        pid=os.getpid(),
        state="running",
        started=time.time(),
        plan=plan,
        done=[],
        current=None,
        profile=args.profile,
        overrides=extra,
        env=profile_env,
    )
    ok, results_of = True, {}
    for tag, path, names, extras in models:
        out = root / tag
        out.mkdir(parents=True, exist_ok=True)
        results = load_results(out, keep=names + extras)
        results, ok_main = _run_configs(args, root, tag, path, names, out, results, extra)
        ok = ok and ok_main
        if args.ceiling and not _STOP.is_set() and (not args.ceiling_models or tag in args.ceiling_models.split(",")):
            write_progress(root, current={"model": tag, "config": "ceiling", "since": time.time(), "steps": 0})
            print(f"step_scaling: {tag} vLLM ceiling ...", flush=True)
            rc = run_ceiling(path, out, results, args.answer_tokens, args.force_length, args.timeout_s)
            print(f"  ceiling exit={rc}", flush=True)
            ok = ok and rc == 0
        results_of[tag] = results
        print(save_results(out, results), flush=True)
    # The optional configurations (after "+") last, once every model's main rows and ceiling have landed.
    for tag, path, _, extras in models:
        if extras and not _STOP.is_set():
            results, ok_extra = _run_configs(args, root, tag, path, extras, root / tag, results_of[tag], extra)
            ok = ok and ok_extra
            print(save_results(root / tag, results), flush=True)
    write_progress(root, state="stopped" if _STOP.is_set() else "finished", current=None)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
