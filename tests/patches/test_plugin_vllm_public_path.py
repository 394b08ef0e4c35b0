"""The plugin's vLLM server on verl's public API where verl has the vLLM-side patches (0001-0003, 0023), on CPU.

The check imports the plugin's real ``PopuLoRAvLLMHttpServer`` (vLLM's modules are stand-ins,
tests/patches/_vllm_standin.py) from a copy of verl with the whole series applied, with
``POPULORA_VERL_PUBLIC_ONLY=1`` so that any private fallback raises, and runs verl's own ``launch_server`` on a server
built without ``__init__`` up to where vLLM would start (as test_vllm_max_loras does): ``max_loras`` reaches vLLM's
arguments through verl, the live-adapter registry is sized from the same keys, the engine is verl's own (not wrapped).
A request is handed to verl's ``generate`` as ``lora={"lora_int_id", "lora_name"}``, and an adapter sync reaches vLLM's
workers as vLLM's ``remove_lora`` for the retired id, then verl's ``update_weights_from_ipc`` with arguments that bind to
the patched extension's signature (verl's own behaviour with them is 0002's and 0003's tests), and the replica names
its servers as the trainer side looks them up without an override of its own. Each detector also
answers yes for its own patch alone and no on pristine verl."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from _shared import REPO

STANDIN = (Path(__file__).parent / "_vllm_standin.py").read_text()
CLI_RECORDER = (Path(__file__).parent / "_vllm_cli_recorder.py").read_text()

CHECK = (
    STANDIN
    + f"""
import argparse, asyncio, inspect, os, sys, types
sys.path.insert(1, {str(REPO)!r})
os.environ["POPULORA_VERL_PUBLIC_ONLY"] = "1"

import verl.workers.rollout.vllm_rollout.vllm_async_server as server_mod
from verl.workers.config import RolloutConfig
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

from populora_verl import verl_compat
from populora_verl.rollout import vllm_extension
from populora_verl.rollout.lora_registry import StaleLoraError, lora_int_id, lora_name
from populora_verl.rollout.vllm_server import BACKEND_NAME, PopuLoRAvLLMHttpServer, PopuLoRAvLLMReplica
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

assert verl_compat.public_only()
# the replica keeps verl's server naming, which agrees with the trainer side's lookup under the backend's name
assert "_get_server_name_prefix" not in PopuLoRAvLLMReplica.__dict__
replica, adapter = object.__new__(PopuLoRAvLLMReplica), object.__new__(ServerAdapter)
replica.config = adapter.config = RolloutConfig(name=BACKEND_NAME)
assert replica._get_server_name_prefix() == adapter._get_server_name_prefix() == f"{{BACKEND_NAME}}_"
# verl's own worker extension is loaded into vLLM; the plugin's is not even defined
assert PopuLoRAvLLMHttpServer._get_worker_extension_cls is vLLMHttpServer._get_worker_extension_cls
assert not hasattr(vllm_extension, "PopuLoRAWorkerExtension")

"""
    + CLI_RECORDER
    + f"""

class Engine:  # vLLM's AsyncLLM, recording what reaches the workers
    def __init__(self):
        self.rpcs, self.loaded = [], set()
    async def list_loras(self):
        return set(self.loaded)
    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append((method, tuple(args), dict(kwargs or {{}})))
        if method == "update_weights_from_ipc":
            self.loaded.add(kwargs["lora_int_id"])

started = {{}}

async def run_server(self, args):  # vLLM would start here
    started["args"] = args
    self.engine = Engine()

verl_generate = vLLMHttpServer.generate
assert "lora" in inspect.signature(verl_generate).parameters
served = []

async def generate(self, prompt_ids, sampling_params, request_id, **kwargs):
    served.append((request_id, kwargs))
    return "tokens"

vLLMHttpServer.run_server = run_server
vLLMHttpServer.generate = generate

server = object.__new__(PopuLoRAvLLMHttpServer)
server._populora_capacity = server._populora_registry = None
server.config = RolloutConfig(name="populora_vllm", engine_kwargs={{"vllm": {{"max_loras": 4, "max_cpu_loras": 8}}}})
server.model_config = types.SimpleNamespace(lora={{"rank": 8}}, lora_rank=0, trust_remote_code=False,
                                            local_path="/models/base", hf_config=types.SimpleNamespace())
server.node_rank, server.nnodes, server.replica_rank = 0, 1, 0
server._disaggregation_role = "null"
server._should_profile = lambda: False

async def main():
    await server.launch_server()
    args = started["args"]
    assert (args.max_loras, args.max_cpu_loras) == (4, 8), vars(args)
    assert (server._populora_capacity.max_loras, server._populora_capacity.max_cpu_loras) == (4, 8)
    assert type(server.engine) is Engine  # not wrapped

    peft = {{"r": 8}}
    for version, retire in ((0, []), (1, [lora_int_id(0, 0, 4)])):
        await server.collective_rpc("update_weights_from_ipc", kwargs={{
            "peft_config": peft, "base_sync_done": True, "lora_int_id": lora_int_id(0, version, 4),
            "lora_name": lora_name(0, version), "retire_lora_int_ids": retire, "use_shm": False}})
    rpcs = server.engine.rpcs
    assert [m for m, _, _ in rpcs] == ["update_weights_from_ipc", "remove_lora", "update_weights_from_ipc"], rpcs
    assert rpcs[1][1] == (lora_int_id(0, 0, 4),)
    sync = rpcs[2][2]
    assert (sync["lora_int_id"], sync["lora_name"]) == (lora_int_id(0, 1, 4), lora_name(0, 1)), sync
    inspect.signature(vLLMColocateWorkerExtension.update_weights_from_ipc).bind(None, **sync)

    out = await server.generate([1, 2], {{}}, "r0", lora={{"lora_int_id": lora_int_id(0, 1, 4)}})
    assert out == "tokens" and served == [("r0", {{"lora": {{"lora_int_id": 1004, "lora_name": "0@v1"}}}})], served
    try:  # a retired version: the registry refuses it before verl is asked
        await server.generate([1], {{}}, "r1", lora={{"lora_int_id": lora_int_id(0, 0, 4)}})
    except StaleLoraError:
        pass
    else:
        raise AssertionError("a retired adapter was served")
    assert len(served) == 1

asyncio.run(main())
print("ok")
"""
)

FLAGS = {
    "0001-vllm-configurable-max-loras.patch": ("max_loras_from_engine_kwargs",),
    "0002-vllm-per-request-lora.patch": ("has_per_request_lora", "has_agent_loop_lora_field"),
    "0003-vllm-multi-adapter-weight-sync.patch": ("has_per_id_weight_sync",),
    "0023-vllm-server-name-from-rollout-name.patch": ("has_server_name_from_rollout_name",),
}

FLAG_CHECK = f"""
sys.path.insert(1, {str(REPO)!r})
from populora_verl import verl_compat
print({{f: getattr(verl_compat, f)() for f in {sorted(f for fs in FLAGS.values() for f in fs)!r}}})
"""


def test_the_plugin_server_takes_verl_s_public_vllm_path(check_against):
    res = check_against(CHECK)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


@pytest.fixture(scope="module")
def detector_answers(checks_against):
    """The detectors' answers on pristine verl and on each patch alone, checked side by side: patch -> process."""
    cases = [None, *FLAGS]
    code = textwrap.dedent("import sys\n" + FLAG_CHECK)
    return dict(zip(cases, checks_against([(code, (patch,) if patch else ()) for patch in cases])))


@pytest.mark.parametrize("patch", [None, *FLAGS])
def test_each_detector_answers_for_its_own_patch(detector_answers, patch):
    res = detector_answers[patch]
    assert res.returncode == 0, res.stderr[-3000:]
    flags = eval(res.stdout.strip().splitlines()[-1])  # noqa: S307  (our own dict's repr)
    assert {f for f, on in flags.items() if on} == set(FLAGS.get(patch, ())), flags
