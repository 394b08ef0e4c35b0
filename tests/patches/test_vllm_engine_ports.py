"""0017: each vLLM replica's engine searches its ports from a block of its own (``VLLM_PORT`` per replica), so engines
that start together on one node are not handed the same port (the plugin's rollout.engine_ports does the same in its
server subclass).

The check runs verl's own ``vLLMHttpServer.__init__`` on CPU: vLLM's modules are stand-ins
(tests/patches/_vllm_standin.py; ``__init__`` does not call into vLLM), the Ray runtime context reports a node id, and
the server's model-config hooks (``_init_model_config``, ``_validate_configs``, which read the model's files) are
overridden. Each replica is a process of its own, so each starts from the environment the user gave. Under vLLM's own
data parallelism (``rollout.data_parallel_size`` > 1) ``VLLM_PORT`` is left alone, as the plugin leaves it."""

from __future__ import annotations

from pathlib import Path

PATCH = "0017-vllm-engine-port-per-replica.patch"

STANDIN = (Path(__file__).parent / "_vllm_standin.py").read_text()

CHECK = STANDIN + """
import os, types
import ray
from verl.workers.config import RolloutConfig
from verl.workers.rollout.replica import RolloutMode
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

class Server(vLLMHttpServer):
    def _init_model_config(self, model_config):
        return model_config
    def _validate_configs(self):
        pass

ray.get_runtime_context = lambda: types.SimpleNamespace(get_job_id=lambda: "01000000", get_node_id=lambda: node)
ray.util.get_node_ip_address = lambda: "127.0.0.1"
user_env = dict(os.environ)

def engine_ports(replicas, dp=1, **env):
    # one server per replica on one node, as vLLMReplica starts them: the port each engine will search from
    ports = []
    for rank in range(replicas):
        os.environ.clear()
        os.environ.update(user_env, **env)
        config = RolloutConfig(name="vllm", data_parallel_size=dp)
        server = Server(config, types.SimpleNamespace(), RolloutMode.COLOCATED, [], rank, 0, 1, 1, str(rank))
        for sock in (server._master_sock, server._dp_rpc_sock, server._dp_master_sock):
            sock.close()
        ports.append(os.environ.get("VLLM_PORT"))
    return ports

user_env.pop("VLLM_PORT", None)
node = "a" * 56
ports = engine_ports(4)
print(ports)
assert None not in ports and len(set(ports)) == 4, f"4 replicas on one node search their ports from {ports}"
starts = sorted(int(p) for p in ports)
assert all(b - a >= 32 for a, b in zip(starts, starts[1:])), starts  # room for each engine's upward search
assert engine_ports(4) == ports  # the same blocks for every replica of one trainer, however often it asks
node = "b" * 56  # another trainer with its own Ray cluster on this host
assert not set(engine_ports(4)) & set(ports)
node = "a" * 56
assert engine_ports(3, VLLM_PORT="40000") == ["40000", "40032", "40064"]  # the user's VLLM_PORT stays the base
# vLLM's own data parallelism: verl reserves those ports, VLLM_PORT is left as the user set it
assert engine_ports(2, dp=2) == [None, None] and engine_ports(2, dp=2, VLLM_PORT="40000") == ["40000", "40000"]

from verl.utils.net_utils import get_port_block_start
assert get_port_block_start(0, "x", base=40000) == 40000
for bad in (dict(base=80), dict(base=65530)):
    try:
        get_port_block_start(1, "x", **bad)
    except ValueError:
        pass
    else:
        raise AssertionError(bad)
print("ok")
"""


def test_replicas_on_one_node_search_ports_of_their_own(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, CHECK, expect_without="4 replicas on one node search their ports")
