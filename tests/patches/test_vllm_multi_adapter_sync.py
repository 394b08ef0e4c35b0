"""0003: a LoRA adapter is pushed to vLLM under a caller's ``lora_int_id`` / ``lora_name``, from verl's own callers
down to the vLLM worker extension; without them every push replaces the one adapter under the fixed id 123.

The chain runs verl's own functions, each on an object built without ``__init__``, and hands what one stage sends to
the next: ``CheckpointEngineManager.update_weights`` (the trainer's call) -> ``ActorRolloutRefWorker.update_weights``
(the actor worker, naive colocated sync) -> ``ServerAdapter.update_weights`` (the trainer-side rollout) -> the
collective RPC to vLLM's workers -> ``vLLMColocateWorkerExtension.update_weights_from_ipc``. Stand-ins replace only
what crosses a process or touches a device: Ray's worker group and ``ray.get``, the actor's model engine, the device
memory calls, the weight sender and receiver (which hand the same tensors across), and vLLM's ``add_lora`` /
``remove_lora``. vLLM's modules are stand-ins on CPU (tests/patches/_vllm_standin.py), with the extension's LoRA
request recorded; where vLLM is installed (the GPU machine), the second test lets the extension build vLLM's own
``LoRARequest`` (verl's ``TensorLoRARequest``) and checks the id it carries."""

from __future__ import annotations

from pathlib import Path

from _shared import needs_vllm

PATCH = "0003-vllm-multi-adapter-weight-sync.patch"

STANDIN = (Path(__file__).parent / "_vllm_standin.py").read_text()

CHAIN = """
import asyncio, types
import torch
import verl.checkpoint_engine.base as ce_mod
import verl.workers.engine_workers as ew
import verl.workers.rollout.vllm_rollout.bucketed_weight_transfer as transfer
import verl.workers.rollout.vllm_rollout.utils as ext_mod
import verl.workers.rollout.vllm_rollout.vllm_rollout as adapter_mod
from verl.checkpoint_engine.base import CheckpointEngineManager
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout.vllm_rollout import ServerAdapter
from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID, VLLM_LORA_NAME, vLLMColocateWorkerExtension

PEFT = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
BASE = [("model.layers.0.self_attn.q_proj.base_layer.weight", torch.ones(4, 4))]
ADAPTER = [("model.layers.0.self_attn.q_proj.lora_A.weight", torch.full((8, 4), 1.0)),
           ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.full((4, 8), 2.0))]

# --- the trainer: CheckpointEngineManager.update_weights -> the actor worker group (one call per worker) --------
def manager_sends(**kwargs):
    sent = []
    manager = object.__new__(CheckpointEngineManager)
    manager.backend = "naive"
    manager.actor_wg = types.SimpleNamespace(update_weights=lambda **kw: sent.append(kw))
    ce_mod.ray = types.SimpleNamespace(get=lambda ref: ref)  # the worker group's call has run
    manager.update_weights(**kwargs)
    (call,) = sent
    return call

# --- the actor worker: ActorRolloutRefWorker.update_weights (naive) -> its rollout ----------------------------
class Engine:  # the actor's model engine: base weights, or the adapter with its PEFT config
    is_param_offload_enabled = False
    def __init__(self, peft_config):
        self.peft_config = peft_config
    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False):
        if self.peft_config is None:
            return iter(BASE), None
        return iter(ADAPTER if base_sync_done else BASE), self.peft_config

class Rollout:  # records each update_weights call; the weights are materialised to hand them on
    sleep_level = 2
    def __init__(self):
        self.calls = []
    async def resume(self, tags):
        pass
    async def update_weights(self, weights, **kwargs):
        self.calls.append((list(weights), kwargs))

class Device:
    def empty_cache(self):
        pass
    def synchronize(self):
        pass

ew.get_torch_device = Device
ew.set_expandable_segments = lambda enable: None
ew.log_gpu_memory_usage = lambda *args, **kwargs: None

def worker_pushes(peft_config=PEFT, peft_merge=False, **kwargs):
    worker = object.__new__(ActorRolloutRefWorker)
    rollout_config = types.SimpleNamespace(checkpoint_engine=types.SimpleNamespace(backend="naive"),
                                           free_cache_engine=False, get=lambda key, default=None: "vllm")
    worker.config = types.SimpleNamespace(rollout=rollout_config)
    worker.actor = types.SimpleNamespace(engine=Engine(peft_config))
    worker.rollout = Rollout()
    worker.peft_merge, worker.base_sync_done, worker.layered_summon = peft_merge, False, False
    asyncio.run(ActorRolloutRefWorker.update_weights(worker, **kwargs))
    return worker.rollout.calls

# --- the trainer-side rollout: ServerAdapter.update_weights -> collective RPC to the vLLM workers ---------------
class Sender:  # the bucketed IPC sender: hands the tensors to the receiver below
    def __init__(self, **kwargs):
        pass
    async def async_send_weights(self, weights):
        wire.append(list(weights))

def adapter_sends(weights, **kwargs):
    rpcs = []
    adapter = object.__new__(ServerAdapter)
    adapter.config = types.SimpleNamespace(checkpoint_engine=types.SimpleNamespace(update_weights_bucket_megabytes=1))
    adapter.zmq_handle, adapter.use_shm, adapter._has_server = "ipc:///unused", False, False
    adapter.replica_rank, adapter.rollout_rank = 0, 1

    async def execute(method, non_block=False, timeout=None, args=(), kwargs=None):
        rpcs.append((method, kwargs))

    adapter._execute_method = execute
    asyncio.run(adapter.update_weights(iter(weights), **kwargs))
    (rpc,) = rpcs
    return rpc

# --- a vLLM worker: vLLMColocateWorkerExtension.update_weights_from_ipc ----------------------------------------
class Receiver:  # the bucketed IPC receiver: one bucket per tensor, as the sender sent them
    def __init__(self, **kwargs):
        pass
    def receive_weights(self, on_bucket_received):
        tensors = wire.pop(0)
        for i, item in enumerate(tensors):
            on_bucket_received([item], is_last=i == len(tensors) - 1)

transfer.BucketedWeightReceiver = Receiver
adapter_mod.BucketedWeightSender = Sender

def extension_loads(rpc_kwargs):
    ext = object.__new__(vLLMColocateWorkerExtension)
    ext.device, ext.local_rank, ext._is_qat_model, ext._is_modelopt_qat = torch.device("cpu"), 0, False, False
    ext._get_zmq_handle = lambda: "ipc:///unused"
    events = []
    ext.remove_lora = lambda lora_id: events.append(("remove", lora_id))
    ext.add_lora = lambda request: events.append(("add", request)) or True
    ext.update_weights_from_ipc(**rpc_kwargs)
    return events

def push(**kwargs):
    # one adapter push through every stage; returns what reached the vLLM worker (remove, then add)
    global wire
    wire = []
    call = manager_sends(global_steps=7, **kwargs)
    base, adapter = worker_pushes(**call)
    assert base[1] == {"peft_config": PEFT, "base_sync_done": False, "global_steps": 7}, base[1]
    method, rpc_kwargs = adapter_sends(adapter[0], **adapter[1])
    assert method == "update_weights_from_ipc" and rpc_kwargs["peft_config"] == PEFT, (method, rpc_kwargs)
    (removed, lora_id), (added, request) = extension_loads(rpc_kwargs)
    assert removed == "remove" and added == "add", (removed, added)
    assert sorted(request_tensors(request)) == [name for name, _ in ADAPTER], request
    return call, lora_id, request
"""

RECORD_REQUEST = """
class Request:  # vLLM's LoRARequest (verl's TensorLoRARequest), recorded
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
    def __repr__(self):
        return f"LoRARequest(lora_int_id={self.lora_int_id}, lora_name={self.lora_name!r})"

ext_mod.TensorLoRARequest = Request
"""

ASSERTS = """
def request_tensors(request):
    return request.lora_tensors

# an adapter id from the trainer reaches the vLLM worker: the old version under that id is dropped, the new one loaded
call, removed, request = push(lora_int_id=1001, lora_name="slot0@v3")
assert call == {"global_steps": 7, "mode": "naive", "lora_int_id": 1001, "lora_name": "slot0@v3"}, call
assert (removed, request.lora_int_id, request.lora_name) == (1001, 1001, "slot0@v3"), (removed, request)
# a second adapter goes under its own id (the first stays resident)
assert push(lora_int_id=1002, lora_name="slot1@v3")[2].lora_int_id == 1002
# an id without a name: the adapter is named after its id
assert push(lora_int_id=1003)[2].lora_name == "1003"

# no id: every call is what verl made before, and the adapter replaces the one under the fixed id
call, removed, request = push()
assert call == {"global_steps": 7, "mode": "naive"}, call
assert (removed, request.lora_int_id, request.lora_name) == (VLLM_LORA_INT_ID, VLLM_LORA_INT_ID, VLLM_LORA_NAME)
assert "lora_int_id" not in worker_pushes(global_steps=7, mode="naive")[1][1]

# an id with no unmerged adapter to push, or with a backend that does not deliver adapters: refused
for kwargs in ({"peft_config": None}, {"peft_merge": True}):
    try:
        worker_pushes(global_steps=7, mode="naive", lora_int_id=1001, **kwargs)
    except ValueError as e:
        assert "unmerged LoRA adapter" in str(e), e
    else:
        raise AssertionError(f"update_weights(lora_int_id=...) accepted {kwargs}")
manager = object.__new__(CheckpointEngineManager)
manager.backend = "nccl"
for call in (lambda: manager.update_weights(global_steps=7, lora_int_id=1001),
             lambda: worker_pushes(global_steps=7, mode="nccl", lora_int_id=1001)):
    try:
        call()
    except NotImplementedError as e:
        assert "naive backend" in str(e), e
    else:
        raise AssertionError("a non-naive backend accepted lora_int_id")
print("ok")
"""

CPU_CHECK = STANDIN + CHAIN + RECORD_REQUEST + ASSERTS

VLLM_CHECK = CHAIN + """
from vllm.lora.request import LoRARequest

def request_tensors(request):
    assert isinstance(request, LoRARequest), type(request)
    return request.lora_tensors

call, removed, request = push(lora_int_id=1001, lora_name="slot0@v3")
assert (removed, request.lora_int_id, request.lora_name) == (1001, 1001, "slot0@v3"), (removed, request)
other = push(lora_int_id=1002, lora_name="slot1@v3")[2]
assert other.lora_int_id == 1002 and other != request, (other, request)
print("ok")
"""

# SGLang serves one adapter under a fixed name: a per-adapter id is refused, not dropped
SGLANG_CHECK = """
import ast, asyncio
from pathlib import Path
from typing import Generator
import torch

path = Path(verl.__file__).parent / "workers" / "rollout" / "sglang_rollout" / "sglang_rollout.py"
tree = ast.parse(path.read_text())
cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerAdapter")
fn = next(f for f in cls.body if isinstance(f, ast.AsyncFunctionDef) and f.name == "update_weights")
ns = {"Generator": Generator, "torch": torch}
exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), ns)

class Adapter:
    async def _init_server_adapter(self):
        raise AssertionError("SGLang's update_weights went on with a lora_int_id")

try:
    asyncio.run(ns["update_weights"](Adapter(), iter([]), peft_config={"r": 8}, base_sync_done=True, lora_int_id=1001))
except NotImplementedError as e:
    assert "vLLM rollout only" in str(e), e
print("ok")
"""


def test_adapter_id_travels_from_the_trainer_to_the_vllm_worker(fails_without_passes_with):
    out = fails_without_passes_with(PATCH, CPU_CHECK, expect_without="unexpected keyword argument 'lora_int_id'")
    assert "ok" in out


def test_sglang_refuses_an_adapter_id(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, SGLANG_CHECK, expect_without="went on with a lora_int_id")


@needs_vllm("its LoRARequest")
def test_vllm_lora_request_carries_the_adapter_id(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, VLLM_CHECK, expect_without="lora_int_id")
