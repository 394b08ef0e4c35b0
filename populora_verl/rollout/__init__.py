"""PopuLoRA rollout: the ``populora_vllm`` backend and the ``populora_agent`` agent loop.

Registration functions (called by ``populora_verl.plugin``; idempotent; none imports vLLM):

* :func:`register_rollout` — ``RolloutReplicaRegistry["populora_vllm"]`` (lazy loader) and the trainer-side class
  (verl's vLLM ``ServerAdapter``, which forwards our extra weight-sync kwargs unchanged, with a weight-sync socket
  unique per host: :mod:`.weight_sync`), through verl's ``register_rollout`` where verl has it, else by writing
  verl's private ``_ROLLOUT_REGISTRY`` (:mod:`populora_verl.verl_compat`);
* :func:`register_agent_loop` — ``populora_agent`` in verl's agent-loop registry (imports verl's agent-loop module,
  about 1 s after ``import verl``);
* :func:`register` — both.

The vLLM subclasses live in :mod:`populora_verl.rollout.vllm_server` / :mod:`.vllm_extension` and are imported only
when verl asks for the backend, in processes that have vLLM.
"""

from __future__ import annotations

from populora_verl import verl_compat
from populora_verl.rollout.lora_registry import (  # noqa: F401  (pure Python, re-exported)
    LORA_ID_BASE,
    POPULORA_FIELD,
    LiveLoraRegistry,
    LoraCapacity,
    PopuLoRARoutingError,
    decode_lora_int_id,
    lora_int_id,
    lora_name,
)

BACKEND_NAME = "populora_vllm"
AGENT_NAME = "populora_agent"
# verl's ServerAdapter with a weight-sync socket that is unique per host (populora_verl.rollout.weight_sync)
SERVER_ADAPTER_FQN = "populora_verl.rollout.server_adapter.PopuLoRAServerAdapter"
VERL_SERVER_ADAPTER_FQN = "verl.workers.rollout.vllm_rollout.ServerAdapter"

__all__ = [
    "BACKEND_NAME",
    "AGENT_NAME",
    "register",
    "register_rollout",
    "register_agent_loop",
    "registered",
    "lora_int_id",
    "lora_name",
    "decode_lora_int_id",
    "LiveLoraRegistry",
    "LoraCapacity",
    "PopuLoRARoutingError",
]


def _load_replica():
    """Lazy loader for verl's ``RolloutReplicaRegistry``: imports vLLM only when the backend is used."""
    from populora_verl.rollout.vllm_server import PopuLoRAvLLMReplica

    return PopuLoRAvLLMReplica


def server_adapter_fqn() -> str:
    """The trainer-side class of the backend: verl's own ``ServerAdapter`` where verl already names the weight-sync
    socket uniquely per host, else ours, which does it."""
    return VERL_SERVER_ADAPTER_FQN if verl_compat.has_weight_sync_job_id() else SERVER_ADAPTER_FQN


def register_rollout() -> None:
    if verl_compat.has_register_rollout():
        from verl.workers.rollout.replica import register_rollout as register_verl_rollout

        register_verl_rollout(BACKEND_NAME, _load_replica, server_adapter_fqn())
        return
    # verl 0.9.1 has no function that registers the trainer-side class: write its registry directly.
    verl_compat.private_path("_ROLLOUT_REGISTRY")
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(BACKEND_NAME, _load_replica)
    _ROLLOUT_REGISTRY[(BACKEND_NAME, "async")] = server_adapter_fqn()


def agent_loop_registered(module, name: str = AGENT_NAME) -> bool:
    """Whether agent loop ``name`` is in the registry of verl's agent-loop ``module`` (already imported)."""
    if hasattr(module, "is_agent_loop_registered"):
        return module.is_agent_loop_registered(name)
    # verl 0.9.1 has no query, and its register overwrites silently: read the registry.
    verl_compat.private_path("_agent_loop_registry")
    return name in module._agent_loop_registry


def register_agent_loop() -> None:
    import verl.experimental.agent_loop.agent_loop as agent_mod

    if agent_loop_registered(agent_mod):
        return
    register_agent = agent_mod.register
    from populora_verl.rollout.agent_loop import PopuLoRAAgentLoop

    register_agent(AGENT_NAME)(PopuLoRAAgentLoop)


def register() -> None:
    register_rollout()
    register_agent_loop()


def registered() -> dict[str, bool]:
    """``{"rollout:populora_vllm": bool, "agent_loop:populora_agent": bool}`` (reads verl's registries)."""
    import sys

    out = {f"rollout:{BACKEND_NAME}": rollout_registered(BACKEND_NAME)}
    agent_mod = sys.modules.get("verl.experimental.agent_loop.agent_loop")
    out[f"agent_loop:{AGENT_NAME}"] = bool(agent_mod and agent_loop_registered(agent_mod))
    return out


def rollout_registered(name: str) -> bool:
    """Whether both halves of rollout backend ``name`` are registered with verl (replica loader, trainer class)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    if verl_compat.has_register_rollout():
        from verl.workers.rollout.base import is_rollout_class_registered

        return RolloutReplicaRegistry.is_registered(name) and is_rollout_class_registered(name)
    # verl 0.9.1's registries answer only get (which raises or imports): read them.
    verl_compat.private_path("_registry")
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY

    return name in RolloutReplicaRegistry._registry and (name, "async") in _ROLLOUT_REGISTRY
