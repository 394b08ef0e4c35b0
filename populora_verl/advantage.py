"""Task-Relative REINFORCE++ (TRR++): REINFORCE++ advantages whitened separately within each group.

AZR gets its six (task type x role) baselines by calling verl's REINFORCE++ estimator once per sub-batch; we do
the same in one call by whitening within each group key. PopuLoRA's default group is (adapter, task, role), so
every adapter keeps its own baselines (see ``populora.advantage.group``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["group_keys", "trrpp_advantages"]


def group_keys(
    adapters: Sequence[str], task_types: Sequence[str], roles: Sequence[str], subpops: Sequence[str] | None, mode: str
) -> list[tuple]:
    """Group key of each sample for ``populora.advantage.group`` (``adapter_task_role`` | ``subpop_task_role`` |
    ``task_role``)."""
    if mode == "adapter_task_role":
        return list(zip(adapters, task_types, roles))
    if mode == "subpop_task_role":
        if subpops is None:
            raise ValueError("populora.advantage.group=subpop_task_role needs each sample's sub-population")
        return list(zip(subpops, task_types, roles))
    if mode == "task_role":
        return list(zip(task_types, roles))
    raise ValueError(f"populora.advantage.group: unknown mode {mode!r}")


@torch.no_grad()
def trrpp_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ returns, whitened over the response tokens of each group in ``index``.

    Matches verl's ``reinforce_plus_plus`` estimator applied to each group's sub-batch on its own. A group with a
    single token (or zero variance) gets its mean removed only, so a lone sample has advantage 0 rather than NaN.
    """
    if token_level_rewards.shape != response_mask.shape:
        raise ValueError(f"rewards {tuple(token_level_rewards.shape)} and mask {tuple(response_mask.shape)} differ")
    if len(index) != token_level_rewards.shape[0]:
        raise ValueError(f"index has {len(index)} entries for a batch of {token_level_rewards.shape[0]}")
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        new_running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = new_running * mask[:, t]
        # Masked (observation) tokens carry the running return through unchanged, as verl does.
        running = new_running * mask[:, t] + running * (1 - mask[:, t])

    advantages = torch.zeros_like(returns)
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(index):
        groups.setdefault(key, []).append(i)
    for rows in groups.values():
        r, m = returns[rows], mask[rows]
        n = m.sum()
        if n == 0:
            continue
        mean = (r * m).sum() / n
        centred = (r - mean) * m
        if n > 1:
            var = (centred**2).sum() / (n - 1)  # unbiased, as verl's masked_whiten
            centred = centred * torch.rsqrt(var + eps)
        advantages[rows] = centred
    return advantages, returns


def register() -> None:
    """Register TRR++ with verl's advantage-estimator registry as ``populora_trrpp`` (idempotent)."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est

    if "populora_trrpp" in ADV_ESTIMATOR_REGISTRY:
        return

    @register_adv_est("populora_trrpp")
    def compute_populora_trrpp_advantage(token_level_rewards, response_mask, index=None, config=None, **kwargs):
        """TRR++: ``index`` carries each sample's group key, e.g. (adapter, task type, role)."""
        if index is None:
            raise ValueError("populora_trrpp needs the per-sample group index (adapter, task, role)")
        gamma = getattr(config, "gamma", 1.0) if config is not None else 1.0
        return trrpp_advantages(token_level_rewards, response_mask, list(index), gamma=gamma)
