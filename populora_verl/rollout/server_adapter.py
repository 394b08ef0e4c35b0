"""verl's vLLM ``ServerAdapter`` (the trainer side of the weight sync) with a host-unique socket.

Imports vLLM (through verl's module) at import time: verl loads it by name, only in GPU worker processes.
"""

from __future__ import annotations

from typing import Any

from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

from populora_verl import verl_compat
from populora_verl.rollout.weight_sync import current_unique_job_id, rewrite_zmq_handle

__all__ = ["PopuLoRAServerAdapter"]


class PopuLoRAServerAdapter(ServerAdapter):
    """Sends weights to ``/tmp/rl-colocate-zmq-<job>-<node>-replica-...``, the path our vLLM server's workers bind
    (:mod:`populora_verl.rollout.weight_sync`), so trainers with their own Ray clusters on one host never cross."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if verl_compat.has_weight_sync_job_id():  # verl named it uniquely already (and the server agrees)
            return
        verl_compat.private_path("populora_verl.rollout.server_adapter")
        job_id, unique = current_unique_job_id()
        self.zmq_handle = rewrite_zmq_handle(self.zmq_handle, job_id, unique)
