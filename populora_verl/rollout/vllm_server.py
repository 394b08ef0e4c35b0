"""The ``populora_vllm`` rollout backend: one vLLM engine serving every adapter of the population.

verl 0.9.1's ``vLLMHttpServer`` forces ``max_loras=1`` and sends the fixed ``LoRARequest`` id 123 with every request
(reference §4.1). The subclasses here, registered under a new backend name (the ``vllm`` entry is process-global and
stays untouched), serve each request with the adapter it names and keep a :class:`LiveLoraRegistry` updated from the
weight-sync RPCs, consulted (with vLLM's cache) before every request: an unknown, retired or evicted id raises, and a
request without an adapter raises. The logic is in :class:`~populora_verl.rollout.routing.PopuLoRAServerMixin`, which
takes verl's public API where the installed verl has the vLLM-side patches of the series (``max_loras`` from the
engine kwargs, ``generate(lora=...)``, per-id weight sync) and on verl 0.9.1 overrides the private hooks instead.

The backend keeps its own name with the series too: verl's ``vllm`` backend builds verl's own server, which has no
live-adapter registry (a request for a retired version would be served if vLLM still cached it) and does not retire
an adapter's old versions from vLLM's cache, so the population would fill it. Replacing verl's ``vllm`` entry instead
would change every vLLM rollout in the process, and ``register_rollout`` refuses a taken name. On verl 0.9.1 the
price is the server name prefix below (a verl that names the replica's servers after ``rollout.name`` needs none).

Imports vLLM at import time: only loaded through :func:`populora_verl.rollout.register`'s lazy loader.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_PATH
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica
from vllm.lora.request import LoRARequest

from populora_verl import verl_compat
from populora_verl.rollout import early_servers
from populora_verl.rollout.engine_ports import export_engine_port
from populora_verl.rollout.routing import PopuLoRAServerMixin
from populora_verl.rollout.weight_sync import export_unique_job_id

logger = logging.getLogger(__name__)

__all__ = ["PopuLoRAvLLMHttpServer", "PopuLoRAvLLMReplica", "BACKEND_NAME"]

BACKEND_NAME = "populora_vllm"
WORKER_EXTENSION = "populora_verl.rollout.vllm_extension.PopuLoRAWorkerExtension"


class PopuLoRAvLLMHttpServer(early_servers.DeferredInit, PopuLoRAServerMixin, vLLMHttpServer):
    """``vLLMHttpServer`` with per-request adapters and a live-adapter registry (logic in ``PopuLoRAServerMixin``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if early_servers.defer(self, kwargs):
            return  # started with the trainer's set-up: verl's arguments come with populora_init (early_servers)
        super().__init__(*args, **kwargs)
        # verl 0.9.1 exported the bare Ray job id, which every local Ray cluster numbers alike: the engine's workers
        # (not started yet) must name the weight-sync socket as our ServerAdapter does (rollout.weight_sync). A verl
        # with get_weight_sync_job_id exported a host-unique one already, and its own ServerAdapter is registered.
        if not verl_compat.has_weight_sync_job_id():
            verl_compat.private_path("populora_verl.rollout.weight_sync")
            export_unique_job_id()
        # Replicas start their engines at the same moment; without a port range each, two can be handed the same
        # rendezvous port and one dies with EADDRINUSE (rollout.engine_ports). Not with vLLM's own data parallelism:
        # there verl reserves the ports, and vLLM releases that draw a list of ports loop forever under VLLM_PORT.
        # A verl with get_port_block_start set this replica's VLLM_PORT in its own __init__ already.
        if self.config.data_parallel_size == 1 and not verl_compat.has_engine_port_blocks():
            verl_compat.private_path("populora_verl.rollout.engine_ports")
            export_engine_port(self.replica_rank, ray.get_runtime_context().get_node_id())
        if verl_compat.has_per_request_lora():
            # verl's prefill/decode path forwards the request's adapter, but this backend's replica launches plain
            # servers only (verl picks its PD replica for the "vllm" name): refuse the setting, read from the config.
            if self.config.disaggregation.enabled:
                raise ValueError("populora_vllm does not support prefill/decode disaggregation")
        else:
            verl_compat.private_path("_disaggregation_role")
            if self._disaggregation_role != "null":
                raise ValueError("populora_vllm does not support prefill/decode disaggregation")
        if not self.lora_as_adapter:
            raise ValueError("populora_vllm needs model.lora_rank > 0 and lora.merge=false (adapters served by vLLM)")

    # A verl whose colocate extension loads an adapter under the caller's id keeps its own extension in vLLM's
    # workers (the mixin's collective_rpc retires old ids through vLLM); verl 0.9.1 loads ours.
    if not verl_compat.has_per_id_weight_sync():

        def _get_worker_extension_cls(self) -> str:
            verl_compat.private_path("_get_worker_extension_cls")
            return WORKER_EXTENSION

    def _make_lora_request(self, lora_id: int, name: str) -> LoRARequest:
        return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=VLLM_LORA_PATH)


class PopuLoRAvLLMReplica(vLLMReplica):
    """``vLLMReplica`` launching :class:`PopuLoRAvLLMHttpServer` actors under the backend's own name prefix."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the server actors the trainer started with its set-up, where it did (trainer.populora_early_servers)
        self.server_class = early_servers.wrap(ray.remote(PopuLoRAvLLMHttpServer))

    # verl 0.9.1's replica names its servers "vllm_..." whatever the rollout's name, while its ServerAdapter looks
    # them up as f"{rollout.name}_server_...": rename them. A verl whose replica takes the rollout's name agrees.
    if not verl_compat.has_server_name_from_rollout_name():

        def _get_server_name_prefix(self) -> str:
            verl_compat.private_path("_get_server_name_prefix")
            return f"{BACKEND_NAME}_"
