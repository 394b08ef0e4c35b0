"""The verl half of a PopuLoRA run's start-up checks: the verl keys the plugin depends on, each failure one line
naming the key, and the parallel layout (replicas, tensor parallelism, ranks) the run will have.

Called by the start-up callback (:mod:`populora_verl.startup`) before Ray starts, and again by the trainer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from populora_verl.config import ConfigError, PopuLoRAConfig
from populora_verl.trainer import enable
from populora_verl.trainer.enable import Setting

__all__ = [
    "VLLM_MAX_LORA_RANK",
    "POLL_INTERVAL_KEY",
    "REMOVED_KEYS",
    "poll_interval",
    "validate_verl_config",
    "required_settings",
    "NOT_CHECKED",
    "UNSET_MEANS",
    "ParallelLayout",
    "parallel_layout",
    "warn_if_bank_not_shared",
    "select",
]

logger = logging.getLogger(__name__)

#: vLLM's largest ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``); verl's own check is skipped for our backend.
VLLM_MAX_LORA_RANK = 512


def select(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg.a.b.c`` through mappings or attributes, ``default`` where a part is missing or None."""
    cur = cfg
    for part in dotted.split("."):
        if cur is None:
            return default
        getter = getattr(cur, "get", None)
        cur = getter(part, None) if callable(getter) else getattr(cur, part, None)
    return default if cur is None else cur


def _bad(key: str, msg: str) -> None:
    raise ConfigError(f"{key}: {msg}")


#: Keys the plugin once read and no longer does, and why: one given still stops the start-up, naming the key, instead
#: of being ignored silently.
REMOVED_KEYS: dict[str, str] = {
    "trainer.populora_engine_preload": "the forked engine core could not use CUDA on the GPU stack; vLLM spawns it",
}


#: How often a rollout phase asks TransferQueue whether all its trajectories are in (seconds). verl's replay buffer
#: polls every 2 s, so each phase waited up to 2 s (1 s on average) past its last trajectory: about 2 s of a single
#: agent's 10 s generation on the 1.5B model, with two phases per step. A listing costs milliseconds, so poll finely.
POLL_INTERVAL_KEY = "trainer.populora_poll_interval_s"
DEFAULT_POLL_INTERVAL_S = 0.1


def poll_interval(config: Any) -> float:
    """The rollout phases' poll interval (``trainer.populora_poll_interval_s``), checked: a number in (0, 10]."""
    value = select(config, POLL_INTERVAL_KEY, DEFAULT_POLL_INTERVAL_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 10:
        _bad(POLL_INTERVAL_KEY, f"must be a number of seconds in (0, 10], got {value!r}")
    return float(value)


#: Keys of :data:`~populora_verl.trainer.enable.SETTINGS` the start-up check leaves alone, and why: populora.enable
#: fills them in, but a run works with whatever value they hold.
NOT_CHECKED: dict[str, str] = {
    # verl builds no reference model when use_kl_loss and use_kl_in_reward are false (both checked), and its
    # default follows actor.strategy; enable sets it only so the config reads consistently.
    "actor_rollout_ref.ref.strategy": "no reference model is built",
    # verl's dataset files are never read: the population writes every prompt.
    "data.train_files": "the population writes every prompt",
    "data.val_files": "the population writes every prompt",
}

#: What verl reads for a key of SETTINGS that is null (or left out of a hand-built config): a null switch is off,
#: and the reward manager's source defaults to 'register'. Only these keys may be unset, and only while verl's
#: reading is the value SETTINGS asks for; any other key must hold its value.
UNSET_MEANS: dict[str, Any] = {
    "reward.reward_manager.source": "register",
    "actor_rollout_ref.model.lora.merge": False,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "algorithm.use_kl_in_reward": False,
    "algorithm.filter_groups.enable": False,
    "trainer.v1.sampler.sync_refill_failed_groups": False,
    "trainer.val_before_train": False,
    # critic.enable is not here: null turns a critic on for gae.
}


def required_settings() -> list[Setting]:
    """The settings the start-up check requires: :data:`~populora_verl.trainer.enable.SETTINGS` (read at each call)
    less :data:`NOT_CHECKED`."""
    return [s for s in enable.SETTINGS if s.key not in NOT_CHECKED]


def _holds(value: Any, wanted: Any) -> bool:
    # a switch must be the bool itself (not 0 or 1), as verl's own checks read it
    return value is wanted if isinstance(wanted, bool) else value == wanted


def _expected(value: Any) -> str:
    return enable.show(value) if value is None or isinstance(value, bool) else repr(value)


def validate_verl_config(config: Any, pcfg: PopuLoRAConfig) -> None:
    """Check the verl keys a PopuLoRA run depends on; raise :class:`ConfigError` with one line naming the key."""
    ar = "actor_rollout_ref"
    # What makes it a PopuLoRA run at all (trainer mode, agent loop, reward manager, advantage estimator, rollout,
    # ...): without these verl runs its own trainer, loop, rewards and advantages and the populora section is
    # silently ignored. The values are populora.enable's (enable.SETTINGS), so the two cannot drift apart.
    for s in required_settings():
        value = select(config, s.key, UNSET_MEANS.get(s.key))
        if not _holds(value, s.value):
            _bad(s.key, f"must be {_expected(s.value)} ({s.why}), got {value!r}")
    # Only here, not in SETTINGS: the user chooses the number (enable has no value to fill in).
    steps = select(config, "trainer.total_training_steps")
    if not (isinstance(steps, int) and steps >= 1):
        _bad(
            "trainer.total_training_steps",
            f"must be an integer >= 1 (prompts come from the population), got {steps!r}",
        )
    if select(config, "distillation.enabled", False):
        _bad("distillation.enabled", "must be false with PopuLoRA")
    for key, why in REMOVED_KEYS.items():
        if select(config, key) is not None:
            _bad(key, f"removed ({why})")
    rank = select(config, f"{ar}.model.lora_rank", 0) or select(config, f"{ar}.model.lora.rank", 0)
    if not (isinstance(rank, int) and rank > 0):
        _bad(f"{ar}.model.lora_rank", f"must be > 0 (every member is a LoRA adapter), got {rank!r}")
    if rank > VLLM_MAX_LORA_RANK:
        _bad(f"{ar}.model.lora_rank", f"must be <= {VLLM_MAX_LORA_RANK} (vLLM max_lora_rank), got {rank}")
    n = pcfg.population.num_adapters
    ek = select(config, f"{ar}.rollout.engine_kwargs.vllm", {}) or {}
    max_loras = select(ek, "max_loras")
    if not (isinstance(max_loras, int) and max_loras >= n):
        _bad(
            f"{ar}.rollout.engine_kwargs.vllm.max_loras",
            f"must be >= population size ({n}) so every adapter of a batch is resident on each vLLM replica, "
            f"got {max_loras!r}",
        )
    max_cpu = select(ek, "max_cpu_loras", max_loras)
    if not (isinstance(max_cpu, int) and max_cpu >= max_loras):
        _bad(f"{ar}.rollout.engine_kwargs.vllm.max_cpu_loras", f"must be >= max_loras ({max_loras}), got {max_cpu!r}")
    _validate_overridden_keys(config, pcfg)
    if pcfg.population.adapter_layout == "resident":
        _validate_resident(config)
    poll_interval(config)
    if pcfg.rollout.max_loras is not None and pcfg.rollout.max_loras > max_loras:
        _bad(
            "populora.rollout.max_loras",
            f"({pcfg.rollout.max_loras}) exceeds {ar}.rollout.engine_kwargs.vllm.max_loras ({max_loras}), "
            "which is what vLLM gets",
        )
    parallel_layout(config, pcfg)


def _validate_resident(config: Any) -> None:
    """What resident adapters (populora.population.adapter_layout=resident) rely on in verl's actor."""
    ar = "actor_rollout_ref"
    checks = [
        (
            f"{ar}.model.use_remove_padding",
            select(config, f"{ar}.model.use_remove_padding", False),
            lambda v: v is True,
            "must be true with resident adapters (tokens are routed to their adapter in the packed layout)",
        ),
        (
            f"{ar}.actor.ulysses_sequence_parallel_size",
            select(config, f"{ar}.actor.ulysses_sequence_parallel_size", 1),
            lambda v: v in (1, None),
            "must be 1 with resident adapters (a sequence split across ranks loses its routing)",
        ),
        (
            f"{ar}.actor.fsdp_config.optimizer_offload",
            select(config, f"{ar}.actor.fsdp_config.optimizer_offload", False),
            lambda v: not v,
            "must be false with resident adapters (their optimizer state stays on the GPU)",
        ),
        (
            f"{ar}.actor.optim.lr_scheduler_type",
            select(config, f"{ar}.actor.optim.lr_scheduler_type", "constant"),
            lambda v: v in ("constant", "cosine"),
            "must be 'constant' or 'cosine' with resident adapters (each adapter follows the schedule's lambda)",
        ),
    ]
    for key, value, ok, msg in checks:
        if not ok(value):
            # resident is the default layout, so the way out may be the other layout rather than this key
            _bad(key, f"{msg}, got {value!r} (or set populora.population.adapter_layout=bank)")


def _validate_overridden_keys(config: Any, pcfg: PopuLoRAConfig) -> None:
    """verl keys whose job PopuLoRA does itself, and ``populora.rollout`` keys verl's rollout never reads: each
    must agree with what really happens, so no value a user sets is silently ignored."""
    ar = "actor_rollout_ref"
    n = select(config, f"{ar}.rollout.n")
    if n != 1:
        _bad(
            f"{ar}.rollout.n",
            f"must be 1: PopuLoRA sets samples per prompt itself (populora.rollout.teacher_n / student_n), got {n!r}",
        )
    # The trainer makes each slot's whole batch one PPO mini-batch; in verl's terms that is
    # ppo_mini_batch_size == train_batch_size (one optimizer step per epoch), so ask for exactly that.
    mini, batch = select(config, f"{ar}.actor.ppo_mini_batch_size"), select(config, "data.train_batch_size")
    if mini != batch:
        _bad(
            f"{ar}.actor.ppo_mini_batch_size",
            f"must equal data.train_batch_size ({batch!r}): PopuLoRA trains each "
            f"adapter's whole batch as one mini-batch (one optimizer step per ppo_epoch), got {mini!r}",
        )
    length = select(config, f"{ar}.rollout.response_length") or select(config, "data.max_response_length")
    if pcfg.rollout.max_new_tokens is not None and pcfg.rollout.max_new_tokens != length:
        _bad(
            "populora.rollout.max_new_tokens",
            f"({pcfg.rollout.max_new_tokens}) differs from {ar}.rollout."
            f"response_length ({length!r}), which is what vLLM generates with: set that, or leave this null",
        )
    temp = select(config, f"{ar}.rollout.temperature")
    if pcfg.rollout.temperature is not None and pcfg.rollout.temperature != temp:
        _bad(
            "populora.rollout.temperature",
            f"({pcfg.rollout.temperature}) differs from {ar}.rollout.temperature "
            f"({temp!r}), which is what vLLM samples with: set that, or leave this null",
        )


@dataclass(frozen=True)
class ParallelLayout:
    """How a run spreads over GPUs: FSDP2 ranks of the actor (each holds a shard of every adapter) and vLLM
    replicas (each serves every adapter under its own LoRA id)."""

    n_gpus: int
    nnodes: int
    actor_dp: int  # data-parallel ranks of the actor (world / Ulysses SP): a slot's batch is padded to a multiple
    fsdp_size: int  # ranks one adapter's shards are spread over (= world unless HSDP via fsdp_config.fsdp_size)
    rollout_tp: int
    rollout_world: int  # GPUs per vLLM replica (TP x DP x PP)
    replicas: int
    max_loras: int  # adapters resident per replica (engine_kwargs.vllm.max_loras)
    adapters: int
    adapter_layout: str = "bank"

    def describe(self) -> str:
        held = (
            "every adapter resident and replicated on each rank"
            if self.adapter_layout == "resident"
            else f"every adapter sharded over {self.fsdp_size}"
        )
        return (
            f"{self.n_gpus} GPU(s) on {self.nnodes} node(s); actor: {self.actor_dp} data-parallel rank(s), "
            f"{held}; rollout: {self.replicas} vLLM replica(s) x "
            f"{self.rollout_world} GPU(s) (TP {self.rollout_tp}), each serving all {self.adapters} adapters "
            f"(max_loras {self.max_loras})"
        )


def _positive_int(config: Any, key: str, default: Any = None) -> int:
    value = select(config, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _bad(key, f"must be an integer >= 1, got {value!r}")
    return value


def parallel_layout(config: Any, pcfg: PopuLoRAConfig) -> ParallelLayout:
    """Check the GPU layout keys against each other (what verl would otherwise assert deep inside a Ray worker,
    minutes into start-up) and return the layout; :class:`ConfigError` names the key on a mismatch."""
    ar = "actor_rollout_ref"
    per_node = _positive_int(config, "trainer.n_gpus_per_node")
    nnodes = _positive_int(config, "trainer.nnodes")
    n_gpus = per_node * nnodes
    tp = _positive_int(config, f"{ar}.rollout.tensor_model_parallel_size", 1)
    rdp = _positive_int(config, f"{ar}.rollout.data_parallel_size", 1)
    pp = _positive_int(config, f"{ar}.rollout.pipeline_model_parallel_size", 1)
    rollout_world = tp * rdp * pp
    if n_gpus % rollout_world:
        _bad(
            f"{ar}.rollout.tensor_model_parallel_size",
            f"a vLLM replica needs TP {tp} x DP {rdp} x PP {pp} = {rollout_world} GPUs, which must divide "
            f"trainer.n_gpus_per_node x trainer.nnodes = {n_gpus}",
        )
    if rollout_world > per_node and rollout_world % per_node:
        _bad(
            f"{ar}.rollout.tensor_model_parallel_size",
            f"a replica spanning nodes must use whole nodes: {rollout_world} GPUs is not a multiple of "
            f"trainer.n_gpus_per_node ({per_node})",
        )
    sp = _positive_int(config, f"{ar}.actor.ulysses_sequence_parallel_size", 1)
    if n_gpus % sp:
        _bad(f"{ar}.actor.ulysses_sequence_parallel_size", f"({sp}) must divide the {n_gpus} actor GPUs")
    fsdp_size = select(config, f"{ar}.actor.fsdp_config.fsdp_size", -1)
    if isinstance(fsdp_size, bool) or not isinstance(fsdp_size, int) or fsdp_size == 0:
        _bad(f"{ar}.actor.fsdp_config.fsdp_size", f"must be -1 (all GPUs) or a positive integer, got {fsdp_size!r}")
    if 0 < fsdp_size < n_gpus and n_gpus % fsdp_size:
        _bad(f"{ar}.actor.fsdp_config.fsdp_size", f"({fsdp_size}) must divide the {n_gpus} actor GPUs (HSDP groups)")
    ek = select(config, f"{ar}.rollout.engine_kwargs.vllm", {}) or {}
    return ParallelLayout(
        n_gpus=n_gpus,
        nnodes=nnodes,
        actor_dp=n_gpus // sp,
        fsdp_size=fsdp_size if 0 < fsdp_size < n_gpus else n_gpus,
        rollout_tp=tp,
        rollout_world=rollout_world,
        replicas=n_gpus // rollout_world,
        max_loras=int(select(ek, "max_loras", 0) or 0),
        adapters=pcfg.population.num_adapters,
        adapter_layout=pcfg.population.adapter_layout,
    )


def warn_if_bank_not_shared(paths: Sequence[str | None] | str | None) -> list[str]:
    """Warn (once per save, one line) about per-rank bank files the driver cannot see; returns them.

    Each rank writes its own shard file under ``trainer.default_local_dir``. On several nodes that folder must be
    on a filesystem every node shares (as verl's own per-rank checkpoints need): otherwise a resume on other nodes
    finds no bank for some ranks. Training goes on either way.
    """
    listed = [paths] if isinstance(paths, str) else list(paths or [])
    unseen = [p for p in listed if p and not os.path.exists(p)]
    if unseen:
        logger.warning(
            "populora: %d of %d adapter bank file(s) are not visible from the driver (e.g. %s): put "
            "trainer.default_local_dir on a filesystem shared by every node, or this checkpoint cannot be resumed "
            "elsewhere",
            len(unseen),
            len(listed),
            unseen[0],
        )
    return unseen
