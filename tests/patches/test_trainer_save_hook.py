"""0008: hooks for a trainer's own state in verl's checkpoint (the plugin overrides the private ``_save_checkpoint``
and ``_load_checkpoint`` to write and read its adapter bank and population around verl's)."""

from __future__ import annotations

from _shared import TRAINER_SCRIPT_PRELUDE

PATCH = "0008-trainer-pre-save-hook.patch"

# verl's own save and resume on CPU, with the workers and the dataloader replaced by recorders.
CHECK = TRAINER_SCRIPT_PRELUDE + """

class Workers:
    def save_checkpoint(self, local_path, *args, **kwargs):
        os.makedirs(local_path, exist_ok=True)
        events.append(("actor saved", os.path.basename(os.path.dirname(local_path))))
    def load_checkpoint(self, local_path, **kwargs):
        events.append(("actor loaded", os.path.basename(os.path.dirname(local_path))))

class Loader:
    def state_dict(self):
        return {}
    def load_state_dict(self, state):
        pass

@register_trainer("with_state")
class WithState(PPOTrainerSync):
    def on_save_checkpoint(self, checkpoint_dir):
        tracker = os.path.join(self.config.trainer.default_local_dir, "latest_checkpointed_iteration.txt")
        events.append(("own state saved", os.path.basename(checkpoint_dir), os.path.exists(tracker)))
    def on_load_checkpoint(self, checkpoint_dir):
        events.append(("own state loaded", os.path.basename(checkpoint_dir)))

with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                           version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=["trainer.v1.trainer_mode=with_state",
                                                       f"trainer.default_local_dir={root}"])
t = WithState(cfg)
t.trainer_mode, t.is_async = "sync", False  # a sync trainer under its own name (patch 0007 or not)
t.actor_rollout_wg, t.train_dataloader, t.use_critic, t.global_steps = Workers(), Loader(), False, 3
t._save_checkpoint()
t.global_steps = 0
t._load_checkpoint()
print(events)
assert events == [("actor saved", "global_step_3"), ("own state saved", "global_step_3", False),
                  ("actor loaded", "global_step_3"), ("own state loaded", "global_step_3")], events
assert t.global_steps == 3
"""


def test_own_state_is_saved_before_the_step_is_marked_and_loaded_after_verl(fails_without_passes_with):
    fails_without_passes_with(PATCH, CHECK, expect_without="AssertionError")
