"""PopuLoRA configuration: one schema for the CPU driver and the verl recipes (the ``populora.*`` keys).

Every section is a plain dataclass whose ``__post_init__`` validates its own values. Errors are raised as
:class:`ConfigError` with a single line that names the full dotted key (``populora.pbt.cull_fraction``), so a
mistake in a recipe fails at start-up instead of twenty minutes into a run.

Build from a mapping (dict / OmegaConf ``DictConfig``) with :func:`load_config`; unknown keys are errors too.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = [
    "ConfigError",
    "PopulationConfig",
    "MatchmakingConfig",
    "RolloutConfig",
    "TasksConfig",
    "BufferConfig",
    "ExecutorConfig",
    "RewardsConfig",
    "AdvantageConfig",
    "PBTConfig",
    "DiagnosticsConfig",
    "PopuLoRAConfig",
    "load_config",
    "to_dict",
]

ROOT = "populora"
TASK_TYPES = ("code_i", "code_o", "code_f")
#: The kinds of LoRA weight-space operators (``populora.pbt.operators`` weights, the operator registry).
OPERATOR_KINDS = ("mutation", "crossover")
# AZR's banned-module list (AZR code, printed into the proposer prompt and enforced by an AST walk).
AZR_BANNED_MODULES = (
    "logging",
    "random",
    "multiprocessing",
    "pebble",
    "subprocess",
    "threading",
    "datetime",
    "time",
    "hashlib",
    "hmac",
    "bcrypt",
    "os.sys",
    "os.path",
    "sys.exit",
    "os.environ",
    "calendar",
)


class ConfigError(ValueError):
    """A configuration value is invalid. The message is one line and names the dotted key."""


def _fail(key: str, msg: str) -> typing.NoReturn:
    raise ConfigError(f"{key}: {msg}")


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        _fail(key, msg)


def _choice(value: Any, choices: typing.Iterable[str], key: str) -> None:
    choices = tuple(choices)
    _check(value in choices, key, f"must be one of {list(choices)}, got {value!r}")


# --- sections ------------------------------------------------------------------------------------------------


@dataclass
class PopulationConfig:
    """Who is in the population. ``mode=single_agent`` is the AZR baseline: one adapter in both roles."""

    mode: str = "population"  # population | single_agent
    num_teachers: int = 4
    num_students: int = 4
    seed: int = 0
    # shared_a: every founder starts from one lora_A draw (B = 0), so factor-space crossovers mix adapters that
    # share a gauge from the first event on, as PBT children do; independent: one lora_A draw per founder.
    founder_init: str = "shared_a"
    # resident: every slot lives in the model, one forward and backward per micro-batch train them all, one weight
    # transfer serves them (docs/resident-adapters.md); it needs packed rows. bank: one live adapter in the trainer,
    # each slot swapped in for its own forward, backward, optimizer step and weight sync (padded rows too). Either
    # reads the other's checkpoints. Resident is the default: on one GPU it was 0.85x the bank's 4T4S step and 0.81x
    # its 8T8S step, the same for the single agent (BENCHMARKS.md section 5).
    adapter_layout: str = "resident"
    _prefix: str = field(default=f"{ROOT}.population", repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self._prefix
        _choice(self.mode, ("population", "single_agent"), f"{p}.mode")
        _choice(self.founder_init, ("shared_a", "independent"), f"{p}.founder_init")
        _choice(self.adapter_layout, ("bank", "resident"), f"{p}.adapter_layout")
        if self.mode == "population":
            _check(
                isinstance(self.num_teachers, int) and self.num_teachers >= 1,
                f"{p}.num_teachers",
                f"must be an integer >= 1, got {self.num_teachers!r}",
            )
            _check(
                isinstance(self.num_students, int) and self.num_students >= 1,
                f"{p}.num_students",
                f"must be an integer >= 1, got {self.num_students!r}",
            )

    @property
    def num_adapters(self) -> int:
        return 1 if self.mode == "single_agent" else self.num_teachers + self.num_students


@dataclass
class MatchmakingConfig:
    """TrueSkill ratings + PFSP pairing (defaults: the ``trueskill`` package's environment)."""

    method: str = "pfsp_trueskill"  # pfsp_trueskill | uniform | round_robin
    weight: str = "p_one_minus_p"  # p_one_minus_p | hard (1-p: favour students that lose) | uniform
    outcome: str = "learnable"  # learnable | vs_expected | vs_half | per_problem (population.ratings)
    students_per_problem: int = 1
    mu: float = 25.0
    sigma: float = 25.0 / 3
    beta: float = 25.0 / 6
    tau: float = 25.0 / 300
    draw_probability: float = 0.1
    _prefix: str = field(default=f"{ROOT}.matchmaking", repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self._prefix
        _choice(self.method, ("pfsp_trueskill", "uniform", "round_robin"), f"{p}.method")
        _choice(self.weight, ("p_one_minus_p", "hard", "uniform"), f"{p}.weight")
        _choice(self.outcome, ("learnable", "vs_expected", "vs_half", "per_problem"), f"{p}.outcome")
        _check(self.students_per_problem >= 1, f"{p}.students_per_problem", "must be >= 1")
        for k in ("sigma", "beta"):
            _check(getattr(self, k) > 0, f"{p}.{k}", f"must be > 0, got {getattr(self, k)!r}")
        _check(self.tau >= 0, f"{p}.tau", "must be >= 0")
        _check(0 <= self.draw_probability < 1, f"{p}.draw_probability", "must be in [0, 1)")


@dataclass
class RolloutConfig:
    """How many samples each role draws per step, and the vLLM multi-LoRA capacity."""

    teacher_n: int = 1  # proposals per (teacher, task type) prompt
    student_n: int = 8  # answers per (student, task): the solve-rate estimate s̄
    proposals_per_type: int = 4  # teacher prompts per task type per teacher per step
    max_loras: int | None = None  # None: population size
    max_cpu_loras: int | None = None  # None: 2 x population size
    buffer_task_n: int | None = None  # answers per buffer task a student trains on (AZR: 1); None: student_n
    # null: the engine's own (CPU driver: 1024 / 1.0; verl: actor_rollout_ref.rollout.response_length /
    # .temperature). Set on a verl run, each must equal verl's value: the verl rollout never reads these.
    max_new_tokens: int | None = None
    temperature: float | None = None
    _prefix: str = field(default=f"{ROOT}.rollout", repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self._prefix
        for k in ("teacher_n", "student_n", "proposals_per_type"):
            v = getattr(self, k)
            _check(isinstance(v, int) and v >= 1, f"{p}.{k}", f"must be an integer >= 1, got {v!r}")
        _check(
            self.buffer_task_n is None or (isinstance(self.buffer_task_n, int) and self.buffer_task_n >= 1),
            f"{p}.buffer_task_n",
            f"must be null or an integer >= 1, got {self.buffer_task_n!r}",
        )
        for k in ("max_loras", "max_cpu_loras", "max_new_tokens"):
            v = getattr(self, k)
            _check(v is None or (isinstance(v, int) and v >= 1), f"{p}.{k}", f"must be null or >= 1, got {v!r}")
        _check(self.temperature is None or self.temperature >= 0, f"{p}.temperature", "must be null or >= 0")


@dataclass
class TasksConfig:
    """AZR task types and their prompt parameters."""

    types: list[str] = field(default_factory=lambda: list(TASK_TYPES))
    probabilities: list[float] | None = None  # None: uniform over ``types``
    num_references: int = 6  # K reference triplets in code_i / code_o proposer prompts
    num_inputs: int = 10  # code_f: inputs a teacher proposes; half shown to the student, half hidden
    min_valid_inputs: int = 2  # code_f, lenient rule only: fewest distinct valid inputs for a usable task
    # code_f validity. azr: the last num_inputs input blocks are used, fewer is a format error and any input that
    # fails to run makes the proposal invalid (AZR). lenient: the first <= num_inputs, failing and duplicate inputs
    # dropped, at least min_valid_inputs kept.
    code_f_rule: str = "azr"
    # AZR judges the envelope and the program apart: a valid program under a failed <think>/<answer> envelope is
    # still a task for students, and the teacher still gets rewards.format_error. false: no task without the envelope.
    keep_unformatted_tasks: bool = True
    max_program_chars: int = 5600
    max_response_chars: int = 65_536  # longer model responses are format errors, never parsed
    banned_keywords: list[str] = field(default_factory=lambda: list(AZR_BANNED_MODULES))
    prompt_template: str = "azr"  # azr (plain "User:/Assistant: <think>") | chat (tokenizer chat template)
    prompt_file: str | None = None  # YAML/JSON {template name: format string}; None: our default wording
    _prefix: str = field(default=f"{ROOT}.tasks", repr=False, compare=False)
    _templates: dict[str, str] | None = field(default=None, repr=False, compare=False)

    @property
    def templates(self) -> dict[str, str]:
        """The prompt templates in force (:mod:`populora_verl.tasks.templates`)."""
        if self._templates is None:
            from populora_verl.tasks.templates import DEFAULT_TEMPLATES

            return DEFAULT_TEMPLATES
        return self._templates

    def __post_init__(self) -> None:
        p = self._prefix
        _check(len(self.types) >= 1, f"{p}.types", "must list at least one task type")
        for t in self.types:
            _choice(t, TASK_TYPES, f"{p}.types")
        _check(len(set(self.types)) == len(self.types), f"{p}.types", "has duplicates")
        if self.probabilities is not None:
            _check(
                len(self.probabilities) == len(self.types),
                f"{p}.probabilities",
                f"needs one value per type ({len(self.types)}), got {len(self.probabilities)}",
            )
            _check(
                all(x >= 0 for x in self.probabilities) and sum(self.probabilities) > 0,
                f"{p}.probabilities",
                "must be non-negative with a positive sum",
            )
        _check(self.num_references >= 0, f"{p}.num_references", "must be >= 0")
        _check(self.num_inputs >= 2, f"{p}.num_inputs", "must be >= 2 (half are shown, half hidden)")
        _check(1 <= self.min_valid_inputs <= self.num_inputs, f"{p}.min_valid_inputs", "must be in [1, num_inputs]")
        _check(self.max_program_chars > 0, f"{p}.max_program_chars", "must be > 0")
        _choice(self.code_f_rule, ("azr", "lenient"), f"{p}.code_f_rule")
        _check(self.max_response_chars > 0, f"{p}.max_response_chars", "must be > 0")
        _choice(self.prompt_template, ("azr", "chat"), f"{p}.prompt_template")
        if self.prompt_file is not None:
            from populora_verl.tasks.templates import load_prompt_file  # lazy: tasks imports this module

            try:
                self._templates = load_prompt_file(self.prompt_file)
            except ValueError as e:
                _fail(f"{p}.prompt_file", str(e))


@dataclass
class BufferConfig:
    """Task buffers (AZR: seeded with the identity triplet, capped at 16384 programs)."""

    max_programs: int = 16384
    seed_file: str | None = None  # JSONL of {program, input, output} (code_f: + inputs/outputs/message)
    # What students train on besides the estimation answers (rewards.train_on_estimation_rollouts):
    # fallback: buffer tasks (uniform) stand in for each task their teacher failed to make valid, so a student always
    # answers proposals_per_type x teacher_n tasks per type; max_new: AZR's solver batch, that many buffer tasks per
    # type drawn newest first, whatever the teacher made (rollout.buffer_task_n answers each).
    student_mix: str = "fallback"
    valid_program_filter: str = "all"  # all | non_one | non_extremes
    # Seeding phase (AZR): before step 1 the base model (no adapter) proposes until this many valid code_i/code_o
    # programs (and as many code_f tasks, when code_f is trained) are buffered; 0: start from the identity seeds.
    # Skipped when seed_file is set (a saved seed set, e.g. <run dir>/seed_tasks.jsonl of an earlier run).
    seed_programs: int = 0
    seed_rounds: int = 16  # generation rounds the seeding phase may take before training starts anyway
    # > 0: a seed_file that does not exist yet is waited for (up to this many seconds) at the first step instead of
    # failing at start-up, so a run can start alongside the run whose seeding phase writes it.
    seed_file_wait_s: float = 0.0
    _prefix: str = field(default=f"{ROOT}.buffer", repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self._prefix
        _check(self.max_programs >= 1, f"{p}.max_programs", "must be >= 1")
        _choice(self.valid_program_filter, ("all", "non_one", "non_extremes"), f"{p}.valid_program_filter")
        _choice(self.student_mix, ("fallback", "max_new"), f"{p}.student_mix")
        _check(self.seed_file_wait_s >= 0, f"{p}.seed_file_wait_s", f"must be >= 0, got {self.seed_file_wait_s!r}")
        for k in ("seed_programs", "seed_rounds"):
            v = getattr(self, k)
            _check(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                f"{p}.{k}",
                f"must be an integer >= 0, got {v!r}",
            )


def executor_limit_problems(timeout_s: float, memory_mb: int) -> dict[str, str]:
    """{argument: what is wrong} with an executor's limits, empty when usable: the config names the key from it,
    :class:`populora_verl.executor.Executor` raises with it."""
    out = {}
    if not timeout_s > 0:
        out["timeout_s"] = f"must be > 0, got {timeout_s!r}"
    if not memory_mb >= 32:
        out["memory_mb"] = f"must be >= 32, got {memory_mb!r}"
    return out


@dataclass
class ExecutorConfig:
    """The sandboxed executor that validates teacher programs and checks student answers."""

    backend: str = "local"  # local | sandbox_fusion
    timeout_s: float = 10.0
    memory_mb: int = 512
    max_workers: int | None = None  # None: os.cpu_count()
    max_output_chars: int = 100_000  # hard cap on a result's repr (bigger => error "output too large")
    # AZR parity in what prompts show: outputs cut to 400 chars with "..." in the middle; answers are judged on the
    # whole output, so a wrong answer sharing a long prefix is never scored correct
    truncate_output: bool = True
    check_determinism: bool = True
    banned_modules: list[str] = field(default_factory=lambda: list(AZR_BANNED_MODULES))
    sandbox_fusion_url: str | None = None
    _prefix: str = field(default=f"{ROOT}.executor", repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self._prefix
        _choice(self.backend, ("local", "sandbox_fusion"), f"{p}.backend")
        for key, why in executor_limit_problems(self.timeout_s, self.memory_mb).items():
            _check(False, f"{p}.{key}", why)
        _check(self.max_workers is None or self.max_workers >= 1, f"{p}.max_workers", "must be null or >= 1")
        _check(self.max_output_chars > 0, f"{p}.max_output_chars", "must be > 0")
        if self.backend == "sandbox_fusion":
            _check(bool(self.sandbox_fusion_url), f"{p}.sandbox_fusion_url", "is required when backend=sandbox_fusion")


@dataclass
class RewardsConfig:
    """Reward levels (AZR's by default). ``zero_learnability_reward`` is Z, the teacher reward at s̄ ∈ {0,1}."""

    teacher: str = "one_minus"  # one_minus: 1-s̄ if 0<s̄<1 else Z | inverse: 1-s̄ always
    zero_learnability_reward: float = -0.5
    correct: float = 1.0
    wrong_answer: float = -0.5
    format_error: float = -1.0
    invalid_program: float = -1.0
    train_on_estimation_rollouts: bool = True
    _prefix: str = field(default=f"{ROOT}.rewards", repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self._prefix
        _choice(self.teacher, ("one_minus", "inverse"), f"{p}.teacher")


@dataclass
class AdvantageConfig:
    """TRR++: REINFORCE++-style whitening per group (AZR's six (task, role) baselines, within each adapter)."""

    group: str = "adapter_task_role"  # adapter_task_role | subpop_task_role | task_role
    eps: float = 1e-6
    _prefix: str = field(default=f"{ROOT}.advantage", repr=False, compare=False)

    def __post_init__(self) -> None:
        _choice(self.group, ("adapter_task_role", "subpop_task_role", "task_role"), f"{self._prefix}.group")
        _check(self.eps > 0, f"{self._prefix}.eps", "must be > 0")


@dataclass
class PBTConfig:
    """Population-based training: every ``interval_steps``, replace the weakest with operator children."""

    enabled: bool = True
    interval_steps: int = 10
    fitness: str = "trueskill_conservative"  # trueskill_conservative (mu-3sigma) | mu | recent_reward
    cull_fraction: float = 0.25
    protect_top: int = 1
    crossover_rate: float = 0.5
    operators: dict[str, float] | None = None  # name -> relative probability; None: uniform over all
    operator_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    reset_optimizer_on_replace: bool = True
    child_rating: str = "prior"  # prior | inherit_inflate_sigma
    roles: list[str] = field(default_factory=lambda: ["teacher", "student"])
    # No evolution in the run's last N steps, so every evaluated member has trained since its birth.
    # null: one interval_steps. Needs the run's length (CPU driver: --steps; verl: trainer.total_training_steps).
    final_quiet_steps: int | None = None
    # Newborn protection: a member younger than this many trained steps is never culled (0: off).
    min_age: int = 20
    _prefix: str = field(default=f"{ROOT}.pbt", repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self._prefix
        _check(
            isinstance(self.interval_steps, int) and self.interval_steps >= 1,
            f"{p}.interval_steps",
            f"must be an integer >= 1, got {self.interval_steps!r}",
        )
        _choice(self.fitness, ("trueskill_conservative", "mu", "recent_reward"), f"{p}.fitness")
        _check(0 < self.cull_fraction < 1, f"{p}.cull_fraction", f"must be in (0, 1), got {self.cull_fraction!r}")
        _check(self.protect_top >= 0, f"{p}.protect_top", "must be >= 0")
        _check(0 <= self.crossover_rate <= 1, f"{p}.crossover_rate", f"must be in [0, 1], got {self.crossover_rate!r}")
        _choice(self.child_rating, ("prior", "inherit_inflate_sigma"), f"{p}.child_rating")
        _check(
            self.final_quiet_steps is None or (isinstance(self.final_quiet_steps, int) and self.final_quiet_steps >= 0),
            f"{p}.final_quiet_steps",
            f"must be null or an integer >= 0, got {self.final_quiet_steps!r}",
        )
        _check(
            isinstance(self.min_age, int) and self.min_age >= 0,
            f"{p}.min_age",
            f"must be an integer >= 0, got {self.min_age!r}",
        )
        for r in self.roles:
            _choice(r, ("teacher", "student"), f"{p}.roles")
        if self.operators is not None:
            _check(len(self.operators) > 0, f"{p}.operators", "must name at least one operator (or be null)")
            for name, prob in self.operators.items():
                _check(prob >= 0, f"{p}.operators.{name}", f"probability must be >= 0, got {prob!r}")
            _check(sum(self.operators.values()) > 0, f"{p}.operators", "probabilities must have a positive sum")
        # Operator names are checked against the registry by the PBT controller (evolution.pbt), which owns it.

    @property
    def quiet_steps(self) -> int:
        """``final_quiet_steps`` resolved (null: one interval)."""
        return self.interval_steps if self.final_quiet_steps is None else int(self.final_quiet_steps)


@dataclass
class DiagnosticsConfig:
    """Complexity metrics and CVT coverage of valid problems."""

    cvt_cells: int = 64
    descriptors: list[str] = field(default_factory=lambda: ["ast_depth", "cyclomatic", "loc"])
    # Upper bounds used to normalise each descriptor into [0, 1] for the CVT archive (values are clipped).
    descriptor_max: dict[str, float] = field(
        default_factory=lambda: {"ast_depth": 20.0, "cyclomatic": 20.0, "loc": 60.0, "ast_nodes": 300.0}
    )
    cvt_samples: int = 10_000
    coverage_window: int = 10  # windowed coverage counts the valid tasks of the last W steps
    plots: bool = True
    # Under bypass_mode the old log-probs are vLLM's, so comparing them with "the trainer's" compares vLLM with
    # itself. Every N steps the trainer computes its own log-probs on logprob_check_rows rows per adapter and
    # compares them with vLLM's (0: never).
    logprob_check_every: int = 5
    logprob_check_rows: int = 8
    _prefix: str = field(default=f"{ROOT}.diagnostics", repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self._prefix
        _check(self.cvt_cells >= 2, f"{p}.cvt_cells", "must be >= 2")
        _check(self.logprob_check_every >= 0, f"{p}.logprob_check_every", "must be >= 0 (0: never)")
        _check(self.logprob_check_rows >= 1, f"{p}.logprob_check_rows", "must be >= 1")
        _check(len(self.descriptors) >= 1, f"{p}.descriptors", "must list at least one descriptor")
        known = ("ast_depth", "cyclomatic", "loc", "ast_nodes")  # populora_verl.diagnostics.complexity.DESCRIPTORS
        for d in self.descriptors:
            _choice(d, known, f"{p}.descriptors")
            _check(d in self.descriptor_max, f"{p}.descriptor_max.{d}", "is missing: every descriptor needs a bound")
            _check(self.descriptor_max[d] > 0, f"{p}.descriptor_max.{d}", "must be > 0")
        _check(len(set(self.descriptors)) == len(self.descriptors), f"{p}.descriptors", "has duplicates")
        _check(self.cvt_samples >= self.cvt_cells, f"{p}.cvt_samples", "must be >= cvt_cells")
        _check(
            isinstance(self.coverage_window, int) and self.coverage_window >= 1,
            f"{p}.coverage_window",
            f"must be an integer >= 1, got {self.coverage_window!r}",
        )


@dataclass
class PopuLoRAConfig:
    """The whole ``populora`` section."""

    # verl only: true turns a verl config into a PopuLoRA run; the start-up callback then sets the verl keys the
    # population needs (populora_verl.trainer.enable, docs/from-grpo.md). The CPU driver ignores it.
    enable: bool = False
    population: PopulationConfig = field(default_factory=PopulationConfig)
    matchmaking: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    pbt: PBTConfig = field(default_factory=PBTConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)

    def __post_init__(self) -> None:
        single = self.population.mode == "single_agent"
        if single and self.pbt.enabled:
            # The AZR baseline is one adapter: there is nobody to replace it with.
            self.pbt.enabled = False
        # Crossovers need two distinct survivors; a sub-population of one or two can only mutate, which the
        # controller handles per sub-population: nothing to reject here.
        n = self.population.num_adapters
        if self.rollout.max_loras is not None:
            _check(
                self.rollout.max_loras >= n,
                f"{ROOT}.rollout.max_loras",
                f"must be >= population size ({n}), got {self.rollout.max_loras}",
            )
        if self.rollout.max_cpu_loras is not None:
            _check(
                self.rollout.max_cpu_loras >= n,
                f"{ROOT}.rollout.max_cpu_loras",
                f"must be >= population size ({n}), got {self.rollout.max_cpu_loras}",
            )


# --- building from mappings ----------------------------------------------------------------------------------


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _build(cls: type, data: Mapping[str, Any] | None, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        _fail(prefix, f"must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            _fail(f"{prefix}.{key}", f"unknown key (known: {sorted(fields)})")
        tp = hints[key]
        kwargs[key] = (
            _build(tp, value, f"{prefix}.{key}") if _is_dataclass_type(tp) else _coerce(tp, value, f"{prefix}.{key}")
        )
    # Nested sections get their full key prefix so their own errors name it.
    for name, f in fields.items():
        tp = hints[name]
        if _is_dataclass_type(tp) and name not in kwargs:
            kwargs[name] = _build(tp, {}, f"{prefix}.{name}")
    if "_prefix" in {f.name for f in dataclasses.fields(cls)}:
        kwargs["_prefix"] = prefix
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:  # wrong types that slipped through comparisons
        _fail(prefix, str(e))


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Light type checking so a string where a number belongs fails with the key named."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if value is None:
        if tp is type(None) or (
            origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and type(None) in args
        ):
            return None
        _fail(key, "must not be null")
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        non_none = [a for a in args if a is not type(None)]
        return _coerce(non_none[0], value, key) if len(non_none) == 1 else value
    if tp is bool:
        _check(isinstance(value, bool), key, f"must be true/false, got {value!r}")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), key, f"must be a string, got {value!r}")
        return value
    if origin is list:
        _check(isinstance(value, (list, tuple)), key, f"must be a list, got {value!r}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict:
        _check(isinstance(value, Mapping), key, f"must be a mapping, got {value!r}")
        return {k: (_coerce(args[1], v, f"{key}.{k}") if args else v) for k, v in value.items()}
    return value


def load_config(data: Any = None, prefix: str = ROOT) -> PopuLoRAConfig:
    """Build and validate a :class:`PopuLoRAConfig` from a dict, an OmegaConf node, or ``None`` (defaults)."""
    if data is not None and type(data).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf  # DictConfig is a Mapping, but its lists are ListConfig: go plain

        data = OmegaConf.to_container(data, resolve=True)
    if isinstance(data, PopuLoRAConfig):
        return data
    return _build(PopuLoRAConfig, data, prefix)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-dict view of a config (private ``_prefix`` fields dropped), for logging and checkpoints."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.name.startswith("_"):
            continue
        v = getattr(cfg, f.name)
        out[f.name] = to_dict(v) if dataclasses.is_dataclass(v) else v
    return out
