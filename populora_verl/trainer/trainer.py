"""``PopuLoRATrainer``: verl's V1 sync trainer driving one :class:`~populora_verl.step.PopulationStep` per step.

Registered as ``trainer.v1.trainer_mode=populora`` by :func:`populora_verl.trainer.register`. One step::

    begin(step) -> teacher prompts ──TQ──> vLLM (one LoRA id per member) ──> on_proposals -> student prompts
       ──TQ──> vLLM ──> sleep replicas ──> on_answers (rewards, ratings, TRR++ advantages)
       ──> write rm_scores / advantages / returns into TQ
       ──> per adapter slot (sorted): balance; then ONE old-log-prob call and ONE update_actor call for all slots
           (each slot one PPO mini-batch = its own batch; ``+trainer.populora_fused_rpc=false``: one call per slot)
    on_step_end: evolution (PBT) -> checkpoint (population, step state, bank, then verl's) -> weight sync (all slots)

The population logic (matching, validation, rewards, advantages, evolution decisions) lives in
:class:`PopulationStep`, shared with the CPU driver; this class only moves data between it, TransferQueue and the
workers (:class:`populora_verl.workers.worker.PopuLoRAActorRolloutRefWorker`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf, open_dict
from tensordict import TensorDict
from transfer_queue import KVBatchMeta

from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.debug import marked_timer
from verl.utils.metric import reduce_metrics
from verl.utils.py_functional import rename_dict

from populora_verl.config import PopuLoRAConfig, load_config
from populora_verl.evolution.pbt import append_event, describe, trim_events
from populora_verl.trainer import TRAINER_NAME, convert, probes, schedule, stop, timeline
from populora_verl.trainer.timeline import Timeline
from populora_verl.workers import ADAPTER_KEY, fused

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

__all__ = ["PopuLoRATrainer", "NullPromptLoader", "TRAINER_NAME", "register", "DEBUG_PROBES_KEY"]

#: ``+trainer.populora_debug_probes=true``: per-step bank checksums and a greedy probe under every LoRA id.
DEBUG_PROBES_KEY = "trainer.populora_debug_probes"
PARTITION = "train"
SIGNAL_FIELDS = ("rm_scores", "advantages", "returns")
PROBE_PROMPT = "Write a Python function `f(x)` that returns the sum of the digits of the integer x. Answer briefly."


class NullPromptLoader:
    """Stands in for verl's train/val ``StatefulDataLoader``: PopuLoRA makes its prompts from the population, so
    there is no dataset. Keeps verl's ``data.pt`` checkpoint round trip working (empty state)."""

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def state_dict(self) -> dict[str, Any]:
        return {"populora": "no dataset: prompts come from the population step"}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None


@dataclass
class _Phase:
    """The prompt groups of one generation phase (teachers or students) while they are in flight."""

    name: str
    requests: list[Any]
    uids: list[str]  # uid currently standing for request i (a refill gives a failed group a fresh uid)
    rows: list[dict[str, Any]]
    resubmitted: int = 0


class _LazyAdapters(Mapping):
    """``{member_id: state_dict}`` that gathers a slot from the workers only when PBT reads it (parents only)."""

    def __init__(self, fetch, slot_of: Mapping[str, int]) -> None:
        self._fetch, self._slot_of, self._cache = fetch, dict(slot_of), {}

    def __getitem__(self, member_id: str) -> dict[str, torch.Tensor]:
        if member_id not in self._cache:
            self._cache[member_id] = self._fetch(self._slot_of[member_id])
        return self._cache[member_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._slot_of)

    def __len__(self) -> int:
        return len(self._slot_of)


def _actor_metrics(raw: Mapping[str, Any]) -> dict[str, Any]:
    """verl's update metrics under its driver names (``actor/...``, ``perf/mfu/actor``), reduced over micro-batches."""
    output = rename_dict(dict(raw), "actor/")
    if "actor/mfu" in output:
        output["perf/mfu/actor"] = output.pop("actor/mfu")
    return reduce_metrics(output)


def rollout_counts(tags: Sequence[Mapping[str, Any]], lengths: Mapping[str, int]) -> dict[str, float]:
    """Work of one rollout phase: sequences, prompt tokens (verl's per-trajectory ``prompt_len`` tag) and generated
    tokens (masked response lengths), for throughput figures (``populora_verl.bench.step_scaling``)."""
    prompt = 0
    for tag in tags:
        try:
            prompt += int((tag or {}).get("prompt_len") or 0)
        except (TypeError, ValueError):
            continue
    return {"sequences": float(len(lengths)), "prompt_tokens": float(prompt),
            "response_tokens": float(sum(lengths.values()))}


def _rows(t: Any) -> list[torch.Tensor]:
    """Per-sample 1-D tensors from a TQ field (jagged nested tensor, padded tensor or list)."""
    if isinstance(t, torch.Tensor):
        return [x.reshape(-1) for x in t.unbind(0)]
    return [torch.as_tensor(x).reshape(-1) for x in t]


class PopuLoRATrainer(PPOTrainerSync):
    """verl V1 sync trainer for a population of LoRA adapters (see the module docstring)."""

    #: Set by __init__; a trainer built without it (tests) keeps None and prints no start-up line.
    _timeline: Timeline | None = None
    _timeline_done = True

    def __init__(self, config: DictConfig) -> None:
        self._timeline = Timeline()
        here = timeline.imported_at()  # when this (the task runner's) process imported the plugin
        if here is not None and self._timeline.marks and here >= self._timeline.marks[0][1]:
            self._timeline.mark("ray + task runner", at=here)
            self._timeline.mark("task runner setup")
        else:
            self._timeline.mark("ray + task runner")
        super().__init__(config)
        # verl treats every trainer_mode other than "sync" as async (ReplayBufferAsync, TQ checkpoints, gen batch 1).
        self.trainer_mode = "sync"
        self.parameter_sync_step = 1
        self.replay_buffer = self._build_replay_buffer()
        from populora_verl.plugin import check_registrations

        check_registrations()
        self.pcfg: PopuLoRAConfig = load_config(config.get("populora"))
        convert.validate_verl_config(config, self.pcfg)
        print(f"[populora] layout: {convert.parallel_layout(config, self.pcfg).describe()}", flush=True)
        self._schedule, self._schedule_cfgs = schedule.scheduled_configs(config)
        if self._schedule_cfgs:
            self.pcfg = self._schedule_cfgs[0]
        self.debug_probes = bool(OmegaConf.select(config, DEBUG_PROBES_KEY, default=False))
        self.fused_rpc = bool(OmegaConf.select(config, fused.FUSED_KEY, default=True))
        from populora_verl.step import PopulationStep

        # The run's length places the final evolution-free window (pbt.final_quiet_steps).
        self.pop_step = PopulationStep(self.pcfg, total_steps=int(config.trainer.total_training_steps))
        # One update_actor per slot with the slot's batch as one mini-batch: ppo_epochs optimizer steps.
        self.pop_step.updates_per_step = int(OmegaConf.select(config, "actor_rollout_ref.actor.ppo_epochs", default=1))
        self._init_populora_state()

    def init(self) -> None:
        super().init()  # worker groups (FSDP), vLLM engines, weight-sync manager, then _load_checkpoint
        self._mark("checkpoint + weight sync")

    def _mark(self, name: str, after: str | None = None) -> None:
        """A start-up timeline mark (only before the line is printed; ``after``: only right after that mark)."""
        tl = self._timeline
        if tl is not None and not self._timeline_done and (after is None or (tl.marks and tl.marks[-1][0] == after)):
            tl.mark(name)

    def _init_populora_state(self) -> None:
        self._save_pending = False
        self._timeline_done = self._timeline is None
        self._stop_path = stop.stop_file(self.config)
        if stop.read_request(self._stop_path) is not None:
            print(f"[populora] stop file {self._stop_path} exists: the run ends at its first safe step "
                  "(delete the file to run to trainer.total_training_steps)", flush=True)
        self._phase: _Phase | None = None
        self._next_index = 0
        self._metrics_log = None

    # --- set-up overrides ------------------------------------------------------------------------------------

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        from populora_verl.workers.worker import PopuLoRAActorRolloutRefWorker

        # verl hard-codes ray.remote(ActorRolloutRefWorker); the role keeps its pool, only the class changes.
        swapped = False
        for role in (Role.ActorRollout, Role.ActorRolloutRef, Role.Actor):
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(PopuLoRAActorRolloutRefWorker)
                swapped = True
        if not swapped:
            raise RuntimeError(f"no actor role to host the adapter bank in {sorted(map(str, self.role_worker_mapping))}")

    def _init_dataloader(self) -> None:
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
        return {}  # no validation set: evaluate members with populora_verl.eval

    def _get_required_batch_multiple(self, dp_size: int) -> int:
        # One PPO mini-batch is a slot's whole sub-batch (AZR-style), so only the DP split needs divisibility.
        return dp_size

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
        return {"r": int(m.lora_rank), "lora_alpha": int(m.get("lora_alpha", m.lora_rank)),
                "target_modules": tm if isinstance(tm, str) else list(tm),
                "base_model_name_or_path": str(m.path)}  # saved adapters load (and export) on their own

    # --- generation through TransferQueue --------------------------------------------------------------------

    def _submit_rows(self, rows: list[dict[str, Any]]) -> None:
        self._submit_batch_to_rollout(convert.rows_to_tensordict(rows, self.global_steps))

    def _add_prompts_to_generate(self, num_prompts: int) -> int:
        """verl's refill hook (failed or filtered groups): resubmit the current phase's evicted groups under fresh
        uids instead of reading a dataloader, so every request still gets its answers."""
        phase = self._phase
        if phase is None:
            raise RuntimeError("PopuLoRA has no dataset: prompts are only generated inside a population step")
        listed = (tq.kv_list(PARTITION) or {}).get(PARTITION, {})
        alive = {k.split("_")[0] for k in listed}
        gone = [i for i, u in enumerate(phase.uids) if u not in alive][: int(num_prompts)]
        rows = []
        for i in gone:
            row = dict(phase.rows[i])
            row["uid"] = convert.new_uid()
            phase.uids[i] = row["uid"]
            phase.rows[i] = row
            rows.append(row)
        if rows:
            phase.resubmitted += len(rows)
            self._submit_rows(rows)
        return len(rows)

    def _fetch_responses(self, keys: Sequence[str]) -> tuple[dict[str, str], dict[str, int], dict[str, torch.Tensor]]:
        if not keys:
            return {}, {}, {}
        data = tq.kv_batch_get(keys=list(keys), partition_id=PARTITION, select_fields=["responses", "response_mask"])
        texts, lengths, masks = {}, {}, {}
        for k, ids, mask in zip(keys, _rows(data["responses"]), _rows(data["response_mask"]), strict=True):
            texts[k] = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
            lengths[k] = int(mask.sum())
            masks[k] = mask
        return texts, lengths, masks

    def _generate(self, requests: list[Any], name: str, metrics: dict) -> tuple[list[Any], KVBatchMeta, dict]:
        """Submit one phase's requests, wait for all groups, decode. Returns (GenResponses, batch meta, masks)."""
        if not requests:
            return [], KVBatchMeta(partition_id=PARTITION), {}
        lora_of = self._lora_table()
        if name == "seed":  # the seeding phase's base-policy requests (PopulationStep.seed_begin)
            lora_of = convert.with_base_policy(lora_of, self.pop_step.population.members[0].id)
        rows = convert.requests_to_rows(requests, lora_of, self.global_steps, start_index=self._next_index)
        self._next_index += len(rows)
        self._phase = _Phase(name, list(requests), [r["uid"] for r in rows], rows)
        try:
            self._submit_rows(rows)
            batch, sample_metrics = self.replay_buffer.sample(
                global_steps=self.global_steps, partition_id=PARTITION, batch_size=len(rows))
            texts, lengths, masks = self._fetch_responses(batch.keys)
            responses, missing = convert.build_gen_responses(requests, self._phase.uids, batch.keys, texts, lengths)
        finally:
            phase, self._phase = self._phase, None
        metrics.update(convert.prefix_metrics(sample_metrics, f"populora/rollout/{name}"))
        metrics[f"populora/rollout/{name}/prompts"] = len(rows)
        metrics[f"populora/rollout/{name}/missing_sessions"] = missing
        metrics[f"populora/rollout/{name}/resubmitted"] = phase.resubmitted
        metrics.update(convert.prefix_metrics(rollout_counts(batch.tags, lengths), f"populora/rollout/{name}"))
        if missing:
            logger.warning("populora step %d: %d %s sessions produced no trajectory (scored as empty answers)",
                           self.global_steps, missing, name)
        return responses, batch, masks

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

        all_meta = KVBatchMeta(partition_id=PARTITION, keys=list(t_batch.keys) + list(s_batch.keys),
                               tags=list(t_batch.tags) + list(s_batch.tags))
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

        if getattr(self, "fused_rpc", True):
            per_adapter, out = self._train_fused(parts, all_meta, signals, member_of, metrics, timing_raw)
        else:
            per_adapter, out = self._train_per_adapter(parts, all_meta, signals, member_of, metrics, timing_raw)
        for member, m in checked.items():
            per_adapter.setdefault(member, {}).update(m)
            metrics.update(convert.prefix_metrics(m, f"populora/{member}"))
        metrics.update({k: v for k, v in convert.mean_over_prefixes(per_adapter).items() if k not in metrics})
        self._log_adapter_report(gs, per_adapter, parts, member_of, before)
        return out

    def _bypass_mode(self) -> bool:
        corr = self.config.algorithm.get("rollout_correction", None)
        return bool(corr and corr.get("bypass_mode", False))

    def _logprob_check(self, parts: Mapping[int, list[str]], all_meta: KVBatchMeta, member_of: Mapping[int, str],
                       step: int) -> dict[str, dict[str, float]]:
        """Under bypass_mode, every ``diagnostics.logprob_check_every`` steps: the trainer's own log-probs on a few
        of each adapter's rows (before its update, so both sides are the same policy) against vLLM's. This is the
        check that each adapter was served by its own LoRA id and that the two engines agree; without it, bypass
        mode has nothing to compare (its old log-probs are vLLM's). Diagnostics: a failure only logs."""
        dcfg = self.pcfg.diagnostics
        every = int(dcfg.logprob_check_every)
        if not self._bypass_mode() or every <= 0 or step % every != 0 \
                or not self.config.actor_rollout_ref.rollout.calculate_log_probs:
            return {}
        out: dict[str, dict[str, float]] = {}
        try:
            from verl.protocol import DataProto
            from verl.utils.debug.metrics import calculate_debug_metrics
            from verl.workers.utils.padding import response_from_nested

            dp = self._dp_size()
            for slot, keys in parts.items():
                n = min(len(keys), int(dcfg.logprob_check_rows)) // dp * dp  # verl splits the rows over dp ranks
                if n == 0:
                    continue
                sample = all_meta.select_keys(list(keys[:n]))
                sample.extra_info.update({ADAPTER_KEY: slot, "calculate_entropy": False, "compute_loss": False,
                                          "temperature": self.config.actor_rollout_ref.rollout.temperature})
                self.actor_rollout_wg.compute_log_prob(sample)
                data = tq.kv_batch_get(keys=list(sample.keys), partition_id=PARTITION,
                                       select_fields=["log_probs", "rollout_log_probs", "response_mask", "responses"])
                # the worker writes log-probs over the whole sequence; verl's own pass keeps the response part
                data["old_log_probs"] = response_from_nested(data.pop("log_probs"), data["response_mask"])
                m = calculate_debug_metrics(DataProto(batch=data.to_padded_tensor()))
                out[member_of[slot]] = {f"trainer_check/{k.split('/')[-1]}": float(v) for k, v in m.items()}
                out[member_of[slot]]["trainer_check/rows"] = float(n)
        except Exception as e:  # never fail a step over a diagnostic
            logger.warning("populora: trainer-vs-rollout log-prob check not computed: %s", e)
            return {}
        return out

    def _balanced_sub(self, all_meta: KVBatchMeta, slot: int, keys: list[str], m: dict, timing_raw: dict) -> KVBatchMeta:
        sub = all_meta.select_keys(keys)
        sub.extra_info[ADAPTER_KEY] = slot
        with marked_timer("populora_balance", timing_raw):
            return self._balance_batch(sub, metrics=m)

    def _train_per_adapter(self, parts, all_meta, signals, member_of, metrics, timing_raw):
        """One old-log-prob and one update call per adapter slot (``+trainer.populora_fused_rpc=false``)."""
        out_keys, out_tags, per_adapter = [], [], {}
        for slot, keys in parts.items():
            member = member_of[slot]
            m: dict[str, Any] = {}
            sub = self._balanced_sub(all_meta, slot, keys, m, timing_raw)
            self._write_signals(sub, signals)
            with marked_timer("old_log_prob", timing_raw, color="blue"):
                self._compute_old_log_prob(sub, metrics=m)
            with marked_timer("update_actor", timing_raw, color="red"):
                self._update_actor(sub, metrics=m)
            m["populora/samples"] = len(keys)
            per_adapter[member] = m
            metrics.update(convert.prefix_metrics(m, f"populora/{member}"))
            out_keys.extend(sub.keys)
            out_tags.extend(sub.tags)
        return per_adapter, KVBatchMeta(partition_id=PARTITION, keys=out_keys, tags=out_tags)

    def _dp_size(self) -> int:
        info = self.actor_rollout_wg._dispatch_info
        if "actor" not in info:
            info["actor"] = self.actor_rollout_wg._query_dispatch_info("actor")
        return max(info["actor"]) + 1

    def _train_fused(self, parts, all_meta, signals, member_of, metrics, timing_raw):
        """Every adapter's old log-probs in one worker call, then every adapter's update in one call.

        Each slot keeps exactly the rows (and verl's balancing and padding) it gets from a call of its own; only the
        number of RPCs, TransferQueue round trips and driver-side waits changes (:mod:`populora_verl.workers.fused`).
        """
        per_adapter: dict[str, dict[str, Any]] = {}
        subs: dict[int, KVBatchMeta] = {}
        for slot, keys in parts.items():
            m = per_adapter.setdefault(member_of[slot], {})
            subs[slot] = self._balanced_sub(all_meta, slot, keys, m, timing_raw)
            m["populora/samples"] = len(keys)
        batch = fused.fused_batch(subs, self._dp_size())
        self._write_signals(batch, signals)
        with marked_timer("old_log_prob", timing_raw, color="blue"):
            shared: dict[str, Any] = {}
            self._compute_old_log_prob(batch, metrics=shared)
            # verl's entropy / rollout-vs-trainer metrics over the whole call; per adapter below when available.
            metrics.update(convert.prefix_metrics(shared, "populora/all"))
            self._per_slot_logprob_metrics(subs, member_of, per_adapter)
        with marked_timer("update_actor", timing_raw, color="red"):
            by_slot = self._update_actor_fused(batch)
        for slot, m in by_slot.items():
            per_adapter[member_of[slot]].update(m)
        for member, m in per_adapter.items():
            metrics.update(convert.prefix_metrics(m, f"populora/{member}"))
        return per_adapter, KVBatchMeta(partition_id=PARTITION, keys=list(batch.keys), tags=list(batch.tags))

    def _per_slot_logprob_metrics(self, subs: Mapping[int, KVBatchMeta], member_of: Mapping[int, str],
                                  per_adapter: dict[str, dict[str, Any]]) -> None:
        """Rollout-vs-trainer log-prob agreement per adapter (the check that each adapter was served by its own
        LoRA id) from the old log-probs the fused call wrote; diagnostics, so a failure only logs."""
        if not self.config.actor_rollout_ref.rollout.calculate_log_probs or self._bypass_mode():
            return  # bypass_mode: the old log-probs are vLLM's own; _logprob_check does the real comparison
        try:
            from verl.protocol import DataProto
            from verl.utils.debug.metrics import calculate_debug_metrics

            for slot, sub in subs.items():
                data = tq.kv_batch_get(keys=list(sub.keys), partition_id=PARTITION,
                                       select_fields=["old_log_probs", "rollout_log_probs", "response_mask", "responses"])
                per_adapter[member_of[slot]].update(calculate_debug_metrics(DataProto(batch=data.to_padded_tensor())))
        except Exception as e:  # never fail a step over a diagnostic
            logger.warning("populora: per-adapter rollout/trainer log-prob metrics not computed: %s", e)

    def _update_extra_info(self, n: int) -> dict[str, Any]:
        actor = self.config.actor_rollout_ref.actor
        return {
            "calculate_entropy": bool(actor.calculate_entropy or actor.entropy_coeff != 0.0),
            "distillation_use_topk": False,
            "distillation_only": False,
            "global_batch_size": n,
            "mini_batch_size": n,
            "epochs": actor.ppo_epochs,
            "seed": actor.data_loader_seed,
            "dataloader_kwargs": {"shuffle": actor.shuffle},
            "temperature": self.config.actor_rollout_ref.rollout.temperature,
        }

    def _update_actor_fused(self, batch: KVBatchMeta) -> dict[int, dict[str, Any]]:
        """One update call for every slot of ``batch`` (each slot one PPO mini-batch); reduced metrics per slot."""
        batch.extra_info.update(self._update_extra_info(len(batch)))  # sizes are replaced per segment by the worker
        output = self.actor_rollout_wg.update_actor(batch)
        per_slot = (output["metrics"] or {}).get("populora_fused") if output is not None else None
        if not per_slot:
            raise RuntimeError("fused update_actor returned no per-slot metrics (worker without fused support?)")
        return {int(slot): _actor_metrics(m) for slot, m in per_slot.items()}

    def _write_signals(self, batch: KVBatchMeta, signals: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """rm_scores / advantages / returns for every key of a slot's batch; verl's padding rows get zeros."""
        pads = [k for k in batch.keys if k not in signals]
        pad_masks = {}
        if pads:
            data = tq.kv_batch_get(keys=pads, partition_id=PARTITION, select_fields=["response_mask"])
            pad_masks = dict(zip(pads, _rows(data["response_mask"]), strict=True))
        cols = {f: [] for f in SIGNAL_FIELDS}
        for k in batch.keys:
            for f in SIGNAL_FIELDS:
                cols[f].append(signals[k][f] if k in signals else torch.zeros(pad_masks[k].numel(), dtype=torch.float32))
        fields = TensorDict({f: torch.nested.as_nested_tensor(v, layout=torch.jagged) for f, v in cols.items()},
                            batch_size=len(batch))
        tq.kv_batch_put(keys=list(batch.keys), partition_id=PARTITION, fields=fields)

    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        """verl's actor update with the slot's whole batch as one mini-batch (verl sizes it from the config)."""
        batch.extra_info.update(self._update_extra_info(len(batch)))
        output = self.actor_rollout_wg.update_actor(batch)
        metrics.update(_actor_metrics(output["metrics"]))
        return batch

    # --- hooks: probes, evolution, checkpoint, weight sync ---------------------------------------------------

    def on_step_begin(self) -> None:
        self._mark("agent loop", after="checkpoint + weight sync")
        idx = schedule.starts(getattr(self, "_schedule", [])).get(self.global_steps)
        if idx:  # a later entry of a population schedule starts with this step (entry 0 is set up by init)
            with marked_timer("populora_switch", self.timing_raw, color="green"):
                self._switch_population(idx)
        if not getattr(self.pop_step, "seeded", True):  # buffer.seed_programs > 0 on a fresh run (or entry)
            self._seed_buffers()
        if self.debug_probes:
            self._probe_adapters()

    def _seed_buffers(self) -> None:
        """The seeding phase (``populora.buffer.seed_programs``) before step 1: the base policy proposes until the
        buffers hold the target; nothing of it is trained. The seed set goes to ``<default_local_dir>/seed_tasks.jsonl``
        (reuse it with ``populora.buffer.seed_file``)."""
        from populora_verl.tasks import save_seed_file

        ps, rounds, metrics = self.pop_step, 0, {}
        while True:
            requests = ps.seed_begin()
            if not requests:
                break
            responses, batch, _ = self._generate(requests, "seed", metrics)
            tq.kv_clear(keys=list(batch.keys), partition_id=PARTITION)  # never trained on
            ps.seed_on_proposals(responses)
            rounds += 1
        if rounds:
            path = os.path.join(self._step_folder().rsplit(os.sep, 1)[0], "seed_tasks.jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_seed_file(ps.seed_set, path)
            print(f"[populora] seeding: {rounds} rounds, {len(ps.seed_set)} seed tasks -> {path}", flush=True)

    # --- population schedule (one process, several configurations: populora_verl.bench.step_scaling) ---------

    def _switch_population(self, idx: int) -> None:
        """Replace the population, the adapter bank and vLLM's adapters; keep Ray, FSDP and the vLLM engine.

        Mirrors a step boundary: replicas asleep, fresh bank on the workers, every slot pushed under its id (same
        ids as the previous entry's slots of the same number: the registry updates them in place)."""
        from populora_verl.step import PopulationStep

        entry, old = self._schedule[idx], self.pop_step
        self.checkpoint_manager.sleep_replicas()
        self.pcfg = self._schedule_cfgs[idx]
        self.pop_step = PopulationStep(self.pcfg, executor=old.tasks.executor)
        self.pop_step.updates_per_step = getattr(old, "updates_per_step", 1)  # the compute metrics count it
        self._phase = None
        info = self._rpc("populora_init_bank", self.pcfg.population.num_adapters, self.pcfg.population.seed)
        self.checkpoint_manager.update_weights(self.global_steps)
        print(f"[populora] step {self.global_steps}: population schedule entry {entry.name!r} "
              f"({info['num_slots']} adapters)", flush=True)

    def on_step_end(self) -> None:
        if not self._timeline_done and self._timeline.marks and self._timeline.marks[-1][0] == "agent loop":
            self._timeline.mark(f"step {self.global_steps}")
            print(self._timeline.line(), flush=True)
        self._timeline_done = True
        ending = self._stop_due()
        with marked_timer("populora_evolve", self.timing_raw, color="green"):
            evo = {} if ending else self._evolve()
        if ending:
            # fit() leaves its loop once global_steps passes total_training_steps: this step is the last one.
            self._save_pending = True
            self.total_training_steps = self.global_steps
            print(f"[populora] step {self.global_steps}: stop file {self._stop_path} found; no evolution, "
                  f"checkpoint, then the run ends", flush=True)
        step_metrics = getattr(self, "_step_population_metrics", None)
        if step_metrics is not None:
            self._log_population_metrics({**step_metrics, **evo}, self.global_steps)
            self._step_population_metrics = None
        if self._save_pending:
            with marked_timer("save_checkpoint", self.timing_raw, color="green"):
                self._save_all()
            self._save_pending = False
        # Weight sync last: it pushes every slot (children included) to vLLM under its current LoRA id.
        super().on_step_end()
        pending = getattr(self, "_pending_sync_metrics", None) or {}
        self._pending_sync_metrics = {**pending, **evo}

    def _stop_due(self) -> bool:
        request = stop.read_request(self._stop_path)
        if request is None:
            return False
        pop = self.pop_step.population
        ages = [int(m.age) for m in pop.members]
        window = pop.age_window if self.pop_step.pbt is not None else None
        return stop.due(request, self.global_steps, min(ages) if ages else None, window)

    def _evolve(self) -> dict[str, float]:
        step, pbt = self.global_steps, self.pop_step.pbt
        if pbt is None or not pbt.due(step):
            return {}
        slot_of = {m.id: int(m.slot) for m in self.pop_step.population.members}
        plan, children = self.pop_step.maybe_evolve(step, _LazyAdapters(self._get_adapter, slot_of))
        events = 0 if plan is None else len(plan.replacements)
        for r in (plan.replacements if plan is not None else []):
            # reset_optimizer=false: the child takes its fitter parent's moments (as the CPU driver), never keeps
            # its victim's. Parents are survivors, so no earlier replacement of this plan has touched them.
            self._rpc("populora_set_adapter", int(r.victim_slot), children[r.child_id],
                      reset_optimizer=bool(r.reset_optimizer),
                      optimizer_from=None if r.reset_optimizer else slot_of[r.parent_ids[0]])
            print(f"[populora] step {step} evolution: {describe(r)}", flush=True)
        if plan is not None and plan.replacements:
            append_event(self.config.trainer.default_local_dir, plan)
        ties = sum(r.tie_break for r in plan.replacements) if plan is not None else 0
        return {"populora/evolution/events": float(events), "populora/evolution/tie_breaks": float(ties)}

    def _save_checkpoint(self) -> None:
        # fit() saves before on_step_end; the real save runs there after evolution so the bank is post-evolution.
        self._save_pending = True

    def _step_folder(self, for_load: bool = False) -> str:
        if for_load and self.config.trainer.resume_mode == "resume_path":
            folder = self.config.trainer.resume_from_path
        else:
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)

    def _save_all(self) -> None:
        from populora_verl.checkpoint import save_checkpoint

        pdir = os.path.join(self._step_folder(), "populora")
        written = self.actor_rollout_wg.populora_save_bank(os.path.join(pdir, "bank"))
        convert.warn_if_bank_not_shared(written)  # M nodes: every rank's file must be where the driver resumes
        pop = self.pop_step.population
        adapters = {m.id: self._get_adapter(int(m.slot)) for m in pop.members}
        save_checkpoint(pdir, self.global_steps, population=pop, adapters=adapters, lora_config=self._lora_config(),
                        optimizers={}, step_state=self.pop_step.state_dict(),
                        extra={"bank": "bank", "bank_info": self._bank_info()})
        # verl's save writes latest_checkpointed_iteration.txt last, so a crash above never points at a half save.
        super()._save_checkpoint()
        print(f"[populora] step {self.global_steps}: checkpoint {pdir}", flush=True)
        from populora_verl.trainer.resume import prune_step_folders

        for folder in prune_step_folders(os.path.dirname(self._step_folder()),
                                         self.config.trainer.get("max_actor_ckpt_to_keep", None)):
            print(f"[populora] removed old checkpoint {folder} (trainer.max_actor_ckpt_to_keep)", flush=True)

    def _load_checkpoint(self) -> None:
        self._mark("workers + vLLM")
        info = self._rpc("populora_init_bank", self.pcfg.population.num_adapters, self.pcfg.population.seed,
                         shared_a=self.pcfg.population.founder_init == "shared_a")
        logger.info("populora: adapter bank initialised: %s", info)
        ck = None
        if self.config.trainer.resume_mode == "auto":
            # Check the newest checkpoint before verl loads it; fall back to an older one if it is damaged.
            from populora_verl.trainer.resume import choose_resume_folder, tracked_folder

            root = self.config.trainer.default_local_dir
            root = root if os.path.isabs(root) else os.path.join(os.getcwd(), root)
            folder, ck = choose_resume_folder(root)
            if folder is not None and folder != tracked_folder(root):
                with open_dict(self.config):
                    self.config.trainer.resume_mode = "resume_path"
                    self.config.trainer.resume_from_path = str(folder)
        super()._load_checkpoint()
        # evolution.jsonl keeps what happened up to the step this run starts from (as metrics.jsonl does)
        trim_events(self.config.trainer.default_local_dir, self.global_steps)
        if self.global_steps == 0:
            return
        from populora_verl.checkpoint import load_checkpoint, restore_rng_state

        pdir = os.path.join(self._step_folder(for_load=True), "populora")
        if not os.path.isdir(pdir):
            raise RuntimeError(f"resuming step {self.global_steps} but {pdir} is missing: without the population and "
                               "adapter bank the run would silently restart from fresh adapters")
        ck = ck if ck is not None else load_checkpoint(pdir)
        self.pop_step.load_state_dict(ck.step_state, population=ck.population)
        if ck.rng:
            restore_rng_state(ck.rng)
        self._rpc("populora_load_bank", os.path.join(pdir, "bank"))
        print(f"[populora] resumed step {self.global_steps} from {pdir}", flush=True)

    # --- logging and debug probes ----------------------------------------------------------------------------

    def _log_population_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """``<trainer.default_local_dir>/metrics.jsonl`` (docs/CONTRACTS.md), the file the plots and report read."""
        try:
            if self._metrics_log is None:
                from populora_verl.diagnostics.metrics import MetricsLogger

                self._metrics_log = MetricsLogger(self._step_folder().rsplit(os.sep, 1)[0], resume_step=step - 1)
            self._metrics_log.log({k: v for k, v in metrics.items() if k.startswith("populora/")}, step)
        except Exception as e:  # the metrics file must never stop training
            logger.warning("populora: metrics.jsonl not written: %s", e)

    def _debug_checksums(self) -> dict[int, str]:
        self._rank_sums = self.actor_rollout_wg.populora_shard_checksums()  # each rank's own shards, same moment
        return {int(m.slot): convert.state_checksum(self._get_adapter(int(m.slot)))
                for m in self.pop_step.population.members}

    def _log_adapter_report(self, step: int, per_adapter: Mapping[str, Mapping[str, Any]],
                            parts: Mapping[int, list[str]], member_of: Mapping[int, str],
                            before: Mapping[int, str] | None) -> None:
        for member, m in per_adapter.items():
            diff = {k.split("/")[-1]: v for k, v in m.items() if "rollout_probs_diff" in k or "probs_pearson" in k}
            # Under bypass_mode only the periodic check compares two engines; other steps have nothing to show.
            shown = json.dumps(diff, default=float) if diff else "n/a"
            print(f"[populora] step {step} {member}: samples={m.get('populora/samples')} "
                  f"pg_loss={m.get('actor/pg_loss')} rollout_vs_trainer={shown}", flush=True)
        if before is None:
            return
        rank_before = self._rank_sums
        after = self._debug_checksums()
        changed = sorted(s for s in after if after[s] != before.get(s))
        trained = sorted(parts)
        print(probes.rank_report(step, rank_before, self._rank_sums, trained)[0], flush=True)
        ok = changed == trained
        print(f"[populora] step {step} bank checksums: " + " ".join(
            f"{member_of.get(s, s)}@{s}:{before.get(s)}->{after[s]}" for s in sorted(after))
              + f" | changed={changed} trained={trained} {'OK' if ok else 'MISMATCH'}", flush=True)
        if not ok:
            logger.error("populora: slots changed %s but trained %s", changed, trained)

    def _probe_adapters(self) -> None:
        """Greedy answer to one fixed prompt under every member's LoRA id (replicas are awake between steps)."""
        from populora_verl.step import GenRequest

        members = self.pop_step.population.members
        reqs = [GenRequest(m.id, "teacher", "code_i", PROBE_PROMPT, 1, {}) for m in members]
        table = self._lora_table()
        rows = convert.requests_to_rows(reqs, table, self.global_steps, start_index=self._next_index)
        self._next_index += len(rows)
        for r in rows:
            r["__do_sample__"] = False
        self._submit_rows(rows)
        batch, _ = self.replay_buffer.sample(global_steps=self.global_steps, partition_id=PARTITION,
                                             batch_size=len(rows))
        texts, _, _ = self._fetch_responses(batch.keys)
        by_uid = convert.group_trajectory_keys(batch.keys)
        outs = {}
        for m, r in zip(members, rows, strict=True):
            key = by_uid.get(r["uid"], {}).get(0)
            outs[m.id] = texts.get(key, "<no output>") if key else "<no output>"
        # Greedy text only changes once adapters have moved far; vLLM's own log-probs of the greedy tokens show
        # which LoRA each request really ran with, from the first small update on.
        logps: dict[str, float] = {}
        try:
            lp = tq.kv_batch_get(keys=list(batch.keys), partition_id=PARTITION, select_fields=["rollout_log_probs"])
            per_key = {k: float(t.float().sum()) for k, t in zip(batch.keys, lp["rollout_log_probs"].unbind())}
            for m, r in zip(members, rows, strict=True):
                key = by_uid.get(r["uid"], {}).get(0)
                if key in per_key:
                    logps[m.id] = per_key[key]
        except Exception as e:  # the probe is diagnostics: never fail the run over it
            logger.warning("populora probe: no rollout log-probs (%s)", e)
        tq.kv_clear(keys=list(batch.keys), partition_id=PARTITION)
        distinct = len(set(outs.values()))
        distinct_lp = len({round(v, 4) for v in logps.values()})
        print(f"[populora] step {self.global_steps} greedy probe: {distinct}/{len(outs)} distinct outputs, "
              f"{distinct_lp}/{len(logps)} distinct greedy log-probs", flush=True)
        for mid, text in outs.items():
            print(f"[populora]   {mid} lora_int_id={table[mid]['lora_int_id']} ({table[mid]['lora_name']}): "
                  f"sum_logp={logps.get(mid, float('nan')):.6f} {text[:100]!r}", flush=True)
        probes.print_replica_probe(self.llm_server_manager.get_replicas(), self.tokenizer, PROBE_PROMPT, table,
                                   self.global_steps)


def register() -> type[PopuLoRATrainer]:
    """Register :class:`PopuLoRATrainer` as ``trainer.v1.trainer_mode=populora``; safe to call repeatedly."""
    existing = TRAINER_REGISTRY.get(TRAINER_NAME)
    if existing is None:
        register_trainer(TRAINER_NAME)(PopuLoRATrainer)
    elif existing is not PopuLoRATrainer:
        raise RuntimeError(f"trainer name {TRAINER_NAME!r} is already registered to {existing.__module__}."
                           f"{existing.__qualname__}")
    return PopuLoRATrainer
