"""Pure helpers between the population step and verl's TransferQueue rows (CPU-testable, no Ray, no GPU).

* :func:`requests_to_rows` — ``GenRequest`` -> one prompt row each (``uid``, ``raw_prompt``, ``populora`` routing ...);
* :func:`group_trajectory_keys` / :func:`build_gen_responses` — TQ keys ``{uid}_{session}_{i}`` + decoded texts ->
  ``GenResponse`` per request, sessions in order, gaps (failed sessions) filled so every request keeps its ``n``;
* :func:`signal_rows` — ``Sample`` rewards and TRR++ advantages -> per-token ``rm_scores`` / ``advantages`` /
  ``returns`` for each TQ key;
* :func:`partition_keys` — trained keys per adapter slot (sorted, deterministic);
* :func:`validate_verl_config` — the verl half of a PopuLoRA run's start-up checks (one line naming the key).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from populora_verl.config import ConfigError, PopuLoRAConfig

__all__ = [
    "AGENT_NAME",
    "DATA_SOURCE",
    "VLLM_MAX_LORA_RANK",
    "new_uid",
    "prompt_to_messages",
    "populora_field",
    "requests_to_rows",
    "with_base_policy",
    "split_key",
    "group_trajectory_keys",
    "build_gen_responses",
    "signal_rows",
    "partition_keys",
    "prefix_metrics",
    "mean_over_prefixes",
    "tensor_checksum",
    "state_checksum",
    "validate_verl_config",
    "ParallelLayout",
    "parallel_layout",
    "warn_if_bank_not_shared",
]

AGENT_NAME = "populora_agent"
DATA_SOURCE = "populora"
#: vLLM's largest ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``); verl's own check is skipped for our backend.
VLLM_MAX_LORA_RANK = 512
_ROLE_FOR_REWARD = {"teacher": "propose", "student": "solve"}

#: The TransferQueue partition of the training rows, and the per-token signals the step writes into it.
PARTITION = "train"
SIGNAL_FIELDS = ("rm_scores", "advantages", "returns")


def new_uid() -> str:
    """A TQ group id. Hex only: verl's replay buffer splits keys ``{uid}_{session}_{i}`` on ``_``."""
    return uuid.uuid4().hex


def prompt_to_messages(prompt: Any) -> list[dict[str, str]]:
    """verl's single-turn agent loop reads ``raw_prompt`` as chat messages; a plain-text (``azr``) prompt travels as
    one user message whose text the ``populora_agent`` loop tokenizes as it is (``populora.prompt_format=text``),
    without the chat template, so both engines feed the model the same token ids."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    raise TypeError(f"prompt must be a string or a list of {{role, content}} messages, got {type(prompt).__name__}")


def populora_field(request: Any, lora: Mapping[str, Any], step: int) -> dict[str, Any]:
    """The per-prompt ``populora`` dict: routing for the agent loop (``lora_int_id``, ``lora_name``, ``slot``) and
    what the ``populora_code`` reward manager needs (``role`` propose/solve, ``task_type``, ``adapter``, ``task``)."""
    task = request.meta.get("task") if request.role == "student" else request.meta.get("program")
    out = {
        "adapter": request.adapter,
        "slot": int(lora["slot"]),
        "lora_int_id": int(lora["lora_int_id"]),
        "lora_name": str(lora["lora_name"]),
        "role": _ROLE_FOR_REWARD.get(request.role, request.role),
        "task_type": request.task_type,
        "step": int(step),
        # "text": raw_prompt[0].content is the whole prompt, tokenized without a chat template (tasks.prompt_template
        # azr); "chat": verl's chat template renders raw_prompt.
        "prompt_format": "text" if isinstance(request.prompt, str) else "chat",
        # The population step scores every trajectory (it alone sees the matched students): the populora_code
        # reward manager skips these rows instead of running each program a second time.
        "scored_by": "population_step",
    }
    if task is not None:
        # JSON text: TQ stores it as one opaque non-tensor value and the reward manager accepts it as is.
        out["task"] = task.to_json() if hasattr(task, "to_json") else json.dumps(task)
    return out


def with_base_policy(lora_of: Mapping[str, Mapping[str, Any]], member_id: str) -> dict[str, Mapping[str, Any]]:
    """``lora_of`` plus a route for the seeding phase's base-policy requests (``BASE_POLICY``): ``member_id``'s
    LoRA id. Seeding runs before step 1, when every slot's ``lora_B`` is still zero, so that adapter adds nothing and
    vLLM samples the base model (our routing serves no request without an adapter)."""
    from populora_verl.step.records import BASE_POLICY

    if member_id not in lora_of:
        raise KeyError(f"no LoRA id for member {member_id!r}")
    return {**lora_of, BASE_POLICY: lora_of[member_id]}


def requests_to_rows(requests: Sequence[Any], lora_of: Mapping[str, Mapping[str, Any]], step: int, *,
                     start_index: int = 0, agent_name: str = AGENT_NAME,
                     uids: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One prompt row per request. ``lora_of[member_id] = {slot, lora_int_id, lora_name}``."""
    if uids is not None and len(uids) != len(requests):
        raise ValueError(f"{len(uids)} uids for {len(requests)} requests")
    rows = []
    for i, req in enumerate(requests):
        if req.adapter not in lora_of:
            raise KeyError(f"no LoRA id for member {req.adapter!r} (known: {sorted(lora_of)})")
        if int(req.n) < 1:
            raise ValueError(f"request for {req.adapter} asks for n={req.n} samples")
        rows.append({
            "uid": uids[i] if uids is not None else new_uid(),
            "index": start_index + i,
            "raw_prompt": prompt_to_messages(req.prompt),
            "agent_name": agent_name,
            "data_source": DATA_SOURCE,
            "__rollout_n__": int(req.n),
            "populora": populora_field(req, lora_of[req.adapter], step),
        })
    return rows


def rows_to_tensordict(rows: Sequence[Mapping[str, Any]], step: int) -> Any:
    """verl's prompt batch (a TensorDict) from rows, as its dataloader would build it."""
    from verl.utils import tensordict_utils as tu

    if not rows:
        raise ValueError("no prompt rows")
    cols: dict[str, Any] = {}
    for k in rows[0]:
        vals = [r[k] for r in rows]
        cols[k] = torch.tensor(vals, dtype=torch.int64) if k in ("index", "__rollout_n__") else vals
    td = tu.get_tensordict(cols)
    tu.assign_non_tensor_data(td, "global_steps", int(step))
    return td


def split_key(key: str) -> tuple[str, int, int]:
    """``{uid}_{session}_{i}`` -> ``(uid, session, i)``."""
    parts = key.rsplit("_", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise ValueError(f"{key!r} is not a trajectory key '{{uid}}_{{session}}_{{index}}'")
    return parts[0], int(parts[1]), int(parts[2])


def group_trajectory_keys(keys: Sequence[str]) -> dict[str, dict[int, str]]:
    """``uid -> {session: key}``; a multi-output session keeps its last output (the one carrying the answer)."""
    out: dict[str, dict[int, tuple[int, str]]] = {}
    for key in keys:
        uid, session, idx = split_key(key)
        cur = out.setdefault(uid, {}).get(session)
        if cur is None or idx > cur[0]:
            out[uid][session] = (idx, key)
    return {uid: {s: k for s, (_, k) in sorted(sess.items())} for uid, sess in out.items()}


def build_gen_responses(requests: Sequence[Any], uids: Sequence[str], keys: Sequence[str],
                        texts: Mapping[str, str], lengths: Mapping[str, int]) -> tuple[list[Any], int]:
    """``GenResponse`` per request (texts in session order; ``extra`` = the TQ key of each completion).

    A session that produced no trajectory (a failed rollout) becomes an empty text with ``extra=None``: the
    population step scores it as a format error, so the teacher still gets its reward, and the trainer never trains
    on it. Returns ``(responses, number of missing sessions)``."""
    from populora_verl.step import GenResponse

    by_uid = group_trajectory_keys(keys)
    unknown = set(by_uid) - set(uids)
    if unknown:
        raise ValueError(f"trajectories for unknown prompt groups: {sorted(unknown)[:3]}")
    out, missing = [], 0
    for req, uid in zip(requests, uids, strict=True):
        sessions = by_uid.get(uid, {})
        extra_sessions = [s for s in sessions if s >= req.n]
        if extra_sessions:
            raise ValueError(f"group {uid} has sessions {extra_sessions} beyond n={req.n}")
        t, ln, ex = [], [], []
        for s in range(req.n):
            key = sessions.get(s)
            if key is None:
                missing += 1
                t.append("")
                ln.append(1)
                ex.append(None)
            else:
                t.append(texts[key])
                ln.append(max(1, int(lengths[key])))
                ex.append(key)
        out.append(GenResponse(req, t, ln, ex))
    return out, missing


def signal_rows(samples: Sequence[Any], response_masks: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Per TQ key: ``rm_scores`` (the reward on the last response token), ``advantages`` (the sample's TRR++
    advantage on every response token) and ``returns`` (the outcome return: reward on every response token, gamma 1).

    Masked tokens (``response_mask == 0``) get zeros, as verl's estimators produce them."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for s in samples:
        key = s.extra
        if key is None:
            continue
        if key in out:
            raise ValueError(f"two samples share the trajectory key {key!r}")
        mask = response_masks[key].to(torch.float32).reshape(-1)
        n = mask.numel()
        rm = torch.zeros(n, dtype=torch.float32)
        if n:
            nz = torch.nonzero(mask).reshape(-1)
            rm[int(nz[-1]) if nz.numel() else n - 1] = float(s.reward)
        out[key] = {"rm_scores": rm, "advantages": mask * float(s.advantage), "returns": mask * float(s.reward)}
    return out


def partition_keys(samples: Sequence[Any], slot_of: Mapping[str, int]) -> dict[int, list[str]]:
    """Trained TQ keys per adapter slot, slots ascending, keys in sample order (deterministic)."""
    parts: dict[int, list[str]] = {}
    for s in samples:
        if s.extra is None:
            continue
        parts.setdefault(int(slot_of[s.adapter]), []).append(s.extra)
    return {slot: parts[slot] for slot in sorted(parts)}


def prefix_metrics(metrics: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """``populora/<member>/`` + verl's own metric name (``actor/pg_loss``, ``training/rollout_probs_diff_mean``)."""
    return {f"{prefix.rstrip('/')}/{k}": v for k, v in metrics.items()}


def mean_over_prefixes(per_adapter: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """verl's unprefixed metric names, averaged over adapters (dashboards and verl's own derived metrics)."""
    acc: dict[str, list[float]] = {}
    for m in per_adapter.values():
        for k, v in m.items():
            try:
                acc.setdefault(k, []).append(float(v))
            except (TypeError, ValueError):
                continue
    return {k: sum(v) / len(v) for k, v in acc.items() if v}


def tensor_checksum(t: torch.Tensor) -> str:
    """Short content hash of one tensor (dtype, shape and bytes)."""
    h = hashlib.sha1()
    t = t.detach().to("cpu").contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:12]


def state_checksum(state: Mapping[str, torch.Tensor]) -> str:
    """Short content hash of an adapter state dict (keys sorted)."""
    h = hashlib.sha1()
    for k in sorted(state):
        h.update(k.encode())
        h.update(tensor_checksum(state[k]).encode())
    return h.hexdigest()[:12]


# --- start-up validation ---------------------------------------------------------------------------------------


def _get(cfg: Any, dotted: str, default: Any = None) -> Any:
    cur = cfg
    for part in dotted.split("."):
        if cur is None:
            return default
        getter = getattr(cur, "get", None)
        cur = getter(part, None) if callable(getter) else getattr(cur, part, None)
    return default if cur is None else cur


def _bad(key: str, msg: str) -> None:
    raise ConfigError(f"{key}: {msg}")


def validate_verl_config(config: Any, pcfg: PopuLoRAConfig) -> None:
    """Check the verl keys a PopuLoRA run depends on; raise :class:`ConfigError` with one line naming the key."""
    ar = "actor_rollout_ref"
    checks: list[tuple[str, Any, Any, str]] = [
        # key, value, predicate, message
        ("trainer.use_v1", _get(config, "trainer.use_v1"), lambda v: v is True, "must be true (the V1 trainer)"),
        (f"{ar}.actor.strategy", _get(config, f"{ar}.actor.strategy"), lambda v: v == "fsdp2",
         "must be 'fsdp2' (FSDP1 flat params break per-adapter swaps)"),
        (f"{ar}.rollout.name", _get(config, f"{ar}.rollout.name"), lambda v: v == "populora_vllm",
         "must be 'populora_vllm' (per-request adapters; 'vllm' serves one LoRA id)"),
        (f"{ar}.rollout.mode", _get(config, f"{ar}.rollout.mode"), lambda v: v == "async", "must be 'async'"),
        (f"{ar}.rollout.checkpoint_engine.backend", _get(config, f"{ar}.rollout.checkpoint_engine.backend"),
         lambda v: v == "naive", "must be 'naive' (LoRA with other engines never reaches vLLM, verl #7495)"),
        (f"{ar}.rollout.load_format", _get(config, f"{ar}.rollout.load_format"), lambda v: v == "safetensors",
         "must be 'safetensors' (verl's LoRA weight sync)"),
        (f"{ar}.model.lora.merge", _get(config, f"{ar}.model.lora.merge", False), lambda v: v is False,
         "must be false (vLLM serves the adapters unmerged, one id each)"),
        (f"{ar}.actor.use_kl_loss", _get(config, f"{ar}.actor.use_kl_loss", False), lambda v: v is False,
         "must be false (PopuLoRA computes no reference log-probs per adapter)"),
        ("algorithm.use_kl_in_reward", _get(config, "algorithm.use_kl_in_reward", False), lambda v: v is False,
         "must be false (rewards come from the population step)"),
        ("critic.enable", _get(config, "critic.enable"), lambda v: v is False,
         "must be false (TRR++ needs no critic; null turns one on for gae)"),
        ("algorithm.filter_groups.enable", _get(config, "algorithm.filter_groups.enable", False),
         lambda v: v is False, "must be false (evicting groups would drop teacher rewards)"),
        ("trainer.v1.sampler.sync_refill_failed_groups", _get(config, "trainer.v1.sampler.sync_refill_failed_groups",
                                                               False), lambda v: v is False,
         "must be false (a failed group is scored as empty answers so its teacher keeps a reward)"),
        ("trainer.val_before_train", _get(config, "trainer.val_before_train", False), lambda v: v is False,
         "must be false (PopuLoRA has no validation set; evaluate with populora_verl.eval)"),
        ("trainer.total_training_steps", _get(config, "trainer.total_training_steps"),
         lambda v: isinstance(v, int) and v >= 1, "must be an integer >= 1 (prompts come from the population)"),
    ]
    for key, value, ok, msg in checks:
        if not ok(value):
            _bad(key, f"{msg}, got {value!r}")
    if _get(config, "distillation.enabled", False):
        _bad("distillation.enabled", "must be false with PopuLoRA")
    rank = _get(config, f"{ar}.model.lora_rank", 0) or _get(config, f"{ar}.model.lora.rank", 0)
    if not (isinstance(rank, int) and rank > 0):
        _bad(f"{ar}.model.lora_rank", f"must be > 0 (every member is a LoRA adapter), got {rank!r}")
    if rank > VLLM_MAX_LORA_RANK:
        _bad(f"{ar}.model.lora_rank", f"must be <= {VLLM_MAX_LORA_RANK} (vLLM max_lora_rank), got {rank}")
    n = pcfg.population.num_adapters
    ek = _get(config, f"{ar}.rollout.engine_kwargs.vllm", {}) or {}
    max_loras = _get(ek, "max_loras")
    if not (isinstance(max_loras, int) and max_loras >= n):
        _bad(f"{ar}.rollout.engine_kwargs.vllm.max_loras",
             f"must be >= population size ({n}) so every adapter of a batch is resident on each vLLM replica, "
             f"got {max_loras!r}")
    max_cpu = _get(ek, "max_cpu_loras", max_loras)
    if not (isinstance(max_cpu, int) and max_cpu >= max_loras):
        _bad(f"{ar}.rollout.engine_kwargs.vllm.max_cpu_loras", f"must be >= max_loras ({max_loras}), got {max_cpu!r}")
    _validate_overridden_keys(config, pcfg)
    if pcfg.rollout.max_loras is not None and pcfg.rollout.max_loras > max_loras:
        _bad("populora.rollout.max_loras",
             f"({pcfg.rollout.max_loras}) exceeds {ar}.rollout.engine_kwargs.vllm.max_loras ({max_loras}), "
             "which is what vLLM gets")
    parallel_layout(config, pcfg)


def _validate_overridden_keys(config: Any, pcfg: PopuLoRAConfig) -> None:
    """verl keys whose job PopuLoRA does itself, and ``populora.rollout`` keys verl's rollout never reads: each
    must agree with what really happens, so no value a user sets is silently ignored."""
    ar = "actor_rollout_ref"
    n = _get(config, f"{ar}.rollout.n")
    if n != 1:
        _bad(f"{ar}.rollout.n", "must be 1: PopuLoRA sets samples per prompt itself (populora.rollout.teacher_n / "
             f"student_n), got {n!r}")
    # The trainer makes each slot's whole batch one PPO mini-batch; in verl's terms that is
    # ppo_mini_batch_size == train_batch_size (one optimizer step per epoch), so ask for exactly that.
    mini, batch = _get(config, f"{ar}.actor.ppo_mini_batch_size"), _get(config, "data.train_batch_size")
    if mini != batch:
        _bad(f"{ar}.actor.ppo_mini_batch_size", f"must equal data.train_batch_size ({batch!r}): PopuLoRA trains each "
             f"adapter's whole batch as one mini-batch (one optimizer step per ppo_epoch), got {mini!r}")
    length = _get(config, f"{ar}.rollout.response_length") or _get(config, "data.max_response_length")
    if pcfg.rollout.max_new_tokens is not None and pcfg.rollout.max_new_tokens != length:
        _bad("populora.rollout.max_new_tokens", f"({pcfg.rollout.max_new_tokens}) differs from {ar}.rollout."
             f"response_length ({length!r}), which is what vLLM generates with: set that, or leave this null")
    temp = _get(config, f"{ar}.rollout.temperature")
    if pcfg.rollout.temperature is not None and pcfg.rollout.temperature != temp:
        _bad("populora.rollout.temperature", f"({pcfg.rollout.temperature}) differs from {ar}.rollout.temperature "
             f"({temp!r}), which is what vLLM samples with: set that, or leave this null")


@dataclass(frozen=True)
class ParallelLayout:
    """How a run spreads over GPUs: FSDP2 ranks of the actor (each holds a shard of every adapter) and vLLM
    replicas (each serves every adapter under its own LoRA id)."""

    n_gpus: int
    nnodes: int
    actor_dp: int  # data-parallel ranks of the actor (world / Ulysses SP): a slot's batch is padded to a multiple
    fsdp_size: int  # ranks one adapter's shards are spread over (= world unless HSDP via fsdp_config.fsdp_size)
    rollout_tp: int
    rollout_world: int  # GPUs per vLLM replica (TP x DP x PP)
    replicas: int
    max_loras: int  # adapters resident per replica (engine_kwargs.vllm.max_loras)
    adapters: int

    def describe(self) -> str:
        return (f"{self.n_gpus} GPU(s) on {self.nnodes} node(s); actor: {self.actor_dp} data-parallel rank(s), every "
                f"adapter sharded over {self.fsdp_size}; rollout: {self.replicas} vLLM replica(s) x "
                f"{self.rollout_world} GPU(s) (TP {self.rollout_tp}), each serving all {self.adapters} adapters "
                f"(max_loras {self.max_loras})")


def _positive_int(config: Any, key: str, default: Any = None) -> int:
    value = _get(config, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _bad(key, f"must be an integer >= 1, got {value!r}")
    return value


def parallel_layout(config: Any, pcfg: PopuLoRAConfig) -> ParallelLayout:
    """Check the GPU layout keys against each other (what verl would otherwise assert deep inside a Ray worker,
    minutes into start-up) and return the layout; :class:`ConfigError` names the key on a mismatch."""
    ar = "actor_rollout_ref"
    per_node = _positive_int(config, "trainer.n_gpus_per_node")
    nnodes = _positive_int(config, "trainer.nnodes")
    n_gpus = per_node * nnodes
    tp = _positive_int(config, f"{ar}.rollout.tensor_model_parallel_size", 1)
    rdp = _positive_int(config, f"{ar}.rollout.data_parallel_size", 1)
    pp = _positive_int(config, f"{ar}.rollout.pipeline_model_parallel_size", 1)
    rollout_world = tp * rdp * pp
    if n_gpus % rollout_world:
        _bad(f"{ar}.rollout.tensor_model_parallel_size",
             f"a vLLM replica needs TP {tp} x DP {rdp} x PP {pp} = {rollout_world} GPUs, which must divide "
             f"trainer.n_gpus_per_node x trainer.nnodes = {n_gpus}")
    if rollout_world > per_node and rollout_world % per_node:
        _bad(f"{ar}.rollout.tensor_model_parallel_size",
             f"a replica spanning nodes must use whole nodes: {rollout_world} GPUs is not a multiple of "
             f"trainer.n_gpus_per_node ({per_node})")
    sp = _positive_int(config, f"{ar}.actor.ulysses_sequence_parallel_size", 1)
    if n_gpus % sp:
        _bad(f"{ar}.actor.ulysses_sequence_parallel_size", f"({sp}) must divide the {n_gpus} actor GPUs")
    fsdp_size = _get(config, f"{ar}.actor.fsdp_config.fsdp_size", -1)
    if isinstance(fsdp_size, bool) or not isinstance(fsdp_size, int) or fsdp_size == 0:
        _bad(f"{ar}.actor.fsdp_config.fsdp_size", f"must be -1 (all GPUs) or a positive integer, got {fsdp_size!r}")
    if 0 < fsdp_size < n_gpus and n_gpus % fsdp_size:
        _bad(f"{ar}.actor.fsdp_config.fsdp_size", f"({fsdp_size}) must divide the {n_gpus} actor GPUs (HSDP groups)")
    ek = _get(config, f"{ar}.rollout.engine_kwargs.vllm", {}) or {}
    return ParallelLayout(
        n_gpus=n_gpus, nnodes=nnodes, actor_dp=n_gpus // sp,
        fsdp_size=fsdp_size if 0 < fsdp_size < n_gpus else n_gpus, rollout_tp=tp, rollout_world=rollout_world,
        replicas=n_gpus // rollout_world, max_loras=int(_get(ek, "max_loras", 0) or 0),
        adapters=pcfg.population.num_adapters,
    )


def warn_if_bank_not_shared(paths: Sequence[str | None] | str | None) -> list[str]:
    """Warn (once per save, one line) about per-rank bank files the driver cannot see; returns them.

    Each rank writes its own shard file under ``trainer.default_local_dir``. On several nodes that folder must be
    on a filesystem every node shares (as verl's own per-rank checkpoints need): otherwise a resume on other nodes
    finds no bank for some ranks. Training goes on either way.
    """
    listed = [paths] if isinstance(paths, str) else list(paths or [])
    unseen = [p for p in listed if p and not os.path.exists(p)]
    if unseen:
        logging.getLogger(__name__).warning(
            "populora: %d of %d adapter bank file(s) are not visible from the driver (e.g. %s): put "
            "trainer.default_local_dir on a filesystem shared by every node, or this checkpoint cannot be resumed "
            "elsewhere", len(unseen), len(listed), unseen[0])
    return unseen


def field_rows(t: Any) -> list[torch.Tensor]:
    """Per-sample 1-D tensors from a TQ field (jagged nested tensor, padded tensor or list)."""
    if isinstance(t, torch.Tensor):
        return [x.reshape(-1) for x in t.unbind(0)]
    return [torch.as_tensor(x).reshape(-1) for x in t]
