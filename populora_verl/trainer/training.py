"""Training: old log-probs and one update per adapter slot, fused into one worker call per phase or one call per
slot, with the trainer-vs-vLLM log-prob check and the step's signals written to TransferQueue."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta

from populora_verl import verl_compat
from populora_verl.trainer import convert
from populora_verl.trainer.convert import PARTITION, SIGNAL_FIELDS, field_rows
from populora_verl.trainer.timeline import timed
from populora_verl.workers import ADAPTER_KEY, fused

logger = logging.getLogger(__name__)


def _actor_metrics(raw: Mapping[str, Any]) -> dict[str, Any]:
    """verl's update metrics under its driver names (``actor/...``, ``perf/mfu/actor``), reduced over micro-batches."""
    from verl.utils.metric import reduce_metrics  # lazily, as timeline.timed says
    from verl.utils.py_functional import rename_dict

    output = rename_dict(dict(raw), "actor/")
    if "actor/mfu" in output:
        output["perf/mfu/actor"] = output.pop("actor/mfu")
    return reduce_metrics(output)


class TrainingMixin:
    """The per-adapter update of one step (old log-probs, the update, their metrics).
    Mixed into :class:`~populora_verl.trainer.trainer.PopuLoRATrainer`."""

    def _bypass_mode(self) -> bool:
        corr = self.config.algorithm.get("rollout_correction", None)
        return bool(corr and corr.get("bypass_mode", False))

    def _logprob_check(
        self, parts: Mapping[int, list[str]], all_meta: KVBatchMeta, member_of: Mapping[int, str], step: int
    ) -> dict[str, dict[str, float]]:
        """Under bypass_mode, every ``diagnostics.logprob_check_every`` steps: the trainer's own log-probs on a few
        of each adapter's rows (before its update, so both sides are the same policy) against vLLM's. This is the
        check that each adapter was served by its own LoRA id and that the two engines agree; without it, bypass
        mode has nothing to compare (its old log-probs are vLLM's). Diagnostics: a failure only logs."""
        dcfg = self.pcfg.diagnostics
        every = int(dcfg.logprob_check_every)
        if (
            not self._bypass_mode()
            or every <= 0
            or step % every != 0
            or not self.config.actor_rollout_ref.rollout.calculate_log_probs
        ):
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
                sample.extra_info.update(
                    {
                        ADAPTER_KEY: slot,
                        "calculate_entropy": False,
                        "compute_loss": False,
                        "temperature": self.config.actor_rollout_ref.rollout.temperature,
                    }
                )
                self.actor_rollout_wg.compute_log_prob(sample)
                data = tq.kv_batch_get(
                    keys=list(sample.keys),
                    partition_id=PARTITION,
                    select_fields=["log_probs", "rollout_log_probs", "response_mask", "responses"],
                )
                # the worker writes log-probs over the whole sequence; verl's own pass keeps the response part
                data["old_log_probs"] = response_from_nested(data.pop("log_probs"), data["response_mask"])
                m = calculate_debug_metrics(DataProto(batch=data.to_padded_tensor()))
                out[member_of[slot]] = {f"trainer_check/{k.split('/')[-1]}": float(v) for k, v in m.items()}
                out[member_of[slot]]["trainer_check/rows"] = float(n)
        except Exception as e:  # never fail a step over a diagnostic
            logger.warning("populora: trainer-vs-rollout log-prob check not computed: %s", e)
            return {}
        return out

    def _balanced_sub(
        self, all_meta: KVBatchMeta, slot: int, keys: list[str], m: dict, timing_raw: dict
    ) -> KVBatchMeta:
        sub = all_meta.select_keys(keys)
        sub.extra_info[ADAPTER_KEY] = slot
        with timed("populora_balance", timing_raw):
            if verl_compat.has_public_step_stages():
                return self.balance_batch(sub, metrics=m)
            verl_compat.private_path("_balance_batch")
            return self._balance_batch(sub, metrics=m)

    def _old_log_prob(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        """verl's old-log-prob stage (with its bypass mode) on a slot's or the fused batch."""
        if verl_compat.has_public_step_stages():
            return self.compute_old_log_prob(batch, metrics=metrics)
        verl_compat.private_path("_compute_old_log_prob")
        return self._compute_old_log_prob(batch, metrics=metrics)

    def _train_per_adapter(self, parts, all_meta, signals, member_of, metrics, timing_raw):
        """One old-log-prob and one update call per adapter slot (``+trainer.populora_fused_rpc=false``)."""
        out_keys, out_tags, per_adapter = [], [], {}
        for slot, keys in parts.items():
            member = member_of[slot]
            m: dict[str, Any] = {}
            sub = self._balanced_sub(all_meta, slot, keys, m, timing_raw)
            self._write_signals(sub, signals)
            with timed("old_log_prob", timing_raw, color="blue"):
                self._old_log_prob(sub, metrics=m)
            with timed("update_actor", timing_raw, color="red"):
                if verl_compat.has_public_step_stages():
                    self.update_actor(sub, metrics=m)  # one mini-batch: the trainer's get_actor_update_extra_info
                else:
                    verl_compat.private_path("_update_actor")
                    self._update_actor(sub, metrics=m)
            m["populora/samples"] = len(keys)
            per_adapter[member] = m
            metrics.update(convert.prefix_metrics(m, f"populora/{member}"))
            out_keys.extend(sub.keys)
            out_tags.extend(sub.tags)
        return per_adapter, KVBatchMeta(partition_id=PARTITION, keys=out_keys, tags=out_tags)

    def _dp_size(self) -> int:
        wg = self.actor_rollout_wg
        if verl_compat.has_public_dispatch_info():
            return max(wg.dispatch_info("actor")) + 1
        verl_compat.private_path("_dispatch_info")
        info = wg._dispatch_info
        if "actor" not in info:
            verl_compat.private_path("_query_dispatch_info")
            info["actor"] = wg._query_dispatch_info("actor")
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
        with timed("old_log_prob", timing_raw, color="blue"):
            shared: dict[str, Any] = {}
            self._old_log_prob(batch, metrics=shared)
            # verl's entropy / rollout-vs-trainer metrics over the whole call; per adapter below when available.
            metrics.update(convert.prefix_metrics(shared, "populora/all"))
            self._per_slot_logprob_metrics(subs, member_of, per_adapter)
        with timed("update_actor", timing_raw, color="red"):
            by_slot = self._update_actor_fused(batch)
        for slot, m in by_slot.items():
            per_adapter[member_of[slot]].update(m)
        for member, m in per_adapter.items():
            metrics.update(convert.prefix_metrics(m, f"populora/{member}"))
        return per_adapter, KVBatchMeta(partition_id=PARTITION, keys=list(batch.keys), tags=list(batch.tags))

    def _per_slot_logprob_metrics(
        self, subs: Mapping[int, KVBatchMeta], member_of: Mapping[int, str], per_adapter: dict[str, dict[str, Any]]
    ) -> None:
        """Rollout-vs-trainer log-prob agreement per adapter (the check that each adapter was served by its own
        LoRA id) from the old log-probs the fused call wrote; diagnostics, so a failure only logs."""
        if not self.config.actor_rollout_ref.rollout.calculate_log_probs or self._bypass_mode():
            return  # bypass_mode: the old log-probs are vLLM's own; _logprob_check does the real comparison
        try:
            from verl.protocol import DataProto
            from verl.utils.debug.metrics import calculate_debug_metrics

            for slot, sub in subs.items():
                data = tq.kv_batch_get(
                    keys=list(sub.keys),
                    partition_id=PARTITION,
                    select_fields=["old_log_probs", "rollout_log_probs", "response_mask", "responses"],
                )
                per_adapter[member_of[slot]].update(calculate_debug_metrics(DataProto(batch=data.to_padded_tensor())))
        except Exception as e:  # never fail a step over a diagnostic
            logger.warning("populora: per-adapter rollout/trainer log-prob metrics not computed: %s", e)

    def _update_actor_fused(self, batch: KVBatchMeta) -> dict[int, dict[str, Any]]:
        """One update call for every slot of ``batch`` (each slot one PPO mini-batch); reduced metrics per slot."""
        batch.extra_info.update(self.get_actor_update_extra_info(batch))  # sizes are replaced per slot by the worker
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
            pad_masks = dict(zip(pads, field_rows(data["response_mask"]), strict=True))
        cols = {f: [] for f in SIGNAL_FIELDS}
        for k in batch.keys:
            for f in SIGNAL_FIELDS:
                cols[f].append(
                    signals[k][f] if k in signals else torch.zeros(pad_masks[k].numel(), dtype=torch.float32)
                )
        fields = TensorDict(
            {f: torch.nested.as_nested_tensor(v, layout=torch.jagged) for f, v in cols.items()}, batch_size=len(batch)
        )
        tq.kv_batch_put(keys=list(batch.keys), partition_id=PARTITION, fields=fields)
