"""TRR++ = verl's REINFORCE++ estimator applied to each group's sub-batch on its own."""

import torch
from omegaconf import OmegaConf

from populora_verl.advantage import group_keys, trrpp_advantages


def _batch(seed=0, b=12, t=7):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.2).long()
    mask[:, 0] = 1
    rewards = torch.zeros(b, t)
    last = mask.cumsum(1).argmax(1)
    rewards[torch.arange(b), last] = torch.randn(b, generator=g)
    return rewards, mask


def test_matches_verl_reinforce_pp_per_group():
    from verl.trainer.ppo.core_algos import compute_reinforce_plus_plus_outcome_advantage

    rewards, mask = _batch()
    index = [("t0", "code_i", "teacher")] * 5 + [("s0", "code_o", "student")] * 7
    adv, ret = trrpp_advantages(rewards, mask, index)
    cfg = OmegaConf.create({"gamma": 1.0})
    for rows in (slice(0, 5), slice(5, 12)):
        ref_adv, ref_ret = compute_reinforce_plus_plus_outcome_advantage(rewards[rows], mask[rows], config=cfg)
        torch.testing.assert_close(adv[rows], ref_adv, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[rows], ref_ret)


def test_groups_are_independent_and_masked():
    rewards, mask = _batch(1)
    index = ["a"] * 6 + ["b"] * 6
    adv, _ = trrpp_advantages(rewards, mask, index)
    shifted = rewards.clone()
    shifted[6:] += 100.0 * (rewards[6:] != 0)  # shift only group b's rewards
    adv2, _ = trrpp_advantages(shifted, mask, index)
    torch.testing.assert_close(adv[:6], adv2[:6])
    assert torch.all(adv[mask == 0] == 0)


def test_single_sample_group_has_zero_advantage():
    rewards = torch.tensor([[0.0, 1.0]])
    adv, _ = trrpp_advantages(rewards, torch.ones(1, 2), ["only"])
    assert torch.isfinite(adv).all()


def test_group_keys_modes():
    k = group_keys(["t0", "t1"], ["code_i", "code_i"], ["teacher", "teacher"], ["T", "T"], "subpop_task_role")
    assert k[0] == k[1]
    k = group_keys(["t0", "t1"], ["code_i", "code_i"], ["teacher", "teacher"], None, "adapter_task_role")
    assert k[0] != k[1]


def test_registered_estimator_dispatches():
    import populora_verl.advantage as a

    a.register()
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    fn = get_adv_estimator_fn("populora_trrpp")
    rewards, mask = _batch(2)
    index = ["x"] * 12
    adv, _ = fn(rewards, mask, index=index, config=OmegaConf.create({"gamma": 1.0}))
    torch.testing.assert_close(adv, trrpp_advantages(rewards, mask, index)[0])
