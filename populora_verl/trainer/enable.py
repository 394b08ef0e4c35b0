"""``populora.enable=true``: the verl keys a PopuLoRA run needs, set by the plugin on a composed verl config.

A verl GRPO config becomes a PopuLoRA run with ``populora: {enable: true}`` and the start-up callback
(:class:`populora_verl.startup.PreflightCallback`, declared under ``hydra.callbacks``). Hydra hands the callback
the composed config in ``on_run_start``, before verl's ``main`` reads any of it (verl's own ``validate_config``,
Ray's runtime environment, the trainer registry, resource pools, reward manager and workers); what the callback
sets there is the config every later stage sees. It prints one line, ``set for PopuLoRA: key=value ...``, with
each value it changed.

Which user values the plugin may replace, and which stop the run: each :class:`Setting` lists the values it
replaces (verl's own default, and what a verl GRPO config puts there for the component PopuLoRA swaps in); any
other value is a deliberate choice that PopuLoRA would silently discard, so it stops the run with one line naming
the key. Shapes that PopuLoRA decides from the population (``rollout.n``, the PPO mini-batch, the engine's LoRA
capacity, the dataset files) are derived in :func:`populora_settings`.

:data:`SETTINGS` is also the start-up check's table: :func:`populora_verl.trainer.verl_config.validate_verl_config`
refuses a config whose value of one of these keys is not ``value`` (the few keys it leaves alone are listed there,
each with the reason), so a required value is changed here and only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from populora_verl.config import ConfigError, PopuLoRAConfig, load_config

__all__ = [
    "ENABLE_KEY",
    "Setting",
    "SETTINGS",
    "is_enabled",
    "populora_settings",
    "apply_populora_settings",
    "describe",
    "show",
]

ENABLE_KEY = "populora.enable"
AR = "actor_rollout_ref"
PROMPT_TOKENS_PER_REFERENCE = 1024
_ANY = object()  # Setting.replaces: every value (a switch PopuLoRA cannot honour either way)


@dataclass(frozen=True)
class Setting:
    """One verl key a PopuLoRA run needs at ``value``."""

    key: str
    value: Any
    #: values the plugin replaces without asking: verl's default and the stock choice of a GRPO config;
    #: ``(_ANY,)``: every value. Anything else stops the run.
    replaces: tuple[Any, ...]
    why: str
    #: a floor rather than a value: a user integer at least this large stays as it is
    floor: int | None = None

    def accepts(self, current: Any) -> bool:
        return current == self.value or _ANY in self.replaces or current in self.replaces


#: The fixed part (the derived shapes are in :func:`populora_settings`). The names are the plugin's registrations
#: (:data:`populora_verl.plugin.REGISTRATIONS`); a test keeps the two lists in step. The start-up check
#: (:func:`populora_verl.trainer.verl_config.validate_verl_config`) reads this table too, ``why`` included.
SETTINGS: tuple[Setting, ...] = (
    Setting("trainer.use_v1", True, (), "the population trainer is a V1 trainer"),
    Setting("trainer.v1.trainer_mode", "populora", ("sync",), "the population trainer"),
    Setting(
        "algorithm.adv_estimator",
        "populora_trrpp",
        ("gae", "grpo"),
        "TRR++: the population step computes advantages per adapter, task and role",
    ),
    Setting(
        f"{AR}.rollout.agent.default_agent_loop",
        "populora_agent",
        ("single_turn_agent",),
        "each prompt goes to its member's adapter",
    ),
    Setting("reward.reward_manager.source", "register", ("register",), "the reward manager is a registered one"),
    Setting(
        "reward.reward_manager.name",
        "populora_code",
        ("naive",),
        "rewards come from running the programs the population writes",
    ),
    Setting(f"{AR}.rollout.name", "populora_vllm", (None, "vllm"), "vLLM serving one LoRA id per member"),
    Setting(f"{AR}.rollout.mode", "async", (), "the agent loop's rollout servers"),
    Setting(f"{AR}.rollout.load_format", "safetensors", ("dummy", "auto"), "verl's LoRA weight sync"),
    Setting(
        f"{AR}.rollout.checkpoint_engine.backend",
        "naive",
        (),
        "LoRA weights reach vLLM only through the naive engine in verl 0.9.1",
    ),
    Setting(f"{AR}.actor.strategy", "fsdp2", ("fsdp",), "per-adapter swaps need FSDP2's unflattened parameters"),
    Setting(f"{AR}.ref.strategy", "fsdp2", ("fsdp",), "the same backend as the actor"),
    Setting(f"{AR}.model.lora.merge", False, (), "vLLM serves the adapters unmerged, one id each"),
    Setting(f"{AR}.actor.use_kl_loss", False, (_ANY,), "PopuLoRA computes no reference log-probs per adapter"),
    Setting("algorithm.use_kl_in_reward", False, (_ANY,), "rewards come from the population step"),
    Setting("critic.enable", False, (None,), "TRR++ needs no critic; null turns one on for gae"),
    Setting("algorithm.filter_groups.enable", False, (), "evicting groups would drop teacher rewards"),
    Setting(
        "trainer.v1.sampler.sync_refill_failed_groups",
        False,
        (),
        "a failed group is scored as empty answers so its teacher keeps a reward",
    ),
    Setting(
        "trainer.val_before_train", False, (_ANY,), "there is no validation set (evaluate members with populora-eval)"
    ),
    Setting("data.train_files", None, (_ANY,), "the population writes every prompt"),
    Setting("data.val_files", None, (_ANY,), "the population writes every prompt"),
)


def _select(config: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(config, key, default=default, throw_on_missing=False)


def _has(config: Any, key: str) -> bool:
    """Whether the composed config holds ``key`` at all (a populora.* key the user wrote, since verl has none)."""
    from omegaconf import OmegaConf

    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(config, parent, default=None) if parent else config
    return node is not None and hasattr(node, "keys") and leaf in node


def is_enabled(config: Any) -> bool:
    """Whether ``config`` is a PopuLoRA run: ``populora.enable`` true, or, for a config written before the switch,
    ``enable`` left out with the trainer mode already ``populora``. A ``populora`` section with ``enable`` left out
    on any other trainer mode would run as plain verl and ignore the section, so it stops the run."""
    enable = _select(config, ENABLE_KEY)
    if enable is None:
        if _select(config, "trainer.v1.trainer_mode") == "populora":
            return True
        if _select(config, "populora") is not None:
            raise ConfigError(
                f"{ENABLE_KEY}: the config has a populora section but no enable key: set "
                f"{ENABLE_KEY}=true for a PopuLoRA run, or false (or drop the section) for plain verl"
            )
        return False
    if not isinstance(enable, bool):
        raise ConfigError(f"{ENABLE_KEY}: must be true or false, got {enable!r}")
    if not enable and _select(config, "trainer.v1.trainer_mode") == "populora":
        # The population trainer would run anyway, without the start-up checks that enable turns on.
        raise ConfigError(
            f"{ENABLE_KEY}: false, but trainer.v1.trainer_mode is 'populora': set {ENABLE_KEY}=true, "
            "or another trainer mode for plain verl"
        )
    return enable


def populora_settings(config: Any, pcfg: PopuLoRAConfig) -> list[Setting]:
    """Every verl key this config needs for a PopuLoRA run: :data:`SETTINGS` and the shapes derived from the
    population and the config (raises :class:`ConfigError` where two of the user's own values disagree)."""
    out = list(SETTINGS)
    # Samples per prompt: PopuLoRA draws populora.rollout.teacher_n / student_n itself and asks verl for one.
    # A GRPO group size (rollout.n) is the student's answers per task, so it carries over unless the user also
    # set student_n to something else.
    n = _select(config, f"{AR}.rollout.n")
    if isinstance(n, int) and n > 1:
        if _has(config, "populora.rollout.student_n") and n != pcfg.rollout.student_n:
            raise ConfigError(
                f"{AR}.rollout.n: PopuLoRA asks verl for 1 sample per prompt and draws "
                f"populora.rollout.student_n ({pcfg.rollout.student_n}) answers itself; set one of "
                f"the two, got {n!r}"
            )
        out.append(Setting("populora.rollout.student_n", n, (_ANY,), f"{AR}.rollout.n's group size"))
    out.append(Setting(f"{AR}.rollout.n", 1, (_ANY,), "PopuLoRA draws its own samples per prompt"))
    # Each adapter's whole batch is one PPO mini-batch; in verl's terms ppo_mini_batch_size == train_batch_size.
    out.append(
        Setting(
            f"{AR}.actor.ppo_mini_batch_size",
            _select(config, "data.train_batch_size"),
            (_ANY,),
            "each adapter's batch is one mini-batch",
        )
    )
    # Prompt budget: AZR's proposer prompt carries num_references reference programs (the recipes give 1,024
    # tokens each: 6,144 for six, 2,048 for two); verl left-truncates a longer prompt, cutting its instructions.
    # A larger value of the user's stays.
    need = PROMPT_TOKENS_PER_REFERENCE * max(pcfg.tasks.num_references, 1)
    out.append(Setting("data.max_prompt_length", need, (_ANY,), "the proposer prompt's reference programs", floor=need))
    # vLLM must hold every member's adapter at once (max_loras) and the ids evolution retires while the new ones
    # load (max_cpu_loras); a value the user set stays if it is large enough (validate_verl_config checks it).
    size = pcfg.population.num_adapters
    max_loras = pcfg.rollout.max_loras or size
    ek = f"{AR}.rollout.engine_kwargs.vllm"
    out.append(
        Setting(f"{ek}.max_loras", max_loras, (None,), "every member's adapter on each replica", floor=max_loras)
    )
    mine = _select(config, f"{ek}.max_loras")
    capacity = mine if isinstance(mine, int) and mine >= max_loras else max_loras
    out.append(
        Setting(
            f"{ek}.max_cpu_loras",
            max(pcfg.rollout.max_cpu_loras or 2 * size, capacity),
            (None,),
            "evolved members' new ids load before the old ones retire",
            floor=capacity,
        )
    )
    # The recipes run a one-GPU replica's model inside vLLM's engine-core process (uni: one process less to start);
    # a replica of several GPUs needs vLLM's multiprocessing executor, so a larger layout set on top of a recipe
    # runs as verl would run it.
    backend, gpus = f"{ek}.distributed_executor_backend", _rollout_gpus(config)
    if _select(config, backend) == "uni" and gpus is not None and gpus > 1:
        out.append(Setting(backend, "mp", ("uni",), f"uni drives one GPU; a vLLM replica here spans {gpus}"))
    return out


def _rollout_gpus(config: Any) -> int | None:
    """The GPUs of one vLLM replica (TP x DP x PP); None where a size is not an integer (the start-up check names
    the key)."""
    sizes = [_select(config, f"{AR}.rollout.{k}") for k in _REPLICA_SIZES]
    sizes = [1 if v is None else v for v in sizes]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
        return None
    return sizes[0] * sizes[1] * sizes[2]


_REPLICA_SIZES = ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size")


def _user_keeps(setting: Setting, current: Any) -> bool:
    """A user value the plugin leaves as it is: at least a floor's worth."""
    return (
        setting.floor is not None
        and isinstance(current, int)
        and not isinstance(current, bool)
        and current >= setting.floor
    )


def apply_populora_settings(config: Any, *, dry_run: bool = False) -> list[tuple[str, Any]]:
    """Set every key of :func:`populora_settings` on ``config`` (in place unless ``dry_run``) and return the
    ``(key, value)`` pairs that changed. A user value the plugin may not replace raises :class:`ConfigError`
    with one line naming the key, before anything is changed."""
    from omegaconf import OmegaConf

    pcfg = load_config(_select(config, "populora"))
    changes: list[tuple[str, Any]] = []
    for s in populora_settings(config, pcfg):
        current = _select(config, s.key)
        if current == s.value and (s.value is not None or _has(config, s.key)) or _user_keeps(s, current):
            continue
        if not s.accepts(current):
            raise ConfigError(
                f"{s.key}: PopuLoRA sets it to {s.value!r} ({s.why}), got {current!r}; remove it or set {s.value!r}"
            )
        changes.append((s.key, s.value))
    if not dry_run:
        for key, value in changes:
            # force_add: populora.* and engine_kwargs.vllm.* keys are new to verl's struct config
            OmegaConf.update(config, key, value, merge=False, force_add=True)
    return changes


def show(value: Any) -> str:
    """``value`` as a Hydra override writes it: ``null``, ``true``, ``false``, or the value itself."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def describe(changes: Sequence[tuple[str, Any]]) -> str:
    """The one start-up line: ``set for PopuLoRA: key=value ...`` (values as a Hydra override would write them)."""
    return "set for PopuLoRA: " + " ".join(f"{k}={show(v)}" for k, v in changes)
