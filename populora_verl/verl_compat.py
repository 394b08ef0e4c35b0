"""Which public verl APIs of the upstream series (patches/) the installed verl has, and the guard on the private path.

The plugin takes verl's public API wherever the installed verl offers it and falls back to the private names and
runtime patches of :mod:`populora_verl.verl_private` only where it does not (verl 0.9.1 as released). Every check
here looks at what verl defines, not at its version number, so a verl that merged part of the series gets that part.

:func:`private_path` marks each fallback: it is called right before the plugin uses a private name (or applies a
runtime patch) that an entry of ``verl_private`` records as replaced by a public API (``series_api``). With
``POPULORA_VERL_PUBLIC_ONLY=1`` it raises instead, which is how the "series applied" test proves the plugin touches
no such name against a patched verl. Nothing here imports vLLM; the checks import only the verl modules they name.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import os
from pathlib import Path

#: Every detector of a patch of the series (patches/), by function name: all true on a verl with the whole series,
#: all false on verl 0.9.1.
SERIES_DETECTORS = (
    "has_register_rollout",
    "has_agent_loop_query",
    "trainer_declares_async",
    "worker_class_from_config",
    "has_chunked_logprobs",
    "has_weight_sync_job_id",
    "poll_interval_from_config",
    "trainer_without_dataset",
    "has_public_prompt_cap",
    "has_save_hook",
    "has_engine_micro_batch_hook",
    "has_public_save",
    "has_reward_class_setup",
    "has_engine_port_blocks",
    "has_before_load_hook",
    "has_public_step_stages",
    "has_public_dispatch_info",
    "has_public_prompt_submission",
    "engine_class_from_config",
    "max_loras_from_engine_kwargs",
    "has_per_request_lora",
    "has_agent_loop_lora_field",
    "has_per_id_weight_sync",
    "has_server_name_from_rollout_name",
)

__all__ = [
    "PUBLIC_ONLY_ENV",
    "PrivateVerlUse",
    "private_path",
    "public_only",
    "SERIES_DETECTORS",
    "series_detected",
    *SERIES_DETECTORS,
]


#: ``1``: a fallback onto a private name that a public API replaces raises (the series-applied test sets it).
PUBLIC_ONLY_ENV = "POPULORA_VERL_PUBLIC_ONLY"


class PrivateVerlUse(RuntimeError):
    """The plugin took a private path while ``POPULORA_VERL_PUBLIC_ONLY=1``."""


def public_only() -> bool:
    return os.environ.get(PUBLIC_ONLY_ENV, "0") == "1"


def private_path(key: str) -> None:
    """Called where the plugin falls back to a private verl name or runtime patch (``key``: the entry's ``name`` in
    ``verl_private.PRIVATE`` or ``module`` in ``RUNTIME_PATCHES``) because the installed verl lacks the public API."""
    if public_only():
        raise PrivateVerlUse(
            f"{key}: private verl path taken with {PUBLIC_ONLY_ENV}=1 (the installed verl "
            "should offer the public API that replaces it; see populora_verl/verl_private.py)"
        )


def _has(module: str, *names: str) -> bool:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return False
    obj = mod
    for name in names:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


@functools.cache
def has_register_rollout() -> bool:
    """0006: ``register_rollout`` and the registration queries (no writes to ``_ROLLOUT_REGISTRY``)."""
    return (
        _has("verl.workers.rollout.replica", "register_rollout")
        and _has("verl.workers.rollout.replica", "RolloutReplicaRegistry", "is_registered")
        and _has("verl.workers.rollout.base", "is_rollout_class_registered")
    )


@functools.cache
def has_agent_loop_query() -> bool:
    """0006's agent-loop half (imports verl's agent-loop module, about 1 s: only where it is needed anyway)."""
    return _has("verl.experimental.agent_loop.agent_loop", "is_agent_loop_registered")


@functools.cache
def trainer_declares_async() -> bool:
    """0007: ``PPOTrainer.is_async`` decides sync or async, not the mode name."""
    return _has("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "is_async")


def _verl_root() -> Path | None:
    """The installed ``verl`` package's folder, found without importing verl."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def _trainer_yaml(name: str = "ppo_trainer.yaml") -> dict:
    """A config of verl's ``trainer/config`` (default ``ppo_trainer.yaml``) as plain data (empty where verl or the
    file is missing)."""
    import yaml

    root = _verl_root()
    if root is None:
        return {}
    path = root / "trainer" / "config" / name
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError:
        return {}


@functools.cache
def trainer_without_dataset() -> bool:
    """0012: ``PPOTrainer.uses_dataset``: a trainer that makes its own prompts declares it, and verl builds no dataset,
    keeps no dataloader state and skips validation."""
    return _has("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "uses_dataset")


@functools.cache
def has_save_hook() -> bool:
    """0008: ``PPOTrainer.on_save_checkpoint``, a trainer's own state written inside verl's save, before the step is
    marked saved."""
    return _has("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "on_save_checkpoint")


@functools.cache
def has_before_load_hook() -> bool:
    """0021: ``PPOTrainer.before_load_checkpoint``, called before verl decides whether and from where to resume."""
    return _has("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "before_load_checkpoint")


@functools.cache
def has_public_save() -> bool:
    """0015: ``PPOTrainer.save_checkpoint``, a save of the current step outside verl's periodic schedule."""
    return _has("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "save_checkpoint")


@functools.cache
def worker_class_from_config() -> bool:
    """0004: ``actor_rollout_ref.worker_class`` is declared in verl's trainer config (and read by the trainer)."""
    return "worker_class" in (_trainer_yaml().get("actor_rollout_ref") or {})


@functools.cache
def poll_interval_from_config() -> bool:
    """0011: ``trainer.v1.sampler.poll_interval`` is declared in verl's trainer config (and read where the replay
    buffer is built)."""
    sampler = (((_trainer_yaml().get("trainer") or {}).get("v1") or {}).get("sampler")) or {}
    return "poll_interval" in sampler


@functools.cache
def has_chunked_logprobs() -> bool:
    """0010: verl's own ``logprobs_from_logits`` falls back to a chunked computation, not a per-token loop."""
    return _has("verl.utils.torch_functional", "logprobs_from_logits_chunked")


@functools.cache
def has_weight_sync_job_id() -> bool:
    """0005: both ends of verl's weight-sync socket are named with a host-unique job id."""
    return _has("verl.workers.rollout.utils", "get_weight_sync_job_id")


@functools.cache
def has_engine_port_blocks() -> bool:
    """0017: verl's vLLM server gives each replica's engine a ``VLLM_PORT`` block of its own (``get_port_block_start``),
    so engines starting together on one node do not race for a port."""
    return _has("verl.utils.net_utils", "get_port_block_start")


@functools.cache
def has_public_prompt_cap() -> bool:
    """0013: ``AgentLoopBase.cap_text_prompt_length``, the agent loop's public prompt-length cap (imports verl's
    agent-loop module: only where it is loaded anyway)."""
    return _has("verl.experimental.agent_loop.agent_loop", "AgentLoopBase", "cap_text_prompt_length")


@functools.cache
def has_engine_micro_batch_hook() -> bool:
    """0014: ``FSDPEngine.prepare_micro_batches``, the FSDP engine's micro-batch split as a method that an engine
    subclass overrides (imports verl's FSDP engine module: only where it is loaded anyway)."""
    return _has("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine", "prepare_micro_batches")


@functools.cache
def engine_class_from_config() -> bool:
    """0022: ``engine_class`` is declared in verl's FSDP engine config (and the worker builds that subclass of the
    registered engine instead). Read from the YAML: importing verl's engine configs imports every engine module."""
    return "engine_class" in _trainer_yaml("engine/fsdp.yaml")


@functools.cache
def has_reward_class_setup() -> bool:
    """0016: ``RewardManagerBase.setup_class`` / ``reset_class``, a reward manager's one-time class setup without the
    private ``_class_initialized`` flag."""
    return _has("verl.experimental.reward_loop.reward_manager.base", "RewardManagerBase", "setup_class")


@functools.cache
def has_public_step_stages() -> bool:
    """0018: ``PPOTrainer.balance_batch`` / ``compute_old_log_prob`` / ``update_actor`` and their hooks
    ``get_required_batch_multiple`` and ``get_actor_update_extra_info``, the step's stages as public methods."""
    return _has("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "get_actor_update_extra_info")


@functools.cache
def has_public_dispatch_info() -> bool:
    """0019: ``WorkerGroup.dispatch_info(mesh_name)``, a mesh's data-parallel ranks queried once and kept (the same
    answer verl's dispatch splits a batch by)."""
    return _has("verl.single_controller.base.worker_group", "WorkerGroup", "dispatch_info")


@functools.cache
def has_public_prompt_submission() -> bool:
    """0020: ``PPOTrainer.add_prompts_to_generate`` (the replay buffer's refill, which a trainer with prompts of its
    own overrides) and ``submit_batch_to_rollout`` (the hand-off of a prompt batch to the agent loop)."""
    return _has("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "add_prompts_to_generate") and _has(
        "verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "submit_batch_to_rollout"
    )


# --- the vLLM side (0001-0003) ---------------------------------------------------------------------------------------
# verl's vLLM modules import vLLM at import time, and the driver (and the CPU tests) may have no vLLM: these checks
# read the installed verl's source instead of importing it.


@functools.cache
def _verl_source(relpath: str) -> ast.Module | None:
    """The installed verl's ``relpath`` (relative to the ``verl`` package), parsed once for every check that reads
    it; None where verl or the file is missing."""
    root = _verl_root()
    if root is None:
        return None
    try:
        return ast.parse((root / relpath).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None


def _verl_function(relpath: str, cls: str, func: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The definition of ``cls.func`` in the installed verl's ``relpath``, parsed from source; None where the file,
    class or method is missing."""
    tree = _verl_source(relpath)
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == func:
                    return item
    return None


def _arg_names(fn: ast.FunctionDef | ast.AsyncFunctionDef | None) -> set[str]:
    if fn is None:
        return set()
    a = fn.args
    return {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}


def _reads_key(fn: ast.FunctionDef | ast.AsyncFunctionDef | None, key: str) -> bool:
    """Whether ``fn`` reads ``key`` from a mapping (``x.get(key...)`` or ``x[key]``)."""
    for node in ast.walk(fn) if fn is not None else ():
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == key:
                return True
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == key:
            return True
    return False


VLLM_SERVER_FILE = "workers/rollout/vllm_rollout/vllm_async_server.py"


@functools.cache
def max_loras_from_engine_kwargs() -> bool:
    """0001: ``vLLMHttpServer.launch_server`` passes ``rollout.engine_kwargs.vllm.max_loras`` to vLLM instead of
    forcing 1 (``max_cpu_loras`` passed through already)."""
    return _reads_key(_verl_function(VLLM_SERVER_FILE, "vLLMHttpServer", "launch_server"), "max_loras")


@functools.cache
def has_per_request_lora() -> bool:
    """0002, the server: ``vLLMHttpServer.generate(..., lora={"lora_int_id", "lora_name"})`` serves the request with
    that resident adapter (and raises if it is not loaded), on both legs of the prefill/decode path."""
    return "lora" in _arg_names(
        _verl_function(VLLM_SERVER_FILE, "vLLMHttpServer", "generate")
    ) and "lora" in _arg_names(_verl_function(VLLM_SERVER_FILE, "vLLMHttpServer", "_pd_dispatch"))


@functools.cache
def has_agent_loop_lora_field() -> bool:
    """0002, the agent loop: ``SingleTurnAgentLoop.run`` forwards a prompt field ``lora`` to the server's
    ``generate``."""
    run = _verl_function("experimental/agent_loop/single_turn_agent_loop.py", "SingleTurnAgentLoop", "run")
    return _reads_key(run, "lora")


@functools.cache
def has_server_name_from_rollout_name() -> bool:
    """0023: ``vLLMReplica`` names its server actors after ``rollout.name``, the prefix ``ServerAdapter`` looks them
    up by (verl 0.9.1 returns the constant ``"vllm_"``)."""
    return _reads_key(_verl_function(VLLM_SERVER_FILE, "vLLMReplica", "_get_server_name_prefix"), "name")


@functools.cache
def has_per_id_weight_sync() -> bool:
    """0003: verl's vLLM colocate worker extension loads a synced adapter under the caller's ``lora_int_id`` /
    ``lora_name`` (``update_weights_from_ipc`` and the ``_update_weights`` it calls), instead of the fixed id 123."""
    utils = "workers/rollout/vllm_rollout/utils.py"
    ext = "vLLMColocateWorkerExtension"
    return all(
        {"lora_int_id", "lora_name"} <= _arg_names(_verl_function(utils, ext, f))
        for f in ("update_weights_from_ipc", "_update_weights")
    )


def series_detected() -> dict[str, bool]:
    """Each of :data:`SERIES_DETECTORS` and its answer for the verl that is imported."""
    return {name: bool(globals()[name]()) for name in SERIES_DETECTORS}
