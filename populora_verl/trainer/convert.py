"""Pure helpers between the population step and verl's TransferQueue rows (CPU-testable, no Ray, no GPU).

* :func:`requests_to_rows` — ``GenRequest`` -> one prompt row each (``uid``, ``raw_prompt``, ``populora`` routing ...);
* :func:`group_trajectory_keys` / :func:`build_gen_responses` — TQ keys ``{uid}_{session}_{i}`` + decoded texts ->
  ``GenResponse`` per request, sessions in order, gaps (failed sessions) filled so every request keeps its ``n``;
* :func:`signal_rows` — ``Sample`` rewards and TRR++ advantages -> per-token ``rm_scores`` / ``advantages`` /
  ``returns`` for each TQ key;
* :func:`partition_keys` — trained keys per adapter slot (sorted, deterministic);
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "AGENT_NAME",
    "DATA_SOURCE",
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
    "field_rows",
    "PARTITION",
    "SIGNAL_FIELDS",
]

AGENT_NAME = "populora_agent"
DATA_SOURCE = "populora"
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


def requests_to_rows(
    requests: Sequence[Any],
    lora_of: Mapping[str, Mapping[str, Any]],
    step: int,
    *,
    start_index: int = 0,
    agent_name: str = AGENT_NAME,
    uids: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """One prompt row per request. ``lora_of[member_id] = {slot, lora_int_id, lora_name}``."""
    if uids is not None and len(uids) != len(requests):
        raise ValueError(f"{len(uids)} uids for {len(requests)} requests")
    rows = []
    for i, req in enumerate(requests):
        if req.adapter not in lora_of:
            raise KeyError(f"no LoRA id for member {req.adapter!r} (known: {sorted(lora_of)})")
        if int(req.n) < 1:
            raise ValueError(f"request for {req.adapter} asks for n={req.n} samples")
        rows.append(
            {
                "uid": uids[i] if uids is not None else new_uid(),
                "index": start_index + i,
                "raw_prompt": prompt_to_messages(req.prompt),
                "agent_name": agent_name,
                "data_source": DATA_SOURCE,
                "__rollout_n__": int(req.n),
                "populora": populora_field(req, lora_of[req.adapter], step),
            }
        )
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


def build_gen_responses(
    requests: Sequence[Any],
    uids: Sequence[str],
    keys: Sequence[str],
    texts: Mapping[str, str],
    lengths: Mapping[str, int],
) -> tuple[list[Any], int]:
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


def signal_rows(
    samples: Sequence[Any], response_masks: Mapping[str, torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
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


def field_rows(t: Any) -> list[torch.Tensor]:
    """Per-sample 1-D tensors from a TQ field (jagged nested tensor, padded tensor or list)."""
    if isinstance(t, torch.Tensor):
        return [x.reshape(-1) for x in t.unbind(0)]
    return [torch.as_tensor(x).reshape(-1) for x in t]
