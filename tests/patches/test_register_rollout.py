"""0006: public helpers to register a rollout backend and to ask what is registered (the plugin writes verl's private
``_ROLLOUT_REGISTRY`` and reads ``RolloutReplicaRegistry._registry`` and ``_agent_loop_registry`` instead)."""

from __future__ import annotations

PATCH = "0006-rollout-register-helper.patch"

CHECK = """
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, is_agent_loop_registered, register
from verl.workers.rollout.base import BaseRollout, get_rollout_class, is_rollout_class_registered
from verl.workers.rollout.replica import RolloutReplicaRegistry, register_rollout

def load_toy():
    return "ToyReplica"

# a backend under its own name: lazy replica loader plus trainer-side class, in one call, twice (idempotent)
for _ in range(2):
    register_rollout("toy", load_toy, "verl.workers.rollout.base.BaseRollout")
assert RolloutReplicaRegistry.is_registered("toy") and RolloutReplicaRegistry.get("toy") == "ToyReplica"
assert is_rollout_class_registered("toy") and get_rollout_class("toy") is BaseRollout
assert not RolloutReplicaRegistry.is_registered("nope") and not is_rollout_class_registered("nope")
assert is_rollout_class_registered("vllm") and RolloutReplicaRegistry.is_registered("vllm")

# a name taken by another backend is refused, and the built-in stays as it was
for args in (("vllm", load_toy, "verl.workers.rollout.base.BaseRollout"),
             ("toy", load_toy, "somewhere.Else"),
             ("toy", lambda: None, "verl.workers.rollout.base.BaseRollout")):
    try:
        register_rollout(*args)
    except ValueError as e:
        assert "already registered" in str(e)
    else:
        raise AssertionError(f"register_rollout{args[:1]} replaced an existing backend")
assert RolloutReplicaRegistry.get("toy") == "ToyReplica" and get_rollout_class("toy") is BaseRollout

assert not is_agent_loop_registered("toy_loop")
@register("toy_loop")
class ToyLoop(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        raise NotImplementedError
assert is_agent_loop_registered("toy_loop")
print("ok")
"""


def test_register_and_query_a_rollout_backend(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, CHECK, expect_without="ImportError")
