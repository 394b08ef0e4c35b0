"""0007: a trainer declares whether it is async (the plugin resets ``trainer_mode`` to "sync" after verl's __init__
and rebuilds the replay buffer, because verl treats every mode name but "sync" as async)."""

from __future__ import annotations

PATCH = "0007-trainer-declares-async.patch"

# verl's own PPOTrainer.__init__ on CPU, with verl's default config: a synchronous trainer registered under a name of
# its own, next to the built-in modes.
CHECK = """
import os
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
from verl.trainer.ppo.v1.trainer_base import get_trainer_cls, register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

@register_trainer("my_sync")
class MySync(PPOTrainerSync):
    pass

def build(mode):
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[f"trainer.v1.trainer_mode={mode}"])
    return get_trainer_cls(mode)(cfg)

built = {mode: (build(mode), expected)
         for mode, expected in (("sync", ReplayBuffer), ("colocate_async", ReplayBufferAsync), ("my_sync", ReplayBuffer))}
for mode, (t, expected) in built.items():
    assert t.trainer_mode == mode
    assert type(t.replay_buffer) is expected, f"{mode}: {type(t.replay_buffer).__name__}, expected {expected.__name__}"
for mode, (t, expected) in built.items():
    assert t.is_async is (expected is ReplayBufferAsync), (mode, t.is_async)
print("ok")
"""


def test_a_sync_trainer_under_its_own_name_is_sync(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, CHECK, expect_without="my_sync: ReplayBufferAsync")
