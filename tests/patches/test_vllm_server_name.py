"""0023: vLLMReplica names its server actors after the rollout's name, the prefix ServerAdapter looks them up by, so
a backend registered under its own name that reuses vLLMReplica finds its servers (the plugin overrides the private
``_get_server_name_prefix`` on the replica and relies on ServerAdapter's for that).

Both halves are verl's own methods, run on objects built without ``__init__`` (vLLM's modules are stand-ins,
tests/patches/_vllm_standin.py): the replica's naming and the trainer side's lookup must agree for every name."""

from __future__ import annotations

from pathlib import Path

PATCH = "0023-vllm-server-name-from-rollout-name.patch"

STANDIN = (Path(__file__).parent / "_vllm_standin.py").read_text()

CHECK = (
    STANDIN
    + """
from verl.workers.config import RolloutConfig
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

def prefixes(name):
    replica, adapter = object.__new__(vLLMReplica), object.__new__(ServerAdapter)
    replica.config = adapter.config = RolloutConfig(name=name)
    return replica._get_server_name_prefix(), adapter._get_server_name_prefix()

assert prefixes("vllm") == ("vllm_", "vllm_")  # the built-in backend's names do not change
served, looked_up = prefixes("my_backend")
assert served == looked_up, f"the replica names its servers {served!r}, the trainer looks for {looked_up!r}"
print("ok")
"""
)


def test_replica_and_trainer_agree_on_server_names(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, CHECK, expect_without="the replica names its servers")
