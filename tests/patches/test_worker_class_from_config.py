"""0004: the actor role's worker class from config, ``actor_rollout_ref.worker_class`` (the plugin overrides the
private ``_init_resource_pool_mgr`` to swap in its worker)."""

from __future__ import annotations

PATCH = "0004-trainer-worker-class-from-config.patch"

# verl's own PPOTrainer and _init_resource_pool_mgr on CPU, with verl's default config: the key is declared (null by
# default), a subclass named there hosts the actor role, anything else is refused.
CHECK = """
import os, pathlib, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.engine_workers import ActorRolloutRefWorker

pathlib.Path("my_workers.py").write_text(
    "from verl.workers.engine_workers import ActorRolloutRefWorker\\n"
    "class MyWorker(ActorRolloutRefWorker):\\n    pass\\n"
    "class NotAWorker:\\n    pass\\n")
sys.path.insert(0, os.getcwd())

def actor_class(overrides):
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    assert "worker_class" in cfg.actor_rollout_ref, "actor_rollout_ref.worker_class is not declared"
    t = PPOTrainerSync(cfg)
    t._init_resource_pool_mgr()
    actor = t.role_worker_mapping[Role.ActorRollout]
    return actor.__ray_metadata__.modified_class.__mro__[1]

import my_workers
assert actor_class([]) is ActorRolloutRefWorker
assert actor_class(["actor_rollout_ref.worker_class=my_workers.MyWorker"]) is my_workers.MyWorker
try:
    actor_class(["actor_rollout_ref.worker_class=my_workers.NotAWorker"])
except TypeError as e:
    assert "not a subclass of ActorRolloutRefWorker" in str(e)
else:
    raise AssertionError("a class that is not an ActorRolloutRefWorker was accepted")
print("ok")
"""


def test_worker_class_is_read_from_config(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, CHECK, expect_without="worker_class is not declared")
