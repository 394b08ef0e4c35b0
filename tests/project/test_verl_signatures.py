"""The verl integration layer on CPU: worker wiring with a fake engine, verl signature drift, upstream patches.

The FSDP engine and vLLM are GPU-only, so the worker is built with ``__new__`` around a fake engine that holds a
real tiny PEFT model; verl sources that import vLLM are checked by parsing them (``ast``), never by importing.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402

from populora_verl.rollout.lora_registry import lora_int_id  # noqa: E402
from populora_verl.workers.adapter_bank import AdapterBankError  # noqa: E402
from populora_verl.workers.worker import ADAPTER_KEY, PopuLoRAActorRolloutRefWorker  # noqa: E402

from _shared import REPO, bare_worker  # noqa: E402

VERL = Path(importlib.util.find_spec("verl").submodule_search_locations[0])

# --- worker: dispatch decorators ----------------------------------------------------------------------------

OVERRIDDEN = ["compute_log_prob", "update_actor", "update_weights"]
RPCS = ["populora_init_bank", "populora_bank_info", "populora_set_adapter", "populora_get_adapter",
        "populora_save_bank", "populora_load_bank", "populora_shard_checksums"]


def _mode_key(mode):
    """Comparable form of a dispatch mode (nd-compute modes are dicts of functools.partial)."""
    if isinstance(mode, dict):
        return {k: (v.func, v.args) if isinstance(v, functools.partial) else v for k, v in mode.items()}
    return mode


@pytest.mark.parametrize("name", OVERRIDDEN)
def test_overrides_keep_parent_dispatch(name):
    ours = getattr(getattr(PopuLoRAActorRolloutRefWorker, name), MAGIC_ATTR)
    theirs = getattr(getattr(ActorRolloutRefWorker, name), MAGIC_ATTR)
    assert getattr(PopuLoRAActorRolloutRefWorker, name) is not getattr(ActorRolloutRefWorker, name)
    assert _mode_key(ours["dispatch_mode"]) == _mode_key(theirs["dispatch_mode"])
    assert ours["blocking"] == theirs["blocking"] and ours["execute_mode"] == theirs["execute_mode"]


@pytest.mark.parametrize("name", RPCS)
def test_rpcs_are_one_to_all(name):
    attrs = getattr(getattr(PopuLoRAActorRolloutRefWorker, name), MAGIC_ATTR)
    assert attrs["dispatch_mode"] == Dispatch.ONE_TO_ALL and attrs["blocking"] is True


# --- worker: bank wiring with a fake engine -----------------------------------------------------------------


def tiny_peft():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return get_peft_model(transformers.Qwen2ForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


class FakeEngine:
    """Stands in for verl's FSDPEngine: the live model, optimizer, scheduler and the LoRA weight stream."""

    is_param_offload_enabled = False

    def __init__(self):
        self.module = tiny_peft()
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-2)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False):
        if not base_sync_done:
            return iter([("base.weight", torch.zeros(1))]), {"r": 4}
        sd = {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.module).items()}
        return iter(sd.items()), {"r": 4, "lora_alpha": 8}

    def to(self, *a, **k):
        pass


class FakeTrainingWorker:
    """verl's TrainingWorker surface used by ActorRolloutRefWorker.compute_log_prob / update_actor."""

    def __init__(self):
        self.engine = FakeEngine()

    def infer_batch(self, data):
        # A "log prob" that identifies the live adapter: the sum of its lora_A weights.
        a = sum(v.sum() for k, v in get_peft_model_state_dict(self.engine.module).items() if "lora_A" in k)
        return TensorDict({"live": a.reshape(1).repeat(data.batch_size[0])}, batch_size=data.batch_size)

    def train_mini_batch(self, data):
        ids = data["input_ids"]
        m = self.engine.module
        m(input_ids=ids, labels=ids).loss.backward()
        self.engine.optimizer.step()
        self.engine.optimizer.zero_grad(set_to_none=True)
        return TensorDict({}, batch_size=[])


def make_worker():
    return bare_worker(FakeTrainingWorker())


def batch(slot=None, **extra):
    td = TensorDict({"input_ids": torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))},
                    batch_size=[2])
    if slot is not None:
        tu.assign_non_tensor_data(td, ADAPTER_KEY, slot)
    for k, v in extra.items():
        tu.assign_non_tensor_data(td, k, v)
    return td


def test_worker_routes_calls_to_the_named_slot():
    w = make_worker()
    with pytest.raises(AdapterBankError, match="populora_init_bank"):
        w.compute_log_prob(batch(0))
    info = w.populora_init_bank(3, seed=5)
    assert info["num_slots"] == 3 and [s["lora_int_id"] for s in info["slots"]] == [1000, 1001, 1002]
    sums = [w.compute_log_prob(batch(k))["live"][0].item() for k in range(3)]
    assert len(set(sums)) == 3
    assert w.compute_log_prob(batch("1"))["live"][0].item() == sums[1]
    with pytest.raises(AdapterBankError, match="no 'populora_adapter'"):
        w.compute_log_prob(batch())
    # Reference log-probs run on the base model: no slot needed.
    w.compute_log_prob(batch(no_lora_adapter=True))
    before = [w.populora_get_adapter(k) for k in range(3)]
    w.update_actor(batch(2))
    after = [w.populora_get_adapter(k) for k in range(3)]
    for k in (0, 1):
        assert all(torch.equal(before[k][n], after[k][n]) for n in before[k])
    assert any(not torch.equal(before[2][n], after[2][n]) for n in before[2])
    assert w.populora_bank_info()["slots"][2]["optimizer_step"] == 1
    with pytest.raises(AdapterBankError, match="no 'populora_adapter'"):
        w.update_actor(batch())


def test_worker_weight_sync_pushes_every_slot_under_its_id(tmp_path):
    w = make_worker()
    w.populora_init_bank(3, seed=5)
    w.update_actor(batch(1))
    asyncio.run(w.update_weights(global_steps=1))
    base, *adapters = w.rollout.pushes
    assert base[1]["base_sync_done"] is False and "lora_int_id" not in base[1]
    assert [kw["lora_int_id"] for _, kw in adapters] == [1000, 1001, 1002]
    assert [kw["lora_name"] for _, kw in adapters] == ["0@v0", "1@v0", "2@v0"]
    for k, (tensors, kw) in enumerate(adapters):
        ref = w.populora_get_adapter(k)
        assert tensors.keys() == ref.keys() and all(torch.equal(tensors[n], ref[n]) for n in ref)
        assert kw["retire_lora_int_ids"] == [] and kw["base_sync_done"] is True
    # Evolution replaces slot 1: the next sync serves it under a new id and retires the old one.
    child = {n: t + 1 for n, t in w.populora_get_adapter(0).items()}
    assert w.populora_set_adapter(1, child) == 1
    w.rollout.pushes.clear()
    asyncio.run(w.update_weights(global_steps=2))
    ids = [(kw["lora_int_id"], kw["retire_lora_int_ids"]) for _, kw in w.rollout.pushes]
    assert ids == [(1000, []), (lora_int_id(1, 1, 3), [1001]), (1002, [])]
    assert all(torch.equal(w.rollout.pushes[1][0][n], child[n]) for n in child)
    # Save / load round trip through the RPCs (one file per rank).
    path = w.populora_save_bank(str(tmp_path))
    assert path.endswith("bank_world_size_1_rank_0.pt")
    w2 = make_worker()
    info = w2.populora_load_bank(str(tmp_path))
    assert [s["lora_int_id"] for s in info["slots"]] == [1000, lora_int_id(1, 1, 3), 1002]
    with pytest.raises(ValueError, match="naive"):
        asyncio.run(w.update_weights(mode="nccl"))


def test_worker_shard_checksums_and_world_size_change(tmp_path):
    w = make_worker()
    w.populora_init_bank(3, seed=5)
    before = w.populora_shard_checksums()
    w.update_actor(batch(2))
    after = w.populora_shard_checksums()
    assert before["rank"] == after["rank"] == 0
    assert [k for k in range(3) if before["slots"][k] != after["slots"][k]] == [2]
    w.populora_save_bank(str(tmp_path))
    w4 = make_worker()
    w4._rank, w4._world_size = 1, 4  # the same checkpoint resumed on 4 GPUs
    with pytest.raises(AdapterBankError, match="saved by 1 rank\\(s\\) but this run has 4"):
        w4.populora_load_bank(str(tmp_path))


def test_worker_rejects_fsdp1():
    w = make_worker()
    w.config.actor.strategy = "fsdp"
    with pytest.raises(AdapterBankError, match="fsdp2"):
        w.populora_init_bank(2, seed=0)


# --- signature drift ----------------------------------------------------------------------------------------

# Every public verl method we override, call with extra kwargs, or whose behaviour we depend on, as ``ast.unparse``
# of its arguments in verl 0.9.1. A change here means our subclass may silently stop matching verl: re-read the
# method. Private names (methods included) are pinned from populora_verl/verl_private.py further down.
EXPECTED = {
    # the trainer's public overrides (PopuLoRATrainer replaces the step wholesale)
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer.step"): "self, metrics: dict, timing_raw: dict",
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer.init"): "self",
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer.on_step_end"): "self",
    ("workers/engine_workers.py", "ActorRolloutRefWorker.compute_log_prob"): "self, data: TensorDict",
    ("workers/engine_workers.py", "ActorRolloutRefWorker.update_actor"): "self, data: TensorDict",
    ("workers/engine_workers.py", "ActorRolloutRefWorker.update_weights"): "self, global_steps: int=None, mode: str='auto'",
    ("workers/engine_workers.py", "ActorRolloutRefWorker.init_model"): "self",
    ("workers/engine/fsdp/transformer_impl.py", "FSDPEngine.get_per_tensor_param"):
        "self, layered_summon=False, base_sync_done=False, **kwargs",
    # the resident adapters' engine mixin (populora_verl.workers.resident_engine) overrides these
    ("workers/engine/fsdp/transformer_impl.py", "FSDPEngine.forward_backward_batch"):
        "self, data: TensorDict, loss_function: Callable, forward_only=False",
    ("workers/engine/fsdp/transformer_impl.py", "FSDPEngineWithLMHead.forward_step"):
        "self, micro_batch: TensorDict, loss_function, forward_only",
    ("workers/engine/fsdp/transformer_impl.py", "FSDPEngine.optimizer_zero_grad"): "self",
    ("workers/engine/fsdp/transformer_impl.py", "FSDPEngine.optimizer_step"): "self",
    ("workers/engine/fsdp/transformer_impl.py", "FSDPEngine.lr_scheduler_step"): "self",
    ("workers/engine/fsdp/transformer_impl.py", "FSDPEngine.disable_adapter"): "self",
    ("workers/rollout/vllm_rollout/vllm_rollout.py", "ServerAdapter.update_weights"):
        "self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int=None, "
        "wire_format: str='named_tensors', **kwargs",
    ("workers/rollout/vllm_rollout/vllm_async_server.py", "vLLMHttpServer.generate"):
        "self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, "
        "image_data: Optional[list[Any]]=None, video_data: Optional[list[Any]]=None, "
        "audio_data: Optional[list[Any]]=None, mm_processor_kwargs: Optional[dict[str, Any]]=None, "
        "priority: int=0, kv_transfer_params: Optional[dict]=None",
    ("workers/rollout/vllm_rollout/vllm_async_server.py", "vLLMHttpServer.collective_rpc"):
        "self, method: str | Callable, timeout: float | None=None, args: tuple=(), kwargs: dict[str, Any] | None=None",
    ("workers/rollout/vllm_rollout/vllm_async_server.py", "vLLMHttpServer.run_server"): "self, args: argparse.Namespace",
    ("workers/rollout/vllm_rollout/vllm_async_server.py", "vLLMHttpServer.run_headless"): "self, args: argparse.Namespace",
    ("workers/rollout/vllm_rollout/vllm_async_server.py", "vLLMReplica.__init__"):
        "self, replica_rank: int, config: RolloutConfig, model_config: HFModelConfig, gpus_per_node: int=8, "
        "is_reward_model: bool=False, is_teacher_model: bool=False, name_suffix: str=''",
    ("workers/rollout/vllm_rollout/utils.py", "vLLMColocateWorkerExtension.update_weights_from_ipc"):
        "self, peft_config: dict=None, base_sync_done=False, use_shm: bool=False",
    ("experimental/agent_loop/agent_loop.py", "AgentLoopBase.ct_build_initial_tokens"):
        "self, messages: list[dict], tools: list[dict]=None, images: list[Image.Image]=None, "
        "videos: list[tuple[torch.Tensor, dict]]=None, audios: list[Any]=None, mm_inputs_out: dict[str, Any]=None",
    ("experimental/agent_loop/single_turn_agent_loop.py", "SingleTurnAgentLoop.run"):
        "self, sampling_params: dict[str, Any], priority: int=0, **kwargs",
    # the request load balancer started early (populora_verl.rollout.early_agent_loop) subclasses verl's and takes
    # the servers through add_servers
    ("workers/rollout/router.py", "GlobalRequestLoadBalancer.__init__"):
        "self, servers: dict[str, ray.actor.ActorHandle], max_cache_size: int=DEFAULT_ROUTING_CACHE_SIZE, "
        "full_determinism: bool=False",
    ("workers/rollout/router.py", "GlobalRequestLoadBalancer.add_servers"): "self, servers: dict[str, ray.actor.ActorHandle]",
    ("workers/rollout/llm_server.py", "LLMServerClient.generate"):
        "self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, Any], "
        "image_data: Optional[list[Any]]=None, video_data: Optional[list[Any]]=None, "
        "audio_data: Optional[list[Any]]=None, mm_processor_kwargs: Optional[dict[str, Any]]=None, **kwargs: Any",
}

# Source facts our subclasses rely on (regexes over verl's files).
EXPECTED_SOURCE = [
    # why PopuLoRATrainer resets trainer_mode to "sync" and rebuilds its replay buffer
    ("trainer/ppo/v1/trainer_base.py", r"self\.trainer_mode = self\.config\.trainer\.v1\.trainer_mode"),
    ("trainer/ppo/v1/trainer_base.py", r'ReplayBuffer if self\.trainer_mode == "sync" else ReplayBufferAsync'),
    ("workers/rollout/vllm_rollout/vllm_async_server.py", r'"max_loras": 1,'),  # why run_server re-sets it
    ("workers/rollout/vllm_rollout/vllm_async_server.py", r"self\.engine\.generate\(\s*prompt=prompt,.*?lora_request=lora_request"),
    ("workers/rollout/vllm_rollout/vllm_rollout.py", r'"update_weights_from_ipc",\s*non_block=True,\s*kwargs=\{\*\*kwargs'),
    ("workers/rollout/vllm_rollout/vllm_rollout.py", r"return f\"\{self\.config\.get\('name', 'vllm'\)\}_\""),
    ("workers/rollout/vllm_rollout/utils.py", r"self\.remove_lora\(VLLM_LORA_INT_ID\)"),
    ("experimental/agent_loop/single_turn_agent_loop.py", r"self\.server_manager\.generate\("),
    # resident adapters: verl's loss reads the mini-batch's token and row counts from these non-tensor keys, and the
    # engine hands the loss function the micro-batch with its model output by keyword
    ("workers/utils/losses.py", r'config\.global_batch_info\["batch_num_tokens"\] = data\["batch_num_tokens"\]'),
    ("workers/utils/losses.py", r'config\.global_batch_info\["global_batch_size"\] = data\["global_batch_size"\]'),
    ("workers/engine/fsdp/transformer_impl.py",
     r"loss_function\(\s*model_output=model_output, data=micro_batch, dp_group=self\.get_data_parallel_group\(\)"),
    # the early balancer replaces verl's after init: the client is built afterwards, from the manager's attribute,
    # and the servers' addresses and handles are lists in the same order
    ("trainer/main_ppo.py", r"self\.trainer\.init\(\)\s*self\.init_agent_loop_manager\(\)"),
    ("trainer/main_ppo.py", r"llm_client=self\.trainer\.get_llm_client\(\)"),
    ("workers/rollout/llm_server.py", r"load_balancer_handle=self\.global_load_balancer"),
    ("workers/rollout/llm_server.py",
     r"self\.server_handles = \[server\._server_handle for server in self\.rollout_replicas\]\s*"
     r"self\.server_addresses = \[server\._server_address for server in self\.rollout_replicas\]"),
    # the early server actors (populora_verl.rollout.early_servers): verl's replica creates each server through its
    # public server_class with these options and names; a difference only means verl's order, but silently
    ("workers/rollout/vllm_rollout/vllm_async_server.py",
     r"server = self\.server_class\.options\(\s*scheduling_strategy=ray\.util\.scheduling_strategies\."
     r"NodeAffinitySchedulingStrategy\(\s*node_id=node_id,\s*soft=False,\s*\),\s*"
     r"runtime_env=\{\"env_vars\": env_vars\},\s*name=name,\s*max_concurrency=self\.max_concurrency,\s*\)\.remote\("),
    ("workers/rollout/vllm_rollout/vllm_async_server.py",
     r'name = f"\{prefix\}server_\{self\.replica_rank\}_\{node_rank\}\{self\.name_suffix\}"'),
    ("workers/rollout/vllm_rollout/vllm_async_server.py",
     r'\*\*\{var: "1" for var in get_platform\(\)\.ray_noset_envvars\(\)\},\s*\*\*get_platform\(\)\.rollout_env_vars\(\),'),
    ("workers/rollout/replica.py", r"return max\(1000, self\.config\.max_num_seqs \+ CONTROL_METHOD_CONCURRENCY\)"),
    ("utils/model.py", r"def convert_weight_keys\(state_dict: dict\[str, torch\.Tensor\], model: PreTrainedModel\)"),
]


def _signature(relpath: str, qualname: str) -> str:
    tree = ast.parse((VERL / relpath).read_text())
    cls_name, fn_name = qualname.split(".")
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == fn_name:
                    return ast.unparse(item.args)
    raise AssertionError(f"verl no longer defines {qualname} in {relpath}")


@pytest.mark.parametrize("key", list(EXPECTED), ids=[k[1] for k in EXPECTED])
def test_verl_signature_unchanged(key):
    assert _signature(*key) == EXPECTED[key], f"verl changed {key[1]}: review our override / call site"


@pytest.mark.parametrize("relpath,pattern", EXPECTED_SOURCE)
def test_verl_source_facts(relpath, pattern):
    assert re.search(pattern, (VERL / relpath).read_text(), re.S), f"{relpath}: {pattern!r} no longer holds"


def test_verl_version_pinned():
    from importlib.metadata import version

    assert version("verl") == "0.9.1", "signatures above were recorded for verl 0.9.1"


def test_runtime_signatures_of_importable_overrides():
    # For classes importable on CPU, the live signature matches the parsed one (the ast check reads the right file).
    import inspect

    sig = inspect.signature(ActorRolloutRefWorker.update_weights.__wrapped__)
    # ray.remote(cls) (the trainer tests build one) injects a `_ray_trace_ctx` keyword into the class's methods
    params = [p for name, p in sig.parameters.items() if name != "_ray_trace_ctx"]
    assert str(sig.replace(parameters=params)) == "(self, global_steps: int = None, mode: str = 'auto')"


# --- private verl names: one list (populora_verl/verl_private.py), pinned and proved complete ---------------------

from populora_verl import verl_private  # noqa: E402

PACKAGE = REPO / "populora_verl"
# Classes our code mixes into a verl class at run time (invisible to a static scan of base classes).
DYNAMIC_BASES = {
    # resident_engine.install: engine.__class__ = type(..., (ResidentEngineMixin, type(engine)), ...)
    "populora_verl.workers.resident_engine:ResidentEngineMixin":
        ["verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead"],
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_of(root: Path, path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def _imports(tree: ast.Module, module: str, is_pkg: bool) -> dict[str, str]:
    """Local name -> ``dotted.module`` (a module) or ``dotted.module:Name`` (a name), from every import."""
    out: dict[str, str] = {}
    package = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                out[a.asname or a.name] = f"{base}:{a.name}"
    return out


def _verl_relpath(dotted: str) -> str | None:
    base = VERL.parent.joinpath(*dotted.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return str(p.relative_to(VERL))
    return None


@functools.lru_cache(maxsize=None)
def _verl_parsed(relpath: str):
    tree = ast.parse((VERL / relpath).read_text(encoding="utf-8"))
    module, is_pkg = _module_of(VERL, VERL / relpath)
    return tree, _imports(tree, module, is_pkg)


def _base(expr: ast.expr, imports: dict[str, str], module: str) -> str | None:
    if isinstance(expr, ast.Name):
        return imports.get(expr.id, f"{module}:{expr.id}")
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id in imports:
        return f"{imports[expr.value.id].replace(':', '.')}:{expr.attr}"
    return None


def _class_own(node: ast.ClassDef) -> set[str]:
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and \
                isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"):
            names.add(sub.attr)
    return names


@functools.lru_cache(maxsize=None)
def verl_members(target: str) -> dict[str, str]:
    """``verl.mod:Class`` -> {member: ``relpath:Class`` defining it}: methods, class attributes and ``self.x``
    assignments, through its verl base classes (the most derived definition wins)."""
    dotted, cls = target.split(":")
    relpath = _verl_relpath(dotted)
    if relpath is None:
        return {}
    tree, imports = _verl_parsed(relpath)
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:  # re-exported by this module: follow the import
        fwd = imports.get(cls)
        return verl_members(fwd) if fwd and fwd.startswith("verl.") and fwd != target else {}
    out: dict[str, str] = {}
    for base in reversed(node.bases):
        b = _base(base, imports, dotted)
        if b and b.startswith("verl."):
            out.update(verl_members(b))
    out.update({n: f"{relpath}:{cls}" for n in _class_own(node)})
    return out


def _module_names(tree: ast.Module) -> set[str]:
    names = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
    return names


def _defined(trees) -> set[str]:
    """Every name the trees define anywhere: functions, classes, assigned names and assigned attributes."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


@functools.lru_cache(maxsize=None)
def _all_verl_private() -> frozenset[str]:
    trees = []
    for p in VERL.rglob("*.py"):
        if "tests" not in p.relative_to(VERL).parts:
            try:
                trees.append(ast.parse(p.read_text(encoding="utf-8")))
            except (SyntaxError, UnicodeDecodeError):
                continue
    return frozenset(n for n in _defined(trees) if _private(n))


def _class_items(node: ast.ClassDef):
    """The statements of a class body, including those under an ``if`` (a method defined only for an older verl,
    populora_verl/verl_compat.py)."""
    todo = list(node.body)
    while todo:
        item = todo.pop(0)
        if isinstance(item, ast.If):
            todo[:0] = item.body + item.orelse
        else:
            yield item


def scan_private_uses(package: Path = PACKAGE) -> set[tuple[str, str, str, str]]:
    """(kind, name, plugin module, owner) for every private verl name the package's source names.

    * ``override``: a method of a class with a verl ancestor (or of a mixin combined with one) that replaces a
      private member of that ancestor;
    * ``use``: ``self.x`` / ``cls.x`` in such a class where verl's ancestor defines ``x``; ``Name.x`` where ``Name``
      is imported from verl; any other ``obj.x`` where verl defines ``x`` somewhere and our package nowhere (owner
      ``?``: the object's class is not known statically);
    * ``import``: a private name imported from a verl module.
    """
    files = {}
    for p in package.rglob("*.py"):
        module, is_pkg = _module_of(package, p)
        tree = ast.parse(p.read_text(encoding="utf-8"))
        files[module] = (tree, _imports(tree, module, is_pkg))
    classes = {f"{m}:{n.name}": (m, n) for m, (tree, _) in files.items() for n in ast.walk(tree)
               if isinstance(n, ast.ClassDef)}
    ours = _defined(tree for tree, _ in files.values())

    @functools.lru_cache(maxsize=None)
    def ancestors(key: str) -> tuple[frozenset[str], frozenset[str]]:
        module, node = classes[key]
        plugin, verl = {key}, set(DYNAMIC_BASES.get(key, ()))
        for base in node.bases:
            b = _base(base, files[module][1], module)
            if b is not None and b.startswith("verl."):
                verl.add(b)
            elif b in classes:
                p, v = ancestors(b)
                plugin, verl = plugin | p, verl | v
        return frozenset(plugin), frozenset(verl)

    family: dict[str, set[str]] = {k: set() for k in classes}
    for key in classes:
        plugin, verl = ancestors(key)
        for a in plugin:  # a mixin answers for every verl class it is combined with
            family[a] |= verl
    found = set()
    for module, (tree, imports) in files.items():
        on_self = set()
        for key, (m, node) in classes.items():
            members: dict[str, str] = {}
            for b in sorted(family[key]):
                for name, owner in verl_members(b).items():
                    members.setdefault(name, owner)
            if m != module or not members:
                continue
            for item in _class_items(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name) and \
                        item.name in members:
                    found.add(("override", item.name, module, members[item.name]))
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and \
                        sub.value.id in ("self", "cls"):
                    on_self.add(id(sub))
                    if _private(sub.attr) and sub.attr in members:
                        found.add(("use", sub.attr, module, members[sub.attr]))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("verl"):
                found |= {("import", a.name, module, _verl_relpath(node.module) or "?")
                          for a in node.names if _private(a.name)}
            elif isinstance(node, ast.Attribute) and _private(node.attr) and id(node) not in on_self:
                target = imports.get(node.value.id) if isinstance(node.value, ast.Name) else None
                if target is not None and target.startswith("verl."):
                    if ":" in target:
                        owner = verl_members(target).get(node.attr, "?")
                    else:
                        rel = _verl_relpath(target)
                        owner = rel if rel and node.attr in _module_names(_verl_parsed(rel)[0]) else "?"
                    found.add(("use", node.attr, module, owner))
                elif node.attr not in ours and node.attr in _all_verl_private():
                    found.add(("use", node.attr, module, "?"))
    return found


def _listed() -> set[tuple[str, str, str, str]]:
    return {(kind, e.name, module, e.owner) for e in verl_private.PRIVATE for kind, module in e.uses}


def test_private_list_is_complete_and_current():
    scanned = scan_private_uses()
    listed = {x for x in _listed() if x[0] != "relies"}
    # A use whose owner the scan cannot know statically matches any listed owner of that name.
    unknown = {(k, n, m) for k, n, m, o in scanned if o == "?"}
    missing = sorted(x for x in scanned if x[3] != "?" and x not in listed)
    missing += sorted(x for x in unknown if not any(y[:3] == x for y in listed))
    stale = sorted(x for x in listed if x not in scanned and x[:3] not in unknown)
    assert not missing, ("private verl names used but not listed in populora_verl/verl_private.py "
                         "(add them, with why and the patch that removes them):\n" + "\n".join(map(str, missing)))
    assert not stale, "listed in populora_verl/verl_private.py but no longer used:\n" + "\n".join(map(str, stale))


def test_private_list_entries_are_well_formed():
    patches = {p.name for p in (REPO / "patches").glob("*.patch")}
    seen = set()
    for e in verl_private.PRIVATE:
        assert (e.name, e.owner) not in seen, f"{e.name} at {e.owner} listed twice"
        seen.add((e.name, e.owner))
        assert _private(e.name) and e.uses and e.why
        assert all(kind in ("override", "use", "import", "relies") for kind, _ in e.uses), e
        assert e.removed_by in patches or e.removed_by == "", f"{e.name}: no patch {e.removed_by!r} in patches/"
    for rp in verl_private.RUNTIME_PATCHES:
        assert (PACKAGE.parent / (rp.module.replace(".", "/") + ".py")).is_file(), rp.module
        assert rp.removed_by in patches or rp.removed_by == "", f"{rp.module}: no patch {rp.removed_by!r}"


def _owner_node(owner: str):
    relpath, _, cls = owner.partition(":")
    assert (VERL / relpath).is_file(), f"verl no longer has {relpath}"
    tree = _verl_parsed(relpath)[0]
    if not cls:
        return tree, None
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    assert node is not None, f"verl no longer defines class {cls} in {relpath}"
    return tree, node


@pytest.mark.parametrize("entry", verl_private.PRIVATE, ids=[f"{e.owner.rpartition(':')[2] or e.owner}.{e.name}"
                                                            for e in verl_private.PRIVATE])
def test_private_name_unchanged(entry):
    tree, node = _owner_node(entry.owner)
    if node is None:
        assert entry.name in _module_names(tree), f"verl no longer defines {entry.name} in {entry.owner}"
        return
    assert entry.name in _class_own(node), (
        f"verl {verl_private.VERL_VERSION} defined {entry.name} in {entry.owner}; it is gone: "
        f"re-read our use ({entry.why})")
    if entry.signature is not None:
        fn = next(i for i in node.body if isinstance(i, (ast.FunctionDef, ast.AsyncFunctionDef)) and i.name == entry.name)
        assert ast.unparse(fn.args) == entry.signature, f"verl changed {entry.owner}.{entry.name}: review our use"


def test_scan_catches_a_new_private_override(tmp_path):
    # The completeness check is only as good as the scan: a planted override, a read through an imported verl class
    # and an imported private name are each reported with their verl owner.
    pkg = tmp_path / "plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mixin.py").write_text("class M:\n    def _compute_advantage(self, batch, metrics):\n        return batch\n")
    (pkg / "t.py").write_text(
        "from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync\n"
        "from verl.workers.rollout.replica import RolloutReplicaRegistry\n"
        "from verl.workers.rollout.base import _ROLLOUT_REGISTRY\n"
        "from plugin.mixin import M\n"
        "class T(M, PPOTrainerSync):\n"
        "    def _mine(self):\n        return self._mine_too, self.config\n"
        "def f(wg):\n    return RolloutReplicaRegistry._registry, wg._dispatch_info, wg._ours\n")
    got = scan_private_uses(pkg)
    assert got == {
        ("override", "_compute_advantage", "plugin.mixin", "trainer/ppo/v1/trainer_base.py:PPOTrainer"),
        ("use", "_registry", "plugin.t", "workers/rollout/replica.py:RolloutReplicaRegistry"),
        ("use", "_dispatch_info", "plugin.t", "?"),
        ("import", "_ROLLOUT_REGISTRY", "plugin.t", "workers/rollout/base.py"),
    }


# --- upstream patches ---------------------------------------------------------------------------------------

PATCHES = sorted((REPO / "patches").glob("*.patch"))


def test_patches_exist_and_are_documented():
    readme = (REPO / "patches" / "README.md").read_text()
    assert len(PATCHES) >= 4
    for p in PATCHES:
        assert p.name in readme, f"{p.name} missing from patches/README.md"
    for issue in ("#7909", "#4421", "#7495"):
        assert issue in readme
    for target in re.findall(r"\]\(([^)#]+)", readme):  # relative links resolve
        assert (REPO / "patches" / target).exists(), f"patches/README.md links to a missing file: {target}"
    # each patch's row names its behavioural test under tests/patches/ (which exists and tests that patch), or says
    # why it has none
    rows = {line.split("`")[1]: line for line in readme.splitlines() if line.startswith("| `0")}
    assert sorted(rows) == [p.name for p in PATCHES]
    for name, row in rows.items():
        tests = re.findall(r"`(tests/patches/test_\w+\.py)", row)
        assert tests or "applies and parses only" in row, f"{name}: no test named in patches/README.md"
        for t in tests:
            assert f'PATCH = "{name}"' in (REPO / t).read_text(), f"{t} does not test {name}"


@pytest.mark.skipif(shutil.which("patch") is None, reason="`patch` not installed")
@pytest.mark.parametrize("patch_file", PATCHES, ids=[p.name for p in PATCHES])
def test_patch_applies_to_installed_verl(patch_file, tmp_path):
    text = patch_file.read_text()
    targets = re.findall(r"^\+\+\+ b/(\S+)", text, re.M)
    assert targets, f"{patch_file.name} is not a unified diff with b/ paths"
    for t in targets:  # a copy of the installed package tree, restricted to the files the patch touches
        src = VERL.parent / t
        assert src.exists(), f"{patch_file.name} targets {t}, absent from the installed verl"
        (tmp_path / t).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, tmp_path / t)
    res = subprocess.run(["patch", "-p1", "--dry-run", "-i", str(patch_file)], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "fuzz" not in res.stdout.lower() and "offset" not in res.stdout.lower(), res.stdout
    # Applied for real, the patched modules and configs still parse.
    subprocess.run(["patch", "-p1", "-s", "-i", str(patch_file)], cwd=tmp_path, check=True)
    for t in targets:
        _parses(tmp_path / t)


def _parses(path: Path) -> None:
    if path.suffix == ".py":
        ast.parse(path.read_text())
    elif path.suffix == ".yaml":
        import yaml

        yaml.safe_load(path.read_text())
    else:
        raise AssertionError(f"a patch touches {path.name}: add a parse check for its kind")


def test_worker_module_imports_without_vllm():
    # This module imported the worker and registered nothing that needs vLLM: neither may pull vLLM in.
    import populora_verl.rollout as rollout

    rollout.register_rollout()
    assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)


def test_the_series_detectors_are_every_detector_of_verl_compat():
    """verl_compat's list of the series' detectors (used by the series-applied test and the GPU series proof) names
    every detector it defines, and they all answer no on verl 0.9.1."""
    from populora_verl import verl_compat

    functions = {n for n, obj in vars(verl_compat).items() if not n.startswith("_") and callable(obj)
                 and not isinstance(obj, type) and getattr(obj, "__module__", None) == verl_compat.__name__}
    assert set(verl_compat.SERIES_DETECTORS) == functions - {"private_path", "public_only", "series_detected"}
    assert not any(verl_compat.series_detected().values())
