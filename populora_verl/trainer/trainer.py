"""``PopuLoRATrainer``: verl's V1 sync trainer driving one :class:`~populora_verl.step.PopulationStep` per step.

Registered as ``trainer.v1.trainer_mode=populora`` by :func:`populora_verl.trainer.register`. One step::

    begin(step) -> teacher prompts ──TQ──> vLLM (one LoRA id per member) ──> on_proposals -> student prompts
       ──TQ──> vLLM ──> sleep replicas ──> on_answers (rewards, ratings, TRR++ advantages)
       ──> write rm_scores / advantages / returns into TQ
       ──> per adapter slot (sorted): balance; then ONE old-log-prob call and ONE update_actor call for all slots
           (each slot one PPO mini-batch = its own batch; ``+trainer.populora_fused_rpc=false``: one call per slot)
    then stop file and evolution (PBT); verl's checkpoint (with the population, step state and bank); on_step_end:
    the stop file's checkpoint when verl took none -> weight sync (all slots)

The population logic (matching, validation, rewards, advantages, evolution decisions) lives in
:class:`PopulationStep`, shared with the CPU driver; this class only moves data between it, TransferQueue and the
workers (:class:`populora_verl.workers.worker.PopuLoRAActorRolloutRefWorker`). Its jobs live in mixins, one module
each: :mod:`.generation` (prompts through TransferQueue and the agent loop), :mod:`.training` (old log-probs and the
per-adapter update), :mod:`.hooks` (evolution, stop file, checkpoints around verl's loop) and :mod:`.probes` (the
per-adapter report and the debug probes); this module keeps the set-up and the step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import ray
import torch
import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf, open_dict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.debug import marked_timer

from populora_verl import verl_compat
from populora_verl.config import ConfigError, PopuLoRAConfig, load_config
from populora_verl.trainer import TRAINER_NAME, convert, schedule, stop, timeline, training, verl_config
from populora_verl.trainer.generation import GenerationMixin, _Phase
from populora_verl.trainer.hooks import HooksMixin
from populora_verl.trainer.probes import ProbesMixin
from populora_verl.trainer.timeline import Timeline
from populora_verl.trainer.training import TrainingMixin
from populora_verl.workers import fused

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

__all__ = [
    "PopuLoRATrainer",
    "NullPromptLoader",
    "TRAINER_NAME",
    "register",
    "DEBUG_PROBES_KEY",
    "WORKER_CLASS_FQN",
    "use_populora_worker",
    "VERL_POLL_INTERVAL_KEY",
    "use_verl_poll_interval",
    "ENGINE_CLASS_KEY",
    "use_resident_engine",
]

#: ``+trainer.populora_debug_probes=true``: per-step bank checksums and a greedy probe under every LoRA id.
DEBUG_PROBES_KEY = "trainer.populora_debug_probes"
PARTITION = "train"
SIGNAL_FIELDS = ("rm_scores", "advantages", "returns")


#: The actor role's worker, for a verl that reads it from ``actor_rollout_ref.worker_class``.
WORKER_CLASS_FQN = "populora_verl.workers.worker.PopuLoRAActorRolloutRefWorker"


def use_populora_worker(config: DictConfig) -> bool:
    """Point ``actor_rollout_ref.worker_class`` at the PopuLoRA worker where verl declares the key; returns whether it
    did. Another class set by the user stops the run: the adapter bank lives in this worker."""
    if not verl_compat.worker_class_from_config():
        return False
    current = OmegaConf.select(config, "actor_rollout_ref.worker_class", default=None)
    if current not in (None, WORKER_CLASS_FQN):
        raise ConfigError(
            f"actor_rollout_ref.worker_class: PopuLoRA runs its own worker ({WORKER_CLASS_FQN}), got {current!r}"
        )
    with open_dict(config):
        config.actor_rollout_ref.worker_class = WORKER_CLASS_FQN
    return True


#: The actor's training-engine class, where verl declares the key (patches/0022).
ENGINE_CLASS_KEY = "actor_rollout_ref.actor.fsdp_config.engine_class"


def use_resident_engine(config: DictConfig, layouts: Iterable[str]) -> bool:
    """Point ``actor_rollout_ref.actor.fsdp_config.engine_class`` at the resident FSDP engine where verl declares the
    key and every population of the run (``layouts``: each one's ``adapter_layout``) keeps its adapters resident, so
    verl builds that engine and the worker only attaches the adapters; returns whether the key names a resident
    engine. A user's own engine class is kept when it extends the resident engine (theirs then runs, with the
    routing the layout needs); any other class stops the run."""
    if set(layouts) != {"resident"} or not verl_compat.engine_class_from_config():
        return False
    from populora_verl.workers.resident_engine import RESIDENT_ENGINE_FQN

    current = OmegaConf.select(config, ENGINE_CLASS_KEY, default=None)
    if current in (None, RESIDENT_ENGINE_FQN):
        OmegaConf.update(config, ENGINE_CLASS_KEY, RESIDENT_ENGINE_FQN, force_add=True)
        return True
    from verl.utils.import_utils import load_class_from_fqn

    from populora_verl.workers.resident_engine import ResidentFSDPEngineWithLMHead

    cls = load_class_from_fqn(current, "engine")
    if not (isinstance(cls, type) and issubclass(cls, ResidentFSDPEngineWithLMHead)):
        raise ConfigError(
            f"{ENGINE_CLASS_KEY}: resident adapters need a subclass of {RESIDENT_ENGINE_FQN}, got {current!r} "
            "(or set populora.population.adapter_layout=bank)"
        )
    return True


#: verl's key for its replay buffer's poll interval, where verl declares it (patches/0011).
VERL_POLL_INTERVAL_KEY = "trainer.v1.sampler.poll_interval"


def use_verl_poll_interval(config: DictConfig) -> bool:
    """Write ``trainer.populora_poll_interval_s`` (checked; default 0.1 s) into verl's
    ``trainer.v1.sampler.poll_interval`` where verl declares that key, so verl builds its replay buffer with it;
    returns whether it did (not without a config). The plugin's key decides, as it does on a verl without the key."""
    if config is None or not verl_compat.poll_interval_from_config():
        return False
    OmegaConf.update(config, VERL_POLL_INTERVAL_KEY, verl_config.poll_interval(config), force_add=True)
    return True


class NullPromptLoader:
    """Stands in for verl's train/val ``StatefulDataLoader`` where verl lacks ``PPOTrainer.uses_dataset``: PopuLoRA
    makes its prompts from the population, so there is no dataset. Keeps verl's ``data.pt`` checkpoint round trip
    working (empty state)."""

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def state_dict(self) -> dict[str, Any]:
        return {"populora": "no dataset: prompts come from the population step"}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None


def _vllm_server_class() -> type:
    from populora_verl.rollout.vllm_server import PopuLoRAvLLMHttpServer  # imports vLLM

    return PopuLoRAvLLMHttpServer


class PopuLoRATrainer(GenerationMixin, TrainingMixin, HooksMixin, ProbesMixin, PPOTrainerSync):
    """verl V1 sync trainer for a population of LoRA adapters (see the module docstring)."""

    #: Set by __init__ from the config; a trainer built without it (tests) keeps these: no start-up line, no
    #: population schedule, the fused update.
    _timeline: Timeline | None = None
    _timeline_done = True
    _schedule: tuple = ()
    _schedule_cfgs: tuple = ()
    fused_rpc = True
    #: The population step makes every prompt: a verl with ``PPOTrainer.uses_dataset`` (patches/0012) builds no
    #: dataset, keeps no dataloader state and skips validation (verl 0.9.1 ignores it: see _init_dataloader).
    uses_dataset = False

    def __init__(self, config: DictConfig) -> None:
        self._timeline = Timeline()
        here = timeline.imported_at()  # when this (the task runner's) process imported the plugin
        if here is not None and self._timeline.marks and here >= self._timeline.marks[0][1]:
            self._timeline.mark("ray + task runner", at=here)
            # verl's task runner imports the trainer, prints and resolves the config and starts TransferQueue's
            # actors before it builds the trainer: this module's import time divides the two
            self._timeline.mark("task runner imports", at=max(here, IMPORTED_AT))
            self._timeline.mark("config + TransferQueue")
        else:
            self._timeline.mark("ray + task runner")
        use_verl_poll_interval(config)  # before verl's __init__, which builds the replay buffer
        super().__init__(config)
        if not verl_compat.trainer_declares_async():
            # verl 0.9.1 treats every trainer_mode but "sync" as async (ReplayBufferAsync, TQ checkpoints, gen batch
            # 1); a verl with PPOTrainer.is_async reads PPOTrainerSync's False instead.
            verl_compat.private_path("populora_verl.trainer.trainer")
            self.trainer_mode = "sync"
            self.parameter_sync_step = 1
            self.replay_buffer = self._build_replay_buffer()
        use_populora_worker(config)
        from populora_verl.plugin import check_registrations
        from populora_verl.rollout import early_agent_loop

        early_agent_loop.configure(config)  # the task runner's agent-loop manager: workers started by init()

        check_registrations()
        self.pcfg: PopuLoRAConfig = load_config(config.get("populora"))
        verl_config.validate_verl_config(config, self.pcfg)
        print(f"[populora] layout: {verl_config.parallel_layout(config, self.pcfg).describe()}", flush=True)
        self._schedule, self._schedule_cfgs = schedule.scheduled_configs(config)
        if self._schedule_cfgs:
            self.pcfg = self._schedule_cfgs[0]
        # the engine is built once for the run: resident only if every population of the schedule is
        use_resident_engine(config, [c.population.adapter_layout for c in self._schedule_cfgs or (self.pcfg,)])
        self.debug_probes = bool(OmegaConf.select(config, DEBUG_PROBES_KEY, default=False))
        self.fused_rpc = bool(OmegaConf.select(config, fused.FUSED_KEY, default=True))
        from populora_verl.step import PopulationStep

        # The run's length places the final evolution-free window (pbt.final_quiet_steps).
        self.pop_step = PopulationStep(self.pcfg, total_steps=int(config.trainer.total_training_steps))
        # One update_actor per slot with the slot's batch as one mini-batch: ppo_epochs optimizer steps.
        self.pop_step.updates_per_step = int(OmegaConf.select(config, "actor_rollout_ref.actor.ppo_epochs", default=1))
        self._init_populora_state()

    # A verl that reads trainer.v1.sampler.poll_interval builds the buffer with the interval (use_verl_poll_interval);
    # verl 0.9.1 builds it with its 2 s default, so only there is this method replaced.
    if not verl_compat.poll_interval_from_config():

        def _build_replay_buffer(self):
            verl_compat.private_path("_build_replay_buffer")
            buffer = super()._build_replay_buffer()
            if hasattr(buffer, "poll_interval"):  # a user's custom sampler may poll its own way
                buffer.poll_interval = verl_config.poll_interval(self.config)
            return buffer

    def init(self) -> None:
        # The agent-loop workers' and the request load balancer's processes start now and import while the worker
        # groups and vLLM start; once the servers are up the balancer takes them, and the task runner's manager
        # binds the workers (populora_verl.rollout.early_agent_loop).
        # With trainer.populora_early_servers, vLLM's server actors too: they import while the FSDP workers load,
        # and verl's replicas take them (populora_verl.rollout.early_servers).
        from populora_verl.rollout import early_agent_loop, early_servers

        if bool(OmegaConf.select(self.config, early_servers.ENABLE_KEY, default=False)):
            early_servers.start(self.config, _vllm_server_class)
        early_agent_loop.start(self.config)
        try:
            super().init()  # worker groups (FSDP), vLLM engines, weight-sync manager, then _load_checkpoint
        finally:
            summary = early_servers.finish()
        if summary:
            print(f"[populora] {summary}", flush=True)
        early_agent_loop.adopt_load_balancer(self.llm_server_manager)
        self._mark("checkpoint + weight sync")

    def _mark(self, name: str, after: str | None = None) -> None:
        """A start-up timeline mark (only before the line is printed; ``after``: only right after that mark)."""
        tl = self._timeline
        if tl is not None and not self._timeline_done and (after is None or (tl.marks and tl.marks[-1][0] == after)):
            tl.mark(name)

    def _init_populora_state(self) -> None:
        self._stop_save = False  # a stop file ended the run at this step: on_step_end saves it
        self._saved_step = -1  # the last step whose population went into a checkpoint (read once the save returned)
        self._resume_ck = None  # the checkpoint before_load_checkpoint read while choosing the resume folder
        self._timeline_done = self._timeline is None
        self._stop_path = stop.stop_file(self.config)
        if stop.read_request(self._stop_path) is not None:
            print(
                f"[populora] stop file {self._stop_path} exists: the run ends at its first safe step "
                "(delete the file to run to trainer.total_training_steps)",
                flush=True,
            )
        self._phase: _Phase | None = None
        self._next_index = 0
        self._metrics_log = None
        self._step_population_metrics: dict[str, float] | None = None  # this step's, logged after evolution
        self._rank_sums = None  # the debug probe's per-rank shard hashes before this step's update

    # --- set-up overrides ------------------------------------------------------------------------------------

    # A verl that reads actor_rollout_ref.worker_class gets the worker from the config (use_populora_worker);
    # verl 0.9.1 hard-codes ray.remote(ActorRolloutRefWorker), so only there is this method replaced.
    if not verl_compat.worker_class_from_config():

        def _init_resource_pool_mgr(self) -> None:
            verl_compat.private_path("_init_resource_pool_mgr")
            super()._init_resource_pool_mgr()
            from populora_verl.workers.worker import PopuLoRAActorRolloutRefWorker

            # the role keeps its pool, only the class changes
            swapped = False
            for role in (Role.ActorRollout, Role.ActorRolloutRef, Role.Actor):
                if role in self.role_worker_mapping:
                    self.role_worker_mapping[role] = ray.remote(PopuLoRAActorRolloutRefWorker)
                    swapped = True
            if not swapped:
                raise RuntimeError(
                    f"no actor role to host the adapter bank in {sorted(map(str, self.role_worker_mapping))}"
                )

    # A verl with PPOTrainer.uses_dataset reads the class attribute above (no dataset, the run's length from
    # trainer.total_training_steps, no validation); verl 0.9.1 builds both datasets from data.*_files, so only there
    # are these methods replaced.
    if not verl_compat.trainer_without_dataset():

        def _init_dataloader(self) -> None:
            verl_compat.private_path("_init_dataloader")
            self.train_dataset = self.val_dataset = None
            self.train_dataloader = NullPromptLoader()
            self.val_dataloader = NullPromptLoader()
            self.train_dataloader_it = None
            total = int(self.config.trainer.total_training_steps)
            self.total_training_steps = total
            # fit() stops at total_epochs * steps_per_epoch too: one "epoch" longer than the run never ends it early.
            self.steps_per_epoch = total + 1
            # Each slot's LR scheduler is swapped in and out with its adapter, so it steps once per global step.
            with open_dict(self.config):
                if OmegaConf.select(self.config, "actor_rollout_ref.actor.optim") is not None:
                    self.config.actor_rollout_ref.actor.optim.total_training_steps = total

        def _validate(self) -> dict[str, float]:
            verl_compat.private_path("_validate")
            return {}  # no validation set: evaluate members with populora_verl.eval

    # A verl with the trainer's checkpoint hooks calls on_save_checkpoint (HooksMixin) inside its own save, before the
    # step is marked saved; verl 0.9.1 has no such hook, so there the save calls it first.
    if not verl_compat.has_save_hook():

        def _save_checkpoint(self) -> None:
            verl_compat.private_path("_save_checkpoint")
            self.on_save_checkpoint(self._step_folder())
            # verl's save writes latest_checkpointed_iteration.txt last, so a crash above never points at a half save.
            super()._save_checkpoint()

    # A verl with the hooks around its resume calls them itself; verl 0.9.1 has neither, so there the resume is
    # wrapped: the bank and folder choice before verl's load, the population after it.
    if not (verl_compat.has_before_load_hook() and verl_compat.has_save_hook()):

        def _load_checkpoint(self) -> None:
            verl_compat.private_path("_load_checkpoint")
            if not verl_compat.has_before_load_hook():  # with 0021 alone, verl calls it itself
                self.before_load_checkpoint()
            super()._load_checkpoint()  # with 0008's hook alone, verl calls on_load_checkpoint itself
            if self.global_steps and not verl_compat.has_save_hook():
                self.on_load_checkpoint(self._step_folder(for_load=True))

    # A verl with the step's stages public (patches/0018) takes the update's mini-batch from a hook; verl 0.9.1 builds
    # it inside _update_actor, so only there is the update replaced.
    if verl_compat.has_public_step_stages():

        def get_actor_update_extra_info(self, batch: KVBatchMeta) -> dict[str, Any]:
            # One PPO mini-batch is a slot's whole batch (the fused worker replaces the sizes per slot).
            info = super().get_actor_update_extra_info(batch)
            info.update(global_batch_size=len(batch), mini_batch_size=len(batch))
            return info

        def get_required_batch_multiple(self, dp_size: int) -> int:
            # One PPO mini-batch is a slot's whole sub-batch (AZR-style), so only the DP split needs divisibility.
            return dp_size

    else:
        # verl 0.9.1 sizes the update's mini-batch from the config inside _update_actor, with no hook: its extra_info
        # block is repeated here (under the hook's name, which the fused update calls) with the slot's size.

        def get_actor_update_extra_info(self, batch: KVBatchMeta) -> dict[str, Any]:
            actor = self.config.actor_rollout_ref.actor
            return {
                "calculate_entropy": bool(actor.calculate_entropy or actor.entropy_coeff != 0.0),
                "distillation_use_topk": False,
                "distillation_only": False,
                "global_batch_size": len(batch),
                "mini_batch_size": len(batch),
                "epochs": actor.ppo_epochs,
                "seed": actor.data_loader_seed,
                "dataloader_kwargs": {"shuffle": actor.shuffle},
                "temperature": self.config.actor_rollout_ref.rollout.temperature,
            }

        def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
            """verl's actor update with the slot's whole batch as one mini-batch (verl sizes it from the config)."""
            verl_compat.private_path("_update_actor")
            batch.extra_info.update(self.get_actor_update_extra_info(batch))
            output = self.actor_rollout_wg.update_actor(batch)
            metrics.update(training._actor_metrics(output["metrics"]))
            return batch

        def _get_required_batch_multiple(self, dp_size: int) -> int:
            verl_compat.private_path("_get_required_batch_multiple")
            return dp_size

    # A verl with the prompt hand-off public (patches/0020) refills through add_prompts_to_generate (GenerationMixin);
    # verl 0.9.1 binds the replay buffer's refill to the private name, so only there is it forwarded.
    if not verl_compat.has_public_prompt_submission():

        def _add_prompts_to_generate(self, num_prompts: int) -> int:
            verl_compat.private_path("_add_prompts_to_generate")
            return self.add_prompts_to_generate(num_prompts)

    # --- worker RPCs -----------------------------------------------------------------------------------------

    def _rpc(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call a ONE_TO_ALL worker method; the first non-None per-rank result (rank 0 returns gathered data)."""
        out = getattr(self.actor_rollout_wg, name)(*args, **kwargs)
        if isinstance(out, list):
            return next((x for x in out if x is not None), None)
        return out

    def _bank_info(self) -> dict[str, Any]:
        info = self._rpc("populora_bank_info")
        n = self.pcfg.population.num_adapters
        if info is None or int(info["num_slots"]) != n:
            raise RuntimeError(f"adapter bank has {None if info is None else info['num_slots']} slots, population {n}")
        return info

    def _lora_table(self) -> dict[str, dict[str, Any]]:
        """``member_id -> {slot, lora_int_id, lora_name}`` as the workers will serve them this step."""
        slots = {int(s["slot"]) if "slot" in s else i: s for i, s in enumerate(self._bank_info()["slots"])}
        table = {}
        for m in self.pop_step.population.members:
            s = slots[int(m.slot)]
            table[m.id] = {"slot": int(m.slot), "lora_int_id": int(s["lora_int_id"]), "lora_name": str(s["lora_name"])}
        return table

    def _get_adapter(self, slot: int) -> dict[str, torch.Tensor]:
        state = self._rpc("populora_get_adapter", int(slot))
        if state is None:
            raise RuntimeError(f"populora_get_adapter({slot}) returned nothing")
        return state

    def _lora_config(self) -> dict[str, Any]:
        m = self.config.actor_rollout_ref.model
        tm = m.get("target_modules", "all-linear")
        return {
            "r": int(m.lora_rank),
            "lora_alpha": int(m.get("lora_alpha", m.lora_rank)),
            "target_modules": tm if isinstance(tm, str) else list(tm),
            "base_model_name_or_path": str(m.path),
        }  # saved adapters load (and export) on their own

    # --- generation through TransferQueue --------------------------------------------------------------------

    # --- one PopuLoRA step -----------------------------------------------------------------------------------

    def step(self, metrics: dict, timing_raw: dict) -> KVBatchMeta:
        gs = self.global_steps
        with marked_timer("gen", timing_raw, color="red"):
            teacher_resp, t_batch, t_masks = self._generate(self.pop_step.begin(gs), "teacher", metrics)
            with marked_timer("populora_validate", timing_raw, color="yellow"):
                student_requests = self.pop_step.on_proposals(teacher_resp)
            student_resp, s_batch, s_masks = self._generate(student_requests, "student", metrics)
            # Both phases generated: vLLM can give its memory back to the trainer now (verl does this per sample).
            self.checkpoint_manager.sleep_replicas()
        with marked_timer("populora_score", timing_raw, color="yellow"):
            result = self.pop_step.on_answers(student_resp)
        metrics.update(result.metrics)
        # Written to metrics.jsonl in on_step_end, once evolution's event count is known.
        self._step_population_metrics = dict(result.metrics)

        all_meta = KVBatchMeta(
            partition_id=PARTITION,
            keys=list(t_batch.keys) + list(s_batch.keys),
            tags=list(t_batch.tags) + list(s_batch.tags),
        )
        masks = {**t_masks, **s_masks}
        signals = convert.signal_rows(result.samples, masks)
        unused = [k for k in all_meta.keys if k not in signals]
        if unused:  # estimation-only answers (rewards.train_on_estimation_rollouts=false): not trained on
            tq.kv_clear(keys=unused, partition_id=PARTITION)
        if not signals:
            raise RuntimeError(f"populora step {gs}: no trajectory to train on (every rollout failed?)")

        slot_of = {m.id: int(m.slot) for m in self.pop_step.population.members}
        member_of = {v: k for k, v in slot_of.items()}
        parts = convert.partition_keys(result.samples, slot_of)
        before = self._debug_checksums() if self.debug_probes else None
        with marked_timer("populora_logprob_check", timing_raw, color="cyan"):
            checked = self._logprob_check(parts, all_meta, member_of, gs)

        if self.fused_rpc:
            per_adapter, out = self._train_fused(parts, all_meta, signals, member_of, metrics, timing_raw)
        else:
            per_adapter, out = self._train_per_adapter(parts, all_meta, signals, member_of, metrics, timing_raw)
        for member, m in checked.items():
            per_adapter.setdefault(member, {}).update(m)
            metrics.update(convert.prefix_metrics(m, f"populora/{member}"))
        metrics.update({k: v for k, v in convert.mean_over_prefixes(per_adapter).items() if k not in metrics})
        self._log_adapter_report(gs, per_adapter, parts, member_of, before)
        self._end_step(metrics)
        return out

    # --- hooks: probes, evolution, checkpoint, weight sync ---------------------------------------------------

    # --- population schedule (one process, several configurations: populora_verl.bench.step_scaling) ---------

    # --- logging and debug probes ----------------------------------------------------------------------------


def register() -> type[PopuLoRATrainer]:
    """Register :class:`PopuLoRATrainer` as ``trainer.v1.trainer_mode=populora``; safe to call repeatedly."""
    existing = TRAINER_REGISTRY.get(TRAINER_NAME)
    if existing is None:
        register_trainer(TRAINER_NAME)(PopuLoRATrainer)
    elif existing is not PopuLoRATrainer:
        raise RuntimeError(
            f"trainer name {TRAINER_NAME!r} is already registered to {existing.__module__}.{existing.__qualname__}"
        )
    return PopuLoRATrainer


#: When this module finished importing (in the task runner: the trainer's imports are done).
IMPORTED_AT = time.time()
