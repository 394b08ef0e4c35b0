"""0001: ``vLLMHttpServer.launch_server`` takes ``max_loras`` from ``rollout.engine_kwargs.vllm.max_loras`` instead of
forcing 1.

The check runs verl's own ``launch_server`` on a server object built without ``__init__`` (no Ray actor, no GPU) and
stops where it would start vLLM: ``run_server`` records the parsed arguments instead. On CPU, without vLLM, vLLM's
modules are stand-ins (tests/patches/_vllm_standin.py), the CLI parser is a recorder and the check reads the
arguments ``launch_server`` hands to vLLM's CLI. Where vLLM is installed (the GPU machine), the second test parses
them with vLLM's own ``serve`` parser and builds vLLM's ``AsyncEngineArgs`` from them, as ``run_server`` does."""

from __future__ import annotations

from pathlib import Path

from _shared import needs_vllm

PATCH = "0001-vllm-configurable-max-loras.patch"

STANDIN = (Path(__file__).parent / "_vllm_standin.py").read_text()
CLI_RECORDER = (Path(__file__).parent / "_vllm_cli_recorder.py").read_text()

LAUNCH = """
import argparse, asyncio, tempfile, types
import verl.workers.rollout.vllm_rollout.vllm_async_server as server_mod
from verl.workers.config import RolloutConfig
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

# a directory that exists: offline (HF_HUB_OFFLINE=1), vLLM's engine args look a model path that does not exist up
# on the hub, and fail there before any LoRA argument is read
MODEL_DIR = tempfile.mkdtemp(prefix="base-model-")

def launch(engine_kwargs, lora):
    # the server as vLLMReplica would start it on one node, up to the point where vLLM itself starts
    server = object.__new__(vLLMHttpServer)
    server.config = RolloutConfig(name="vllm", engine_kwargs={"vllm": engine_kwargs})
    server.model_config = types.SimpleNamespace(lora=lora, lora_rank=0, trust_remote_code=False,
                                                local_path=MODEL_DIR, hf_config=types.SimpleNamespace())
    server.node_rank, server.nnodes, server.replica_rank = 0, 1, 0
    server._disaggregation_role = "null"
    server._should_profile = lambda: False
    parsed = {}

    async def run_server(args):  # vLLM would start here
        parsed["args"] = args

    server.run_server = run_server
    asyncio.run(server.launch_server())
    return parsed["args"]
"""

CPU_CHECK = (
    STANDIN
    + LAUNCH
    + CLI_RECORDER
    + """

# max_loras configured: passed to vLLM, with max_cpu_loras (which verl always passed through)
args = launch({"max_loras": 4, "max_cpu_loras": 8}, {"rank": 8})
assert args.enable_lora and args.max_lora_rank >= 8, vars(args)
assert args.max_cpu_loras == 8, vars(args)
assert args.max_loras == 4, f"launch_server passed max_loras={args.max_loras} to vLLM (configured: 4)"
# not configured: one adapter per batch, as before
assert launch({}, {"rank": 8}).max_loras == 1
# no LoRA (or a merged one): no LoRA arguments at all
assert not hasattr(launch({"max_loras": 4}, {"rank": 0}), "enable_lora")
print("ok")
"""
)

VLLM_CHECK = (
    LAUNCH
    + """
from vllm.engine.arg_utils import AsyncEngineArgs

args = launch({"max_loras": 4, "max_cpu_loras": 8}, {"rank": 8})
engine_args = AsyncEngineArgs.from_cli_args(args)  # what run_server builds the engine from
assert engine_args.enable_lora and engine_args.max_cpu_loras == 8, engine_args
assert engine_args.max_loras == 4, f"vLLM's engine args have max_loras={engine_args.max_loras} (configured: 4)"
assert AsyncEngineArgs.from_cli_args(launch({}, {"rank": 8})).max_loras == 1
print("ok")
"""
)


def test_launch_server_passes_max_loras(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, CPU_CHECK, expect_without="passed max_loras=1 to vLLM")


@needs_vllm("its serve parser and AsyncEngineArgs")
def test_vllm_engine_args_get_max_loras(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, VLLM_CHECK, expect_without="have max_loras=1")
