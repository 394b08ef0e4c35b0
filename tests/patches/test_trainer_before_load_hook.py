"""0021: a hook before verl's resume (the plugin overrides the private ``_load_checkpoint`` to build its adapter bank
before verl's load and to point the resume at an older step when the newest fails its own checks)."""

from __future__ import annotations

from _shared import TRAINER_SCRIPT_PRELUDE

PATCH = "0021-trainer-before-load-hook.patch"

# verl's own resume on CPU, with the workers and the dataloader replaced by recorders: the hook runs first, on a
# fresh start as on a resume, and a resume folder it chooses (an older step than the tracked one) is the one loaded.
CHECK = TRAINER_SCRIPT_PRELUDE + """
from omegaconf import open_dict

class Workers:
    def save_checkpoint(self, local_path, *args, **kwargs):
        os.makedirs(local_path, exist_ok=True)
    def load_checkpoint(self, local_path, **kwargs):
        events.append(("actor loaded", os.path.basename(os.path.dirname(local_path))))

class Loader:
    def state_dict(self):
        return {}
    def load_state_dict(self, state):
        pass

@register_trainer("picks_folder")
class PicksFolder(PPOTrainerSync):
    older = None
    def before_load_checkpoint(self):
        events.append(("before load", self.global_steps))
        if self.older is not None:
            with open_dict(self.config):
                self.config.trainer.resume_mode = "resume_path"
                self.config.trainer.resume_from_path = self.older

with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                           version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=["trainer.v1.trainer_mode=picks_folder",
                                                       f"trainer.default_local_dir={root}"])
t = PicksFolder(cfg)
t.trainer_mode, t.is_async = "sync", False  # a sync trainer under its own name (patch 0007 or not)
t.actor_rollout_wg, t.train_dataloader, t.use_critic = Workers(), Loader(), False
t.global_steps = -1
t._load_checkpoint()  # nothing saved yet: a fresh start, the hook still runs
assert t.global_steps == 0, t.global_steps
for step in (2, 4):
    t.global_steps = step
    t._save_checkpoint()
t.older = os.path.join(root, "global_step_2")
t.global_steps = -1
t._load_checkpoint()
print(events)
assert events == [("before load", -1), ("before load", -1), ("actor loaded", "global_step_2")], events
assert t.global_steps == 2, t.global_steps
"""


def test_the_hook_runs_before_every_resume_and_can_choose_its_folder(fails_without_passes_with):
    fails_without_passes_with(PATCH, CHECK, expect_without="AssertionError")
