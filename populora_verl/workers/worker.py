"""PopuLoRA's actor/rollout worker: verl's ``ActorRolloutRefWorker`` holding N adapters in an :class:`AdapterBank`.

* ``compute_log_prob`` / ``update_actor`` run verl's body inside ``bank.active(slot)``; the slot comes from the
  batch's non-tensor entry ``populora_adapter`` (the ``extra_info`` of the driver's ``KVBatchMeta``). A fused call
  (``populora_segments``, :mod:`populora_verl.workers.fused`) carries every adapter's rows laid out so that each rank
  holds the same number of rows per slot, and runs verl's body once per slot in that order: all ranks make the same
  FSDP forwards, which a free per-rank split would not guarantee.
* ``update_weights`` (``naive`` backend) pushes every slot to vLLM under its own LoRA id
  (:func:`populora_verl.rollout.lora_int_id`), retiring the id of a slot whose version changed.
* ONE_TO_ALL RPCs for the trainer: ``populora_init_bank``, ``populora_apply_plan`` (an evolution event: every rank
  makes the children from the parents' slots and keeps its share, with the seconds of each phase),
  ``populora_set_adapter`` (a full state into a slot), ``populora_get_adapter``, ``populora_shard_checksums``,
  ``populora_save_bank``, ``populora_load_bank``, ``populora_bank_info``.

Every override repeats verl's ``@register`` with the parent's dispatch mode: driver-callable methods are bound only
through that decorator. The FSDP engine is CUDA/NPU-only, so on CPU this class is only constructed via ``__new__``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_torch_device, set_expandable_segments
from verl.utils.profiler import log_gpu_memory_usage
from verl.workers.engine_workers import ActorRolloutRefWorker

from populora_verl import verl_compat
from populora_verl.rollout.lora_registry import lora_int_id, lora_name
from populora_verl.workers.adapter_bank import AdapterBank, AdapterBankError, bank_file_for, bank_filename
from populora_verl.workers.fused import SEGMENTS_KEY, decode_segments, segment_bounds
from populora_verl.workers.resident import LAYOUTS, ResidentAdapters

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

# attn_implementation=populora_varlen (opt-in): the worker processes build the model, so they register it here.
try:
    from populora_verl.workers.varlen_attention import register as _register_varlen

    _register_varlen()
except ImportError as _e:  # a transformers without AttentionInterface: the name stays unknown, sdpa etc. work
    logger.warning("populora: attn_implementation=populora_varlen unavailable: %s", _e)

# verl's log-prob fallback loops in Python once per token when flash-attn is missing; the worker processes run the
# actor, so they swap in the chunked one here (POPULORA_LOGPROBS=verl keeps verl's).
from populora_verl.workers.logprobs import install as _install_logprobs  # noqa: E402

if _install_logprobs():
    logger.warning("populora: verl's per-token log-prob fallback replaced by populora_verl.workers.logprobs")

# PEFT's LoRA forward costs five launches and three module calls per layer where one linear and one addmm do
# (populora_verl.workers.lora_forward): opt-in with POPULORA_LORA_FORWARD=lean, PEFT's by default.
from populora_verl.workers.lora_forward import install as _install_lora_forward  # noqa: E402

if _install_lora_forward():
    logger.info("populora: PEFT's LoRA Linear forward runs as base + addmm (populora_verl.workers.lora_forward)")

__all__ = ["PopuLoRAActorRolloutRefWorker", "ADAPTER_KEY", "slot_from_batch"]

#: Non-tensor batch entry naming the slot a compute_log_prob / update_actor call runs on.
from populora_verl.workers import ADAPTER_KEY  # noqa: E402  (one definition)


def _accelerator_ready() -> bool:
    # The memory log and device syncs below need an accelerator; the CPU wiring tests run without one.
    return bool(get_torch_device().is_available())


def _log_memory(msg: str) -> None:
    if _accelerator_ready():
        log_gpu_memory_usage(msg, logger=logger)


def slot_from_batch(data: TensorDict, *, required: bool) -> int | None:
    """Pop the slot from ``data`` (an int, or its decimal string); ``None`` only if not ``required``."""
    raw = tu.pop(data, key=ADAPTER_KEY, default=None)
    if raw is None:
        if required:
            raise AdapterBankError(
                f"batch has no '{ADAPTER_KEY}': PopuLoRA calls compute_log_prob/update_actor once per adapter slot "
                "with the slot in extra_info"
            )
        return None
    if isinstance(raw, (list, tuple)):  # a per-sample stack: all entries must agree
        if not raw or any(r != raw[0] for r in raw):
            raise AdapterBankError(f"one call mixes adapters {sorted(set(map(str, raw)))}: split the batch per slot")
        raw = raw[0]
    if isinstance(raw, bool):
        raise AdapterBankError(f"{ADAPTER_KEY} must be a slot number, got {raw!r}")
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise AdapterBankError(f"{ADAPTER_KEY} must be a slot number, got {raw!r}") from None


def _pop_segments(data: TensorDict) -> list[dict[str, int]] | None:
    raw = tu.pop(data, key=SEGMENTS_KEY, default=None)
    return None if raw is None else decode_segments(raw)


def _merge_fused_outputs(outs: Sequence[tuple[int, TensorDict | None]], *, train: bool) -> TensorDict | None:
    """A fused call's result in the shape verl's bridge and our driver expect.

    Log-probs: the segments' rows concatenated (TransferQueue writes them back under this rank's keys) with the
    last segment's metrics. Updates: ``metrics`` keyed by slot (as a string: NonTensorData keeps a dict whole).
    """
    if not outs or any(o is None for _, o in outs):
        return None  # not an output rank (verl returns None there too)
    if train:
        per_slot = {str(slot): tu.get(o, "metrics") for slot, o in outs}
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"populora_fused": per_slot}})
    metrics = tu.get(outs[-1][1], "metrics", default=None)
    parts = []
    for _, o in outs:
        tu.pop(o, key="metrics", default=None)
        parts.append(o)
    merged = tu.concat_tensordict(parts)
    if metrics is not None:
        tu.assign_non_tensor(merged, metrics=metrics)
    return merged


def _with_slot_rows(data: TensorDict, slots: Sequence[int]) -> TensorDict:
    """``data`` with a per-row tensor naming each row's slot (resident adapters route tokens by it)."""
    from populora_verl.workers.resident_engine import SLOT_FIELD

    if len(slots) != int(data.batch_size[0]):
        raise AdapterBankError(f"{len(slots)} slot tags for a batch of {int(data.batch_size[0])} rows")
    data[SLOT_FIELD] = torch.tensor(list(slots), dtype=torch.long)
    return data


class PopuLoRAActorRolloutRefWorker(ActorRolloutRefWorker):
    """``ActorRolloutRefWorker`` with an adapter bank (one live PEFT adapter swapped per call)."""

    bank: AdapterBank | None = None
    _populora_pushed: dict[int, int] | None = None  # slot -> lora_int_id vLLM currently serves for it
    _populora_signatures: dict[int, tuple[int, int]] | None = None  # resident: slot -> (version, updates) pushed

    # --- bank lifecycle --------------------------------------------------------------------------------------

    def _require_bank(self) -> AdapterBank:
        if self.bank is None:
            raise AdapterBankError(
                "adapter bank not initialised: call populora_init_bank (or populora_load_bank) first"
            )
        return self.bank

    def _build_bank(self, layout: str = "bank") -> AdapterBank | ResidentAdapters:
        if self.actor is None:
            raise AdapterBankError(f"role {self.role!r} has no actor: the adapter bank lives with the actor")
        strategy = self.config.actor.get("strategy", None) if hasattr(self.config, "actor") else None
        if strategy not in ("fsdp2", None):
            raise AdapterBankError(
                f"PopuLoRA needs actor.strategy=fsdp2 (per-adapter swaps of local shards), got {strategy!r}"
            )
        if layout not in LAYOUTS:
            raise AdapterBankError(f"adapter layout must be one of {list(LAYOUTS)}, got {layout!r}")
        engine = self.actor.engine
        optimizer, scheduler = getattr(engine, "optimizer", None), getattr(engine, "lr_scheduler", None)
        if layout == "bank":
            return AdapterBank(engine.module, optimizer, scheduler)
        from populora_verl.workers.resident_engine import install

        store = ResidentAdapters(engine.module, optimizer, scheduler)
        if torch.distributed.is_initialized() and engine.get_data_parallel_size() > 1:
            store.set_reduce_group(engine.get_data_parallel_group())
        install(engine, store)
        return store

    def _resident(self) -> bool:
        return isinstance(self.bank, ResidentAdapters)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def populora_init_bank(
        self, num_slots: int, seed: int, from_live: bool = False, shared_a: bool = False, layout: str = "bank"
    ) -> dict[str, Any]:
        """Create ``num_slots`` adapters (PEFT init from ``seed``, one lora_A for all if ``shared_a``, or copies of
        the live adapter), swapped through one live adapter (``layout="bank"``) or all resident in the model."""
        if self.bank is None or getattr(self.bank, "layout", "bank") != layout:
            self.bank = self._build_bank(layout)
        self.bank.init_slots(int(num_slots), seed=seed, from_live=from_live, shared_a=shared_a)
        self._populora_pushed = {}
        self._populora_signatures = {}
        if _accelerator_ready():
            # verl reports the worker's peak since the last reset: a new bank (a new population in a schedule)
            # starts its own figure.
            get_torch_device().reset_peak_memory_stats()
        return self._bank_info()

    def _bank_info(self) -> dict[str, Any]:
        bank = self._require_bank()
        n = bank.num_slots
        slots = []
        for k in range(n):
            info = bank.slot_info(k)
            info["lora_int_id"] = lora_int_id(k, info["version"], n)
            info["lora_name"] = lora_name(k, info["version"])
            slots.append(info)
        return {"num_slots": n, "slots": slots, "pushed": dict(self._populora_pushed or {})}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def populora_bank_info(self) -> dict[str, Any]:
        """Per slot: weight version, training updates, optimizer step and the LoRA id/name vLLM serves it under."""
        return self._bank_info()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def populora_set_adapter(
        self,
        slot: int,
        state: Mapping[str, torch.Tensor],
        reset_optimizer: bool = True,
        optimizer_from: int | None = None,
    ) -> int:
        """Overwrite a slot with a full PEFT state dict; returns the slot's new version. ``optimizer_from``: the
        slot then takes a copy of that slot's optimizer state (a child keeping its parent's moments)."""
        bank = self._require_bank()
        bank.set_adapter_state(int(slot), state, reset_optimizer=reset_optimizer)
        if optimizer_from is not None:
            bank.copy_optimizer(int(optimizer_from), int(slot))
        return bank.version(int(slot))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def populora_apply_plan(self, entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """An evolution event where the slots live (:func:`~populora_verl.workers.adapter_bank.apply_evolution_plan`):
        every rank gathers the parents' LoRA tensors, runs the operators on its accelerator and keeps its share of each
        child, so no adapter crosses a process. Returns this rank's child slots and seconds per phase."""
        timing: dict[str, float] = {}
        slots = self._require_bank().apply_plan(list(entries), timing=timing)
        return {"rank": int(self.rank), "slots": slots, "timing": timing}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def populora_get_adapter(self, slot: int) -> dict[str, torch.Tensor] | None:
        """A slot's full PEFT state dict (CPU). Every rank joins the gather; only rank 0 returns the tensors."""
        state = self._require_bank().get_adapter_state(int(slot))
        return state if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def populora_shard_checksums(self) -> dict[str, Any]:
        """This rank's per-slot shard hashes (no collective), for the per-rank 'only trained slots changed' probe."""
        return {"rank": int(self.rank), "slots": self._require_bank().shard_checksums()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def populora_save_bank(self, directory: str) -> str:
        """Write this rank's bank to ``directory/bank_world_size_{W}_rank_{r}.pt``; returns the path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, bank_filename(self.world_size, self.rank))
        self._require_bank().save(path)
        return path

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def populora_load_bank(self, directory: str, layout: str = "bank") -> dict[str, Any]:
        """Restore this rank's slots from ``directory``: either layout reads a file written by either."""
        path = bank_file_for(directory, self.world_size, self.rank)  # refuses a bank of another world size
        if self.bank is None or getattr(self.bank, "layout", "bank") != layout:
            self.bank = self._build_bank(layout)
        self.bank.load(path)
        self._populora_pushed = {}  # vLLM must get every slot again (fresh ids after a restart)
        self._populora_signatures = {}
        return self._bank_info()

    # --- per-adapter compute ---------------------------------------------------------------------------------

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        segments = _pop_segments(data)
        if segments is not None:
            return self._fused(data, segments, train=False)
        # The reference policy is the base model (no_lora_adapter): no slot needed, none swapped.
        base_only = bool(tu.get(data, key="no_lora_adapter", default=False))
        slot = slot_from_batch(data, required=not base_only)
        if slot is None:
            return super().compute_log_prob(data)
        if self._resident():
            return super().compute_log_prob(_with_slot_rows(data, [slot] * int(data.batch_size[0])))
        with self._require_bank().active(slot, train=False):
            return super().compute_log_prob(data)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data: TensorDict) -> TensorDict:
        segments = _pop_segments(data)
        if segments is not None:
            return self._fused(data, segments, train=True)
        slot = slot_from_batch(data, required=True)
        if self._resident():
            return self._resident_update(_with_slot_rows(data, [slot] * int(data.batch_size[0])))
        with self._require_bank().active(slot, train=True):
            return super().update_actor(data)

    def _fused(self, data: TensorDict, segments: list[dict[str, int]], *, train: bool) -> TensorDict | None:
        """One RPC for every adapter of a phase (:mod:`populora_verl.workers.fused`): verl's body per segment.

        Every rank holds the same segments with the same row counts, so all ranks run the same per-slot calls in
        the same order. Log-prob outputs are concatenated back in row order; update metrics come back per slot.
        """
        tu.pop(data, key=ADAPTER_KEY, default=None)
        bank = self._require_bank()
        if self._resident():
            # every slot's rows in one call: verl's body runs once, its micro-batches mix slots
            rows = [
                seg_slot
                for seg_slot, start, end, _ in segment_bounds(int(data.batch_size[0]), segments)
                for _ in range(start, end)
            ]
            data = _with_slot_rows(data, rows)
            if not train:
                return ActorRolloutRefWorker.compute_log_prob(self, data)
            return self._resident_update(data, fused=True)
        outs: list[tuple[int, TensorDict | None]] = []
        for slot, start, end, size in segment_bounds(int(data.batch_size[0]), segments):
            with torch.profiler.record_function("populora_select_slot_rows"):
                sub = tu.index_select_tensor_dict(data, list(range(start, end)))
            if train:
                # One PPO mini-batch per slot: the slot's whole sub-batch over all ranks.
                tu.assign_non_tensor(sub, global_batch_size=size, mini_batch_size=size)
                with bank.active(slot, train=True):
                    outs.append((slot, ActorRolloutRefWorker.update_actor(self, sub)))
            else:
                with bank.active(slot, train=False):
                    outs.append((slot, ActorRolloutRefWorker.compute_log_prob(self, sub)))
        return _merge_fused_outputs(outs, train=train)

    def _resident_update(self, data: TensorDict, *, fused: bool = False) -> TensorDict | None:
        """One update for every slot of ``data`` (one mini-batch: the whole call), with per-slot metrics."""
        n = int(data.batch_size[0]) * self._dp_size()
        tu.assign_non_tensor(data, global_batch_size=n, mini_batch_size=n)
        out = ActorRolloutRefWorker.update_actor(self, data)
        engine = self.actor.engine
        per_slot = engine.populora_slot_metrics()
        if out is None:
            return None
        shared = dict(tu.get(out, "metrics") or {})
        if not fused:
            return out
        metrics = {str(k): {**shared, **{f"{name}": v for name, v in m.items()}} for k, m in per_slot.items()}
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"populora_fused": metrics}})

    def _dp_size(self) -> int:
        engine = self.actor.engine
        return int(engine.get_data_parallel_size()) if torch.distributed.is_initialized() else 1

    # --- weight sync -----------------------------------------------------------------------------------------

    def _lora_targets(self) -> list[tuple[int, int, str, list[int]]]:
        """(slot, lora_int_id, lora_name, ids to retire) for every slot, in slot order."""
        bank = self._require_bank()
        pushed = self._populora_pushed if self._populora_pushed is not None else {}
        out = []
        for k in range(bank.num_slots):
            v = bank.version(k)
            lid = lora_int_id(k, v, bank.num_slots)
            old = pushed.get(k)
            out.append((k, lid, lora_name(k, v), [old] if old is not None and old != lid else []))
        return out

    async def _push_resident(self, pushed: dict[int, int], global_steps: int | None) -> None:
        """Resident slots to vLLM: those whose weights changed since their last push (trained or evolved). Through
        verl's per-id weight sync where verl has it (one transfer per adapter, each retiring its slot's old id), else
        in one transfer to the plugin's worker extension, each tensor named for its adapter."""
        from verl.utils.model import convert_weight_keys

        from populora_verl.rollout.lora_registry import LoraTarget, tag_adapter_tensors

        bank = self.bank
        peft_model = getattr(self.actor.engine.module, "_fsdp_wrapped_module", self.actor.engine.module)
        peft_config = peft_model.peft_config["default"].to_dict()
        signatures = self._populora_signatures if self._populora_signatures is not None else {}
        targets, changed = [], []
        for slot, lid, name, retire in self._lora_targets():
            info = bank.slot_info(slot)
            signature = (info["version"], info["updates"])
            if pushed.get(slot) == lid and signatures.get(slot) == signature:
                continue  # vLLM already serves these weights under this id
            targets.append(LoraTarget(lora_int_id=lid, lora_name=name, retire=tuple(retire)))
            changed.append((slot, lid, signature))
        if not targets:
            return

        def adapter_tensors(slot: int):
            return convert_weight_keys(bank.get_adapter_state(slot), peft_model).items()

        pairs = [(t, slot) for t, (slot, _, _) in zip(targets, changed, strict=True)]
        sync = {"peft_config": peft_config, "base_sync_done": True, "global_steps": global_steps}
        if verl_compat.has_per_id_weight_sync():
            # verl's worker extension loads one adapter per transfer, under the id it is given: one transfer each
            for t, slot in pairs:
                await self.rollout.update_weights(
                    iter(adapter_tensors(slot)),
                    **sync,
                    lora_int_id=t.lora_int_id,
                    lora_name=t.lora_name,
                    retire_lora_int_ids=list(t.retire),
                )
        else:
            # the plugin's worker extension: every adapter in one transfer, each tensor named for its adapter
            tagged = (x for t, slot in pairs for x in tag_adapter_tensors(t.lora_int_id, adapter_tensors(slot)))
            await self.rollout.update_weights(tagged, **sync, lora_targets=[t.as_dict() for t in targets])
        for slot, lid, signature in changed:
            pushed[slot] = lid
            signatures[slot] = signature
        self._populora_signatures = signatures

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        """verl's naive colocated sync, pushing every adapter slot under its own LoRA id.

        Mirrors ``ActorRolloutRefWorker.update_weights``' naive path (resume weights, one-off base sync, adapter
        push, offload, resume KV cache) with the adapter push looped over slots.
        """
        effective_mode = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
        if effective_mode != "naive":
            # LoRA adapters never reach vLLM through the other checkpoint engines in verl 0.9.1 (#7495).
            raise ValueError(
                f"PopuLoRA needs rollout.checkpoint_engine.backend=naive (got {effective_mode!r}; see verl #7495)"
            )
        bank = self._require_bank()
        if self.peft_merge:
            raise AdapterBankError("PopuLoRA serves adapters separately: set model.lora.merge=false")

        accel = _accelerator_ready()
        if accel:
            set_expandable_segments(False)
            get_torch_device().empty_cache()
        if self.config.rollout.free_cache_engine:
            await self.rollout.resume(tags=["weights"])
        _log_memory("populora: after resume weights")

        if not self.base_sync_done:
            base_params, base_peft_config = self.actor.engine.get_per_tensor_param(
                layered_summon=self.layered_summon, base_sync_done=False
            )
            await self.rollout.update_weights(
                base_params, peft_config=base_peft_config, base_sync_done=False, global_steps=global_steps
            )
        self.rollout.sleep_level = 1  # adapters only: vLLM keeps the base weights across sleeps

        pushed = dict(self._populora_pushed or {})
        if self._resident():
            await self._push_resident(pushed, global_steps)
        for slot, lid, name, retire in [] if self._resident() else self._lora_targets():
            with bank.active(slot, train=False):
                params, peft_config = self.actor.engine.get_per_tensor_param(
                    layered_summon=self.layered_summon, base_sync_done=True
                )
                if peft_config is None:
                    raise AdapterBankError("engine returned no peft_config: the actor has no LoRA adapter")
                await self.rollout.update_weights(
                    params,
                    peft_config=peft_config,
                    base_sync_done=True,
                    global_steps=global_steps,
                    lora_int_id=lid,
                    lora_name=name,
                    retire_lora_int_ids=retire,
                )
            pushed[slot] = lid
        self._populora_pushed = pushed
        _log_memory("populora: after update_weights")

        if self.actor.engine.is_param_offload_enabled:
            self.actor.engine.to("cpu", model=True, optimizer=False, grad=False)
        if accel:
            get_torch_device().synchronize()
            get_torch_device().empty_cache()

        if self.config.rollout.free_cache_engine:
            await asyncio.to_thread(torch.distributed.barrier)
            await self.rollout.resume(tags=["kv_cache"])
        self.base_sync_done = True
        if accel:
            set_expandable_segments(True)
        return {"populora/weight_sync/adapters": len(pushed)}
