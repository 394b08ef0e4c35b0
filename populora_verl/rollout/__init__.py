"""PopuLoRA rollout: the ``populora_vllm`` backend and the ``populora_agent`` agent loop.

Registration functions (called by ``populora_verl.plugin``; idempotent; none imports vLLM):

* :func:`register_rollout` — ``RolloutReplicaRegistry["populora_vllm"]`` (lazy loader) and
  ``_ROLLOUT_REGISTRY[("populora_vllm", "async")]`` (verl's vLLM ``ServerAdapter``, which forwards our extra
  weight-sync kwargs unchanged, with a weight-sync socket unique per host: :mod:`.weight_sync`);
* :func:`register_agent_loop` — ``populora_agent`` in verl's agent-loop registry (imports verl's agent-loop module,
  about 1 s after ``import verl``);
* :func:`register` — both.

The vLLM subclasses live in :mod:`populora_verl.rollout.vllm_server` / :mod:`.vllm_extension` and are imported only
when verl asks for the backend, in processes that have vLLM.
"""

from __future__ import annotations

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


def register_rollout() -> None:
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(BACKEND_NAME, _load_replica)
    _ROLLOUT_REGISTRY[(BACKEND_NAME, "async")] = SERVER_ADAPTER_FQN


def register_agent_loop() -> None:
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.experimental.agent_loop.agent_loop import register as register_agent

    if AGENT_NAME in _agent_loop_registry:
        return
    from populora_verl.rollout.agent_loop import PopuLoRAAgentLoop

    register_agent(AGENT_NAME)(PopuLoRAAgentLoop)


def register() -> None:
    register_rollout()
    register_agent_loop()


def registered() -> dict[str, bool]:
    """``{"rollout:populora_vllm": bool, "agent_loop:populora_agent": bool}`` (reads verl's registries)."""
    import sys

    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    out = {
        f"rollout:{BACKEND_NAME}": BACKEND_NAME in RolloutReplicaRegistry._registry
        and (BACKEND_NAME, "async") in _ROLLOUT_REGISTRY,
    }
    agent_mod = sys.modules.get("verl.experimental.agent_loop.agent_loop")
    out[f"agent_loop:{AGENT_NAME}"] = bool(agent_mod and AGENT_NAME in agent_mod._agent_loop_registry)
    return out
