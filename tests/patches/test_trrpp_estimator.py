"""0009: TRR++ as one of verl's advantage estimators (the plugin registers its own, ``populora_trrpp``)."""

from __future__ import annotations

PATCH = "0009-trrpp-advantage-estimator.patch"

# Through verl's registry: TRR++ equals verl's REINFORCE++ applied to each group's sub-batch on its own, and a group
# of one response token gets advantage 0 (REINFORCE++'s whitening would divide by zero).
CHECK = """
import numpy as np
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import compute_reinforce_plus_plus_outcome_advantage, get_adv_estimator_fn

config = OmegaConf.create({"gamma": 1.0})
trrpp = get_adv_estimator_fn("task_relative_reinforce_plus_plus")
torch.manual_seed(0)
rewards = torch.zeros(12, 6)
rewards[torch.arange(12), torch.randint(2, 6, (12,))] = torch.randn(12)
mask = torch.ones(12, 6)
mask[:, 5] = 0
mask[3, 1:] = 0
index = np.array(["code_i/propose", "code_o/solve", "code_i/propose", "code_o/solve"] * 3, dtype=object)
adv, ret = trrpp(token_level_rewards=rewards, response_mask=mask, index=index, config=config)
for key in set(index):
    rows = np.flatnonzero(index == key)
    ref_adv, ref_ret = compute_reinforce_plus_plus_outcome_advantage(rewards[rows], mask[rows], config=config)
    assert torch.allclose(adv[rows], ref_adv, atol=1e-5), key
    assert torch.allclose(ret[rows], ref_ret)
# a task whose group is one token: centred only
lone = torch.zeros(1, 6)
lone[0, 0] = 1.0
adv, _ = trrpp(token_level_rewards=lone, response_mask=torch.tensor([[1.0, 0, 0, 0, 0, 0]]), index=np.array(["x"]),
               config=config)
assert torch.equal(adv, torch.zeros(1, 6)), adv
print("ok")
"""


def test_trrpp_is_reinforce_plus_plus_per_task(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, CHECK, expect_without="task_relative_reinforce_plus_plus")
