"""0011: the replay buffer's poll interval comes from ``trainer.v1.sampler.poll_interval`` (the plugin overrides
``_build_replay_buffer`` to set it, because verl builds the buffer with its 2 s default and no key reaches it)."""

from __future__ import annotations

PATCH = "0011-trainer-replay-buffer-poll-interval.patch"

# verl's own PPOTrainer.__init__ on CPU with verl's default config, in the sync and an async mode: the key is declared
# (2.0, today's interval) in ppo_trainer.yaml and the generated configs, reaches both built-in buffers, and a
# non-positive value is refused.
CHECK = """
import glob, os
import yaml
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")

def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))

declared = compose_cfg().trainer.v1.sampler.get("poll_interval")
assert declared == 2.0, f"trainer.v1.sampler.poll_interval not declared (got {declared!r})"
for path in sorted(glob.glob(os.path.join(config_dir, "_generated_*.yaml"))):
    with open(path) as f:
        assert yaml.safe_load(f)["trainer"]["v1"]["sampler"]["poll_interval"] == 2.0, path

for mode, buffer_cls in (("sync", ReplayBuffer), ("colocate_async", ReplayBufferAsync)):
    t = get_trainer_cls(mode)(compose_cfg(f"trainer.v1.trainer_mode={mode}"))
    assert type(t.replay_buffer) is buffer_cls and t.replay_buffer.poll_interval == 2.0, (mode, t.replay_buffer)
    t = get_trainer_cls(mode)(compose_cfg(f"trainer.v1.trainer_mode={mode}", "trainer.v1.sampler.poll_interval=0.25"))
    assert type(t.replay_buffer) is buffer_cls and t.replay_buffer.poll_interval == 0.25, (mode, t.replay_buffer)

try:
    get_trainer_cls("sync")(compose_cfg("trainer.v1.sampler.poll_interval=0"))
except ValueError as e:
    assert "trainer.v1.sampler.poll_interval" in str(e), e
else:
    raise AssertionError("poll_interval=0 accepted")
print("ok")
"""


def test_the_poll_interval_comes_from_the_sampler_config(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(
        PATCH, CHECK, expect_without="trainer.v1.sampler.poll_interval not declared (got None)"
    )
