"""PopuLoRA workers: the adapter bank (pure torch) and the verl actor/rollout worker subclass.

The worker module imports verl's worker stack, so it is not imported here: the trainer imports
``populora_verl.workers.worker`` inside its ``_init_resource_pool_mgr`` override (verl 0.9.1 has no config key for the
worker class; ``patches/0004-trainer-worker-class-from-config.patch`` proposes one). Nothing to register with verl
here.
"""

from __future__ import annotations

from populora_verl.workers.adapter_bank import AdapterBank, AdapterBankError, PlanEntry, bank_filename

__all__ = ["AdapterBank", "AdapterBankError", "PlanEntry", "bank_filename", "ADAPTER_KEY"]

#: Non-tensor batch entry (``KVBatchMeta.extra_info``) naming the slot of a compute_log_prob / update_actor call.
ADAPTER_KEY = "populora_adapter"
