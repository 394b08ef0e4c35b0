"""vLLM worker extension: weight sync that writes each adapter under its own LoRA id.

Loaded by vLLM's worker processes from the fully-qualified name returned by
``PopuLoRAvLLMHttpServer._get_worker_extension_cls()``; imports vLLM (through verl's extension) at import time, so
nothing on the CPU/driver side imports this module. Defined only for a verl whose own extension loads every adapter
under verl's fixed id (0.9.1): where it takes the caller's ``lora_int_id`` / ``lora_name``, verl's extension is loaded
and the server retires old ids itself (:class:`~populora_verl.rollout.routing.PopuLoRAServerMixin`), so the class is
absent and a stale reference to it fails at once.
"""

from __future__ import annotations

import logging

from verl.utils.vllm import TensorLoRARequest
from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_PATH, vLLMColocateWorkerExtension

from populora_verl import verl_compat
from populora_verl.rollout.lora_registry import adapter_sync_target, lora_targets, split_adapter_tensors

logger = logging.getLogger(__name__)

__all__ = [] if verl_compat.has_per_id_weight_sync() else ["PopuLoRAWorkerExtension"]


if not verl_compat.has_per_id_weight_sync():

    class PopuLoRAWorkerExtension(vLLMColocateWorkerExtension):
        """verl's colocate extension, with ``update_weights_from_ipc`` taking the target ``lora_int_id``/``lora_name``.

        Without ``lora_int_id`` (base-weight sync, full-weight sync) it is verl's method unchanged.
        """

        _populora_target: tuple[int, str] | None = None
        _populora_targets: list | None = None  # several adapters in one transfer (LoraTarget)

        def update_weights_from_ipc(
            self,
            peft_config: dict = None,
            base_sync_done=False,
            use_shm: bool = False,
            lora_int_id: int | None = None,
            lora_name: str | None = None,
            retire_lora_int_ids: list[int] | tuple[int, ...] = (),
            lora_targets: list[dict] | None = None,
        ):
            if lora_targets is not None:
                return self._populora_receive_several(peft_config, base_sync_done, use_shm, lora_targets)
            target = adapter_sync_target(peft_config, base_sync_done, lora_int_id, lora_name)
            if target is None:
                return super().update_weights_from_ipc(
                    peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm
                )
            return self._populora_load(
                peft_config, base_sync_done, use_shm, retire_lora_int_ids, [target[0]], target=target
            )

        def _populora_receive_several(self, peft_config, base_sync_done, use_shm, raw_targets):
            """Every changed adapter of a step in one transfer; tensors are named per adapter
            (:func:`populora_verl.rollout.lora_registry.tag_adapter_tensors`)."""
            if not (peft_config and base_sync_done):
                raise ValueError("lora_targets is only meaningful for an adapter sync (peft_config and base_sync_done)")
            targets = lora_targets(raw_targets)
            retire = [rid for t in targets for rid in t.retire]
            return self._populora_load(
                peft_config, base_sync_done, use_shm, retire, [t.lora_int_id for t in targets], targets=targets
            )

        def _populora_load(self, peft_config, base_sync_done, use_shm, retire, replace, *, target=None, targets=None):
            """verl's transfer, with ``_update_weights`` loading what ``target`` (one adapter) or ``targets`` (several,
            tensors named per adapter) say. Cache room first (the retired versions), then the ids to replace: vLLM's
            add_lora is a no-op for a cached id."""
            for lid in (*retire, *replace):
                self.remove_lora(int(lid))
            self._populora_target, self._populora_targets = target, targets
            try:
                return super().update_weights_from_ipc(
                    peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm
                )
            finally:
                self._populora_target = self._populora_targets = None

        def _update_weights(self, weights, peft_config: dict, base_sync_done: bool):
            verl_compat.private_path("_update_weights")
            if self._populora_targets is not None and peft_config and base_sync_done:
                groups = split_adapter_tensors(weights, [t.lora_int_id for t in self._populora_targets])
                for t in self._populora_targets:
                    self._populora_add(t.lora_int_id, t.lora_name, groups[t.lora_int_id].items(), peft_config)
                return
            target = self._populora_target
            if target is None or not (peft_config and base_sync_done):
                return super()._update_weights(weights, peft_config=peft_config, base_sync_done=base_sync_done)
            self._populora_add(*target, weights, peft_config)

        def _populora_add(self, lora_id: int, name: str, weights, peft_config: dict) -> None:
            # Clone: vLLM keeps the tensors (and may scale lora_B in place); the IPC bucket buffer is reused.
            tensors = {n: t.clone() for n, t in weights}
            request = TensorLoRARequest(
                lora_name=name,
                lora_int_id=lora_id,
                lora_path=VLLM_LORA_PATH,
                peft_config=peft_config,
                lora_tensors=tensors,
            )
            if not self.add_lora(request):
                raise RuntimeError(f"vLLM refused adapter {name} (lora_int_id {lora_id})")
            logger.info("populora: loaded adapter %s as lora_int_id %d (%d tensors)", name, lora_id, len(tensors))

        def populora_remove_loras(self, lora_int_ids: list[int]) -> list[int]:
            """Drop adapters from this worker's cache; returns the ids that were present."""
            return [int(i) for i in lora_int_ids if self.remove_lora(int(i))]
