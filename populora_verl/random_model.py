"""Random-weight models with a real model's exact shapes and tokenizer, and the command that runs a recipe on one.

Staging a 7B checkpoint on a node takes time and disk; whether the paper's setting fits that node's memory, how long
a step takes and how long start-up takes depend on the shapes, not on the weights. This module writes an HF folder
(safetensors) of a named architecture and size with random weights and the real tokenizer taken from a local folder
(no hub, no weights downloaded), then prints, or runs, the ``python -m verl.trainer.main_ppo`` line of a recipe on it
with every answer forced to a fixed length (vLLM ``ignore_eos``, as the step-scaling benchmark forces them), an
evolution event, and a few steps::

    python -m populora_verl.models random qwen2.5-coder-7b ~/models/random-7b \\
        --tokenizer-from ~/models/qwen-coder-1.5b --recipe 4t4s --gpus 4 [--run]

The weights are ``±0.5/sqrt(fan_in)`` with random signs (what the GPU plumbing model always used): activations stay
bounded, and two values per tensor compress about 16x. ``--init tiled`` repeats one random block through each tensor
instead: several times faster to write, and it compresses to almost nothing. Neither changes memory or step time
(dense kernels and forced lengths), and neither model proposes a valid task: rewards and evolution's choices mean
nothing here.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "ModelShape",
    "SHAPES",
    "PLUMBING",
    "plumbing_shape",
    "model_config",
    "parameter_count",
    "load_tokenizer",
    "available_cpus",
    "write_random_model",
    "dry_run_command",
    "shell_line",
    "add_random_parser",
    "run_random",
    "dry_run_summary",
    "run_memory_gb",
    "step_ratio",
]

PROG = "populora_verl.models"


@dataclass(frozen=True)
class ModelShape:
    """What a model's config.json says about its size: every value that changes memory or time."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int | None  # None: the tokenizer folder's (its config.json's vocab_size, else the tokenizer's length)
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rms_norm_eps: float = 1e-6
    model_type: str = "qwen2"


def plumbing_shape(heads: int = 2) -> ModelShape:
    """The GPU plumbing model (scripts/gpu/tiny_proof.sh): 2 layers, head_dim 64 for FlashAttention, ``heads``
    attention and KV heads so that TP up to ``heads`` can shard it; the tokenizer's own vocabulary size."""
    return ModelShape(
        hidden_size=64 * heads,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=128 * heads,
        vocab_size=None,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


PLUMBING = "qwen2-plumbing"
# The released config.json of each Qwen2.5-Coder size (base and Instruct share their shapes); the parameter counts
# they give (0.49, 1.54, 3.09, 7.62, 14.8, 32.8 B) are checked by the tests.
SHAPES: dict[str, ModelShape] = {
    "qwen2.5-coder-0.5b": ModelShape(896, 24, 14, 2, 4864, 151936, 1e6, 32768, True),
    "qwen2.5-coder-1.5b": ModelShape(1536, 28, 12, 2, 8960, 151936, 1e6, 32768, True),
    "qwen2.5-coder-3b": ModelShape(2048, 36, 16, 2, 11008, 151936, 1e6, 32768, True),
    "qwen2.5-coder-7b": ModelShape(3584, 28, 28, 4, 18944, 152064, 1e6, 32768, False),
    "qwen2.5-coder-14b": ModelShape(5120, 48, 40, 8, 13824, 152064, 1e6, 32768, False),
    "qwen2.5-coder-32b": ModelShape(5120, 64, 40, 8, 27648, 152064, 1e6, 32768, False),
    PLUMBING: plumbing_shape(2),
}
INITS = ("sign", "tiled")
_TILE = 1 << 16  # values in the block ``tiled`` repeats: large enough that no two rows of a layer line up
SHARD_BYTES = 4 << 30
#: written into config.json: marks the folder as random weights (and lets a second call reuse it)
MARKER = "populora_random_weights"


# --- the model ---------------------------------------------------------------------------------------------------


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a batch scheduler narrows), at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus)


def _usage(msg: str) -> Exception:
    from populora_verl.cli_errors import UsageError

    return UsageError(msg)


def load_tokenizer(folder: str | os.PathLike, flag: str = "--tokenizer-from") -> Any:
    """The tokenizer in ``folder``; a missing folder or tokenizer is one :class:`UsageError` naming ``flag``."""
    from transformers import AutoTokenizer

    d = Path(folder).expanduser()
    if not d.is_dir():
        raise _usage(f"{flag} {folder}: no such directory")
    if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
        raise _usage(
            f"{flag} {folder}: holds no tokenizer (no tokenizer.json or tokenizer_config.json); give the "
            "folder of a model of the same family, e.g. one `python -m populora_verl.models convert` wrote"
        )
    try:
        return AutoTokenizer.from_pretrained(str(d))
    except (OSError, ValueError) as e:
        raise _usage(f"{flag} {folder}: the tokenizer does not load ({' '.join(str(e).split())[:200]})") from None


def _vocab_size(shape: ModelShape, tokenizer: Any, tokenizer_dir: str | os.PathLike | None, flag: str) -> int:
    if shape.vocab_size is None:  # Qwen pads its embedding past len(tokenizer): keep the folder's padded size
        try:
            return int(json.loads((Path(tokenizer_dir) / "config.json").read_text())["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return len(tokenizer)
    if len(tokenizer) > shape.vocab_size:
        raise _usage(
            f"{flag} {tokenizer_dir}: its tokenizer has {len(tokenizer)} tokens, more than the model's "
            f"{shape.vocab_size} embeddings; give the tokenizer of this model family"
        )
    return shape.vocab_size


def model_config(
    shape: ModelShape, tokenizer: Any = None, *, vocab_size: int | None = None, dtype: str = "bfloat16"
) -> Any:
    """The transformers config of ``shape`` (token ids from ``tokenizer``), with its ``architectures`` set."""
    from transformers import AutoConfig

    fields = asdict(shape)
    model_type = fields.pop("model_type")
    fields["vocab_size"] = vocab_size or shape.vocab_size or len(tokenizer)
    ids = {} if tokenizer is None else {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = AutoConfig.for_model(model_type, **fields, **ids)
    config.dtype = dtype
    config.architectures = [type(_meta_model(config)).__name__]
    return config


def _meta_model(config: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: a 32B model costs no memory here
        return AutoModelForCausalLM.from_config(config)


def _parameters(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor the checkpoint holds, in the model's order; a tied LM head is not stored."""
    return [(n, tuple(p.shape)) for n, p in _meta_model(config).named_parameters()]  # shared parameters once


def parameter_count(shape: ModelShape, vocab_size: int | None = None) -> int:
    return sum(math.prod(s) for _, s in _parameters(model_config(shape, vocab_size=vocab_size or shape.vocab_size)))


def _fill(name: str, shape: tuple[int, ...], dtype: Any, init: str, seed: int) -> Any:
    """One tensor: norms 1 and biases 0 (transformers' own init), matrices ``±0.5/sqrt(fan_in)``."""
    import torch

    if len(shape) < 2:
        return (torch.ones if "norm" in name else torch.zeros)(shape, dtype=dtype)
    n, scale = math.prod(shape), 0.5 / math.sqrt(shape[-1])
    g = torch.Generator().manual_seed(seed)
    block = n if init == "sign" else min(n, _TILE)
    # Random bits, not Gaussians: half the cost, and 0 -> -s, 1 -> +s is exact in bf16 (2s is s doubled)
    values = torch.randint(0, 2, (block,), generator=g, dtype=torch.int8).to(dtype).mul_(2 * scale).sub_(scale)
    if block < n:
        values = values.repeat(-(-n // block))[:n]
    return values.view(shape)


def _shards(params: Sequence[tuple[str, tuple[int, ...]]], itemsize: int, limit: int) -> list[list[int]]:
    out: list[list[int]] = [[]]
    size = 0
    for i, (_, shape) in enumerate(params):
        nbytes = math.prod(shape) * itemsize
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


def _reusable(out: Path, stamp: dict[str, Any]) -> bool:
    """True when ``out`` already holds this very model; a folder that is not a random model is never replaced."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return False
    try:
        found = json.loads((out / "config.json").read_text()).get(MARKER)
    except (OSError, ValueError, AttributeError):
        found = None
    if found is None:
        raise _usage(
            f"out_dir {out}: exists and is not a random model this command wrote (it could be real weights); "
            "choose another folder"
        )
    return found == stamp


def write_random_model(
    shape: str | ModelShape,
    out_dir: str | os.PathLike,
    tokenizer_from: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    init: str = "sign",
    seed: int = 0,
    workers: int | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> tuple[Path, bool]:
    """Write ``shape`` (a :data:`SHAPES` name or a :class:`ModelShape`) with random weights and the tokenizer of
    ``tokenizer_from`` as an HF folder; ``(out_dir, True)`` if it was written, ``(out_dir, False)`` if ``out_dir``
    already held the same model. Tensors are made ``workers`` at a time and written shard by shard, so memory stays
    near one shard (4 GiB) whatever the size."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from populora_verl.fsutil import staged_dir, write_json

    name = shape if isinstance(shape, str) else "custom"
    if isinstance(shape, str):
        shape = SHAPES[shape]
    if init not in INITS:
        raise _usage(f"--init {init}: must be one of {list(INITS)}")
    out = Path(out_dir).expanduser()
    tokenizer = load_tokenizer(tokenizer_from)
    vocab = _vocab_size(shape, tokenizer, Path(tokenizer_from).expanduser(), "--tokenizer-from")
    stamp = {"shape": name, **asdict(replace(shape, vocab_size=vocab)), "init": init, "seed": seed, "dtype": dtype}
    if _reusable(out, stamp):
        return out, False
    config = model_config(shape, tokenizer, vocab_size=vocab, dtype=dtype)
    setattr(config, MARKER, stamp)
    params = _parameters(config)
    torch_dtype = getattr(torch, dtype)
    shards = _shards(params, torch_dtype.itemsize, shard_bytes)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    )
    with staged_dir(out) as tmp, ThreadPoolExecutor(workers or min(16, available_cpus())) as pool:
        for file, members in zip(files, shards):
            # one seed per tensor: the same weights whatever the thread count or order
            made = pool.map(lambda i: _fill(params[i][0], params[i][1], torch_dtype, init, seed * 100_003 + i), members)
            save_file({params[i][0]: t for i, t in zip(members, made)}, str(tmp / file), metadata={"format": "pt"})
        if len(files) > 1:
            total = sum(math.prod(s) for _, s in params) * torch_dtype.itemsize
            write_json(
                tmp / "model.safetensors.index.json",
                {
                    "metadata": {"total_size": total},
                    "weight_map": {params[i][0]: f for f, members in zip(files, shards) for i in members},
                },
            )
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        generation = Path(tokenizer_from).expanduser() / "generation_config.json"
        if generation.is_file():  # vLLM reads its sampling defaults from it, as it will from the real model
            shutil.copy(generation, tmp / "generation_config.json")
    return out, True


# --- the command that runs a recipe on it ------------------------------------------------------------------------


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def dry_run_command(
    model_dir: str | os.PathLike,
    recipe: str = "4t4s",
    *,
    gpus: int | None = None,
    steps: int = 5,
    answer_tokens: int = 1024,
    force_length: bool = True,
    run_dir: str | os.PathLike | None = None,
    profile: str | None = None,
    evolve_every: int = 2,
    overrides: Sequence[str] = (),
    python: str = "python",
) -> list[str]:
    """The trainer's command line: ``recipe`` on ``model_dir`` for ``steps`` steps with answers of exactly
    ``answer_tokens`` tokens (step_scaling's ``plan_overrides``: no seeding phase, ``ignore_eos``), evolution every
    ``evolve_every`` steps from the first interval on (0: the recipe's schedule), no checkpoints. ``overrides``
    come last and replace any of these with the same key."""
    from populora_verl.bench.step_scaling import plan_overrides
    from populora_verl.recipes import recipes_dir

    run_dir = run_dir or f"runs/dry-run-{recipe}"
    ours = [
        f"actor_rollout_ref.model.path={Path(model_dir).expanduser().resolve()}",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
    ]
    if gpus:
        ours.append(f"trainer.n_gpus_per_node={gpus}")
    if evolve_every:
        # min_age 0: the recipes protect newborns for 20 steps, which would push the first event past a short run
        ours += [f"populora.pbt.interval_steps={evolve_every}", "populora.pbt.min_age=0"]
    ours += plan_overrides(profile, answer_tokens, force_length)
    theirs = {_key(o) for o in overrides}
    return [
        python,
        "-m",
        "verl.trainer.main_ppo",
        "--config-path",
        str(recipes_dir()),
        "--config-name",
        recipe,
        *(o for o in ours if _key(o) not in theirs),
        *overrides,
    ]


#: Above this many parameters, training without gradient checkpointing is not known to fit one GPU: at 7B shapes with
#: 16,384 tokens per micro-batch it ran out of memory on a 141 GB H200 in the first update (docs/multi-gpu.md).
CHECKPOINTING_OFF_LIMIT = 2_000_000_000
_CHECKPOINTING = "actor_rollout_ref.model.enable_gradient_checkpointing"


def checkpointing_note(shape: ModelShape, cmd: Sequence[str]) -> str | None:
    """A warning line where ``cmd`` trains a model larger than 1.5B with gradient checkpointing off (a step-scaling
    profile's setting), else None."""
    last = [o.split("=", 1)[1].strip().lower() for o in cmd if _key(o) == _CHECKPOINTING]
    # the plumbing shape takes its vocabulary from the tokenizer: the body decides, the embeddings barely move it
    if (
        not last
        or last[-1] not in ("false", "0")
        or parameter_count(shape, shape.vocab_size or 1) <= CHECKPOINTING_OFF_LIMIT
    ):
        return None
    return (
        f"note: gradient checkpointing is off ({_CHECKPOINTING}=false); above 1.5B that is not known to fit, and at "
        f"7B shapes it ran out of memory in the first update on one 141 GB GPU; add {_CHECKPOINTING}=true to keep it on"
    )


def shell_line(cmd: Sequence[str]) -> str:
    """``cmd`` as one line to paste into a shell, with the environment the trainer needs on a GPU node."""
    from populora_verl.bench.step_scaling import TRAINER_ENV

    return " ".join([*(f"{k}={v}" for k, v in TRAINER_ENV.items()), shlex.join(cmd)])


def check_command(cmd: Sequence[str]) -> None:
    """Compose ``cmd``'s recipe and overrides as the trainer will and run the checks on the verl and populora keys,
    so that a mistyped override fails in one line before minutes of writing weights."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from populora_verl.cli_errors import one_line
    from populora_verl.config import load_config
    from populora_verl.trainer.verl_config import validate_verl_config

    i = list(cmd).index("--config-path")
    config_dir, recipe, overrides = cmd[i + 1], cmd[i + 3], list(cmd[i + 4 :])
    if not (Path(config_dir) / f"{recipe}.yaml").is_file():
        names = sorted(p.stem for p in Path(config_dir).glob("*.yaml"))
        raise _usage(f"--recipe {recipe}: no such recipe; known: {names}")
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name=recipe, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise _usage(f"--recipe {recipe} with the overrides: {one_line(e)}") from None
    validate_verl_config(cfg, load_config(cfg.populora))


# --- what the run printed ---------------------------------------------------------------------------------------

#: Phases of a step worth a column: verl's timing keys under ``timing_s/``, and the evolution event's.
_SUMMARY_PHASES = (
    ("gen", "generation"),
    ("old_log_prob", "old log-probs"),
    ("update_actor", "update"),
    ("update_weights", "weight sync"),
    ("populora_evolve", "evolution"),
)
#: Host memory is compared from this step on: the first steps fill caches, buffers and the bank's pinned copies.
HOST_MEMORY_FROM_STEP = 5


#: What the dry run prints after each step's console line: the memory of the run's own processes at that moment.
_RUN_MEMORY_LINE = "[populora] dry run: step {step}, the run's processes hold {gb:.2f} GB ({n} processes, PSS)"
_RUN_MEMORY = re.compile(r"\[populora\] dry run: step (\d+), the run's processes hold ([0-9.]+) GB")
_STEP = re.compile(r"\bstep:(\d+) - ")


def run_memory_gb(pid: int) -> tuple[float, int] | None:
    """The memory held by process ``pid`` and every process below it, in GB, and how many processes: their
    proportional set sizes summed (a page shared by k of them counts 1/k to each, so the sum counts it once). A
    trainer's Ray cluster, its workers and vLLM's engines all start below the trainer's process, so this is the
    run's own memory, which other jobs on the node do not move (verl's ``cpu_memory_used_gb`` is the machine's).
    None once ``pid`` is gone."""
    import psutil  # a dependency of ray, always present with verl

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total, n = 0, 0
    for proc in procs:
        try:
            try:
                info = proc.memory_full_info()
            except psutil.AccessDenied:
                info = proc.memory_info()  # no PSS without access to its smaps: its resident size instead
        except psutil.Error:
            continue  # ended between the listing and either read
        total += getattr(info, "pss", info.rss)
        n += 1
    return total / 2**30, n


def _key_max(metrics: Mapping[str, float], suffix: str) -> float | None:
    """The largest value among the keys ending in ``suffix`` (verl's own and each slot's ``populora/<slot>/...``):
    host memory is sampled machine-wide at each slot's update, so the step's largest sample is its peak."""
    vals = [v for k, v in metrics.items() if k == suffix or k.endswith("/" + suffix)]
    return max(vals) if vals else None


def _slope_per_step(points: Sequence[tuple[int, float]]) -> float | None:
    """Least-squares growth per step (None under 2 steps): one step's noise moves it less than last minus first."""
    import statistics

    if len(points) < 2:
        return None
    xs, ys = zip(*points)
    return statistics.linear_regression(xs, ys).slope


def _steady(rows: Mapping[int, Mapping[str, float]]) -> list[float]:
    """Step times after step 1 without an evolution event: what a run pays per step once started."""
    return [
        m["timing_s/step"]
        for step, m in sorted(rows.items())
        if step > 1 and "timing_s/step" in m and not m.get("populora/evolution/events", 0) > 0
    ]


def step_ratio(text: str, against_text: str) -> tuple[float, float, float] | None:
    """(ratio, steady step, the other run's steady step): the medians of two dry runs' steady steps, from their
    console output; None where either has no steady step."""
    import statistics

    from populora_verl.bench.step_scaling import console_rows

    a, b = _steady(dict(console_rows(text))), _steady(dict(console_rows(against_text)))
    if not a or not b:
        return None
    ma, mb = statistics.median(a), statistics.median(b)
    return ma / mb, ma, mb


def dry_run_summary(text: str) -> str:
    """What a dry run measured, from the trainer's console output: the start-up line, a row per step (its phases,
    the trainer's peak GPU memory, the host's memory used), the steady step, each evolution event and host memory's
    growth per 10 steps after the first steps."""
    import statistics

    from populora_verl.bench.step_scaling import console_rows

    rows = dict(console_rows(text))  # a step printed twice (a resumed run) keeps its last row
    startup = [ln.split("[populora] ", 1)[1].strip() for ln in text.splitlines() if "[populora] start-up:" in ln]
    out = [startup[-1] if startup else "start-up: no line (the run stopped before step 1 ended)"]
    if not rows:
        return "\n".join([*out, "no step finished"])
    own = {int(m.group(1)): float(m.group(2)) for m in map(_RUN_MEMORY.search, text.splitlines()) if m}
    head = ["step", "step s", *(name for _, name in _SUMMARY_PHASES), "trainer peak GB", "host used GB"]
    if own:
        head.append("run's own GB")
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    host: list[tuple[int, float]] = []
    steady = _steady(rows)
    events: list[float] = []
    for step in sorted(rows):
        m = rows[step]
        evolved = m.get("populora/evolution/events", 0) > 0
        cells = [str(step), _fmt(m.get("timing_s/step"))]
        cells += [_fmt(m.get(f"timing_s/{key}")) for key, _ in _SUMMARY_PHASES]
        peak, used = _key_max(m, "actor/perf/max_memory_allocated_gb"), _key_max(m, "actor/perf/cpu_memory_used_gb")
        cells += [_fmt(peak), _fmt(used)]
        if own:
            cells.append(_fmt(own.get(step)))
        out.append("| " + " | ".join(cells) + " |")
        if used is not None:
            host.append((step, used))
        if evolved and "timing_s/populora_evolve" in m:
            events.append(m["timing_s/populora_evolve"])
    if steady:
        out.append(
            f"steady step (after step 1, without evolution): median {statistics.median(steady):.1f} s "
            f"({min(steady):.1f}-{max(steady):.1f}, {len(steady)} steps)"
        )
    if events:
        out.append(
            f"evolution: {len(events)} events, median {statistics.median(events):.2f} s, max {max(events):.2f} s"
        )
    out.append(_growth("host memory", host))
    if own:
        out.append(_growth("the run's own memory", [(s, gb) for s, gb in sorted(own.items()) if s in rows]))
    return "\n".join(out)


def _growth(what: str, points: Sequence[tuple[int, float]]) -> str:
    """``what``'s growth per 10 steps from :data:`HOST_MEMORY_FROM_STEP` on, by least squares."""
    points = [(s, gb) for s, gb in points if s >= HOST_MEMORY_FROM_STEP]
    slope = _slope_per_step(points)
    if slope is None:
        return f"{what}: growth needs 2 steps from step {HOST_MEMORY_FROM_STEP} on"
    return (
        f"{what} from step {points[0][0]} to {points[-1][0]}: {points[0][1]:.1f} -> {points[-1][1]:.1f} GB, "
        f"{10 * slope:+.2f} GB per 10 steps (least squares over {len(points)} steps)"
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}" if x < 10 else f"{x:.1f}"


def _run_and_summarise(cmd: Sequence[str], env: Mapping[str, str], last_step: int) -> tuple[int, str]:
    """Run the trainer with its output passed through, then print :func:`dry_run_summary` of what it printed (also
    after Ctrl-C or a failed step: the steps that ran are still measured). After each step's line but the last the
    run's own memory is printed too: the last step's line comes as the trainer starts to shut its processes down."""
    import subprocess

    kept: list[str] = []  # only the lines the summary reads: a long run prints a lot
    proc = subprocess.Popen(
        list(cmd), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    assert proc.stdout is not None
    interrupts = 0
    while True:
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                if "step:" in line or "[populora] start-up:" in line:
                    kept.append(line)
                step = _STEP.search(line)
                own = run_memory_gb(proc.pid) if step and int(step.group(1)) < last_step else None
                if own is not None:
                    # at the step's console line, so that a saved log holds it too (the summary reads it back)
                    kept.append(_RUN_MEMORY_LINE.format(step=step.group(1), gb=own[0], n=own[1]) + "\n")
                    sys.stdout.write(kept[-1])
            break
        except KeyboardInterrupt:
            # the trainer, in our process group, got the same signal: pass its shutdown through; a second one ends it
            interrupts += 1
            if interrupts > 1:
                proc.kill()
    rc = proc.wait()
    print(f"\n[populora] dry run, exit code {rc}:\n" + dry_run_summary("".join(kept)), flush=True)
    return rc, "".join(kept)


# --- the command line ------------------------------------------------------------------------------------------


def add_random_parser(sub: Any) -> Any:
    r = sub.add_parser(
        "random",
        help="a random-weight model of a named shape with a real tokenizer, and the trainer command that "
        "runs a recipe on it with forced answer lengths (check a node before staging weights)",
        description="Write a random-weight model of a named shape (the real tokenizer, no weights downloaded) and "
        "print the trainer command that runs a recipe on it with every answer forced to a fixed length; "
        "--run runs it.",
    )
    r.add_argument("shape", choices=sorted(SHAPES), help="the architecture and size")
    r.add_argument("out_dir", help="the model folder to write (an existing random model of the same shape is reused)")
    r.add_argument(
        "--tokenizer-from",
        required=True,
        metavar="DIR",
        help="a local folder with the model family's tokenizer (e.g. a converted offline checkpoint)",
    )
    r.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="of the weights (default: %(default)s)",
    )
    r.add_argument(
        "--init",
        default="sign",
        choices=INITS,
        help="sign: random ±0.5/sqrt(fan_in) per weight; tiled: one random block repeated, several times "
        "faster to write and to compress (default: %(default)s)",
    )
    r.add_argument(
        "--workers", type=int, default=None, help="threads that make tensors (default: this machine's CPUs, at most 16)"
    )
    r.add_argument("--recipe", default="4t4s", help="the recipe to run (default: %(default)s)")
    r.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="trainer.n_gpus_per_node (default: the GPUs visible here, else the recipe's)",
    )
    r.add_argument("--steps", type=int, default=5, help="trainer steps (default: %(default)s)")
    r.add_argument(
        "--answer-tokens",
        type=int,
        default=1024,
        help="every answer exactly this long (data.max_response_length; default: %(default)s)",
    )
    r.add_argument(
        "--evolve-every",
        type=int,
        default=2,
        help="evolution every N steps, newborns unprotected (0: the recipe's schedule; default: %(default)s)",
    )
    r.add_argument(
        "--profile",
        default=None,
        help="a step-scaling profile's settings on top of the recipe "
        "(populora_verl.bench.step_scaling PROFILES; default: none)",
    )
    r.add_argument("--run-dir", default=None, help="trainer.default_local_dir (default: runs/dry-run-RECIPE)")
    r.add_argument(
        "--against",
        default=None,
        metavar="RECIPE",
        help="after the run, RECIPE on the same model with the same settings and overrides (e.g. azr_single_agent), "
        "then the ratio of the two runs' steady steps",
    )
    r.add_argument(
        "--against-steps", type=int, default=None, help="trainer steps of the --against run (default: --steps)"
    )
    r.add_argument("--run", action="store_true", help="run the command after writing the model")
    r.add_argument("overrides", nargs="*", help="more hydra overrides for the trainer (key=value), last")
    return r


def _visible_gpus() -> int | None:
    import torch

    return torch.cuda.device_count() or None


def run_random(args: Any) -> int:
    """``python -m populora_verl.models random``: checks every flag before any weight is made."""
    from populora_verl.bench.step_scaling import PROFILE_ENV, PROFILES, TRAINER_ENV
    from populora_verl.cli_errors import check_output_dir

    for flag, value, low in (
        ("--steps", args.steps, 1),
        ("--answer-tokens", args.answer_tokens, 1),
        ("--evolve-every", args.evolve_every, 0),
        ("--gpus", args.gpus, 1),
        ("--workers", args.workers, 1),
        ("--against-steps", args.against_steps, 2),
    ):
        if value is not None and value < low:
            raise _usage(f"{flag} {value}: must be at least {low}")
    if args.profile is not None and args.profile not in PROFILES:
        raise _usage(f"--profile {args.profile}: unknown; known: {sorted(PROFILES)}")
    check_output_dir(args.out_dir, "out_dir")
    load_tokenizer(args.tokenizer_from)  # before the composition below: the cheaper mistake first
    gpus = args.gpus or _visible_gpus()
    # what both runs share where --against adds a second: the model, GPUs, lengths, profile and the user's overrides
    command = functools.partial(
        dry_run_command,
        args.out_dir,
        gpus=gpus,
        answer_tokens=args.answer_tokens,
        profile=args.profile,
        overrides=args.overrides,
    )
    cmd = command(args.recipe, steps=args.steps, run_dir=args.run_dir, evolve_every=args.evolve_every)
    check_command(cmd)
    against_steps = args.against_steps or args.steps
    against = None
    if args.against:
        if args.steps < 2:  # step 1 is start-up's: a ratio needs a steady step on both sides
            raise _usage(f"--steps {args.steps}: the ratio with --against needs at least 2")
        # the recipe's own evolution schedule: a baseline such as the single agent has none
        run_dir = f"{args.run_dir}-{args.against}" if args.run_dir else None
        against = command(args.against, steps=against_steps, run_dir=run_dir, evolve_every=0)
        check_command(against)
    note = checkpointing_note(SHAPES[args.shape], cmd)
    if note:
        print(note, file=sys.stderr)
    t0 = time.perf_counter()
    out, written = write_random_model(
        args.shape, args.out_dir, args.tokenizer_from, dtype=args.dtype, init=args.init, workers=args.workers
    )
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    what = f"wrote in {time.perf_counter() - t0:.0f} s" if written else "reused (already there)"
    amount = f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"
    print(f"{args.shape}: random weights, {amount} of {args.dtype} safetensors, {what}: {out}")
    evolution = f", evolution every {args.evolve_every} steps" if args.evolve_every else ""
    print(
        f"{args.recipe} on it, {args.steps} steps, answers forced to {args.answer_tokens} tokens{evolution}, no "
        "checkpoints; read the '[populora] start-up:' line after step 1, and per step timing_s/step, "
        "actor/perf/max_memory_allocated_gb and actor/perf/cpu_memory_used_gb:"
    )
    print(shell_line(cmd))
    if not args.run:
        return 0
    sys.stdout.flush()
    # the profile's variables reach Ray's workers through the runtime env too; the driver's own processes inherit these
    env = {**os.environ, **TRAINER_ENV, **PROFILE_ENV.get(args.profile, {})}
    rc, text = _run_and_summarise([sys.executable, *cmd[1:]], env, last_step=args.steps)
    if against is None:
        return rc
    if rc != 0:
        print(f"[populora] dry run: {args.against} not run: the {args.recipe} run ended with exit code {rc}")
        return rc
    print(f"\n[populora] dry run: {args.against} on the same model and settings, {against_steps} steps:")
    print(shell_line(against), flush=True)
    rc, against_text = _run_and_summarise([sys.executable, *against[1:]], env, last_step=against_steps)
    ratio = step_ratio(text, against_text)
    if ratio is None:
        print(f"[populora] dry run: step ratio {args.recipe} / {args.against}: a run has no steady step")
    else:
        print(
            f"[populora] dry run: step ratio {args.recipe} / {args.against}: {ratio[0]:.2f}x "
            f"(steady step medians {ratio[1]:.1f} s / {ratio[2]:.1f} s)",
            flush=True,
        )
    return rc
