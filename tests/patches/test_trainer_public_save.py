"""0015: ``PPOTrainer.save_checkpoint``, a public save of the current step (the plugin calls the private
``_save_checkpoint`` to save the step at which a stop file ends the run)."""

from __future__ import annotations

from _shared import TRAINER_SCRIPT_PRELUDE

PATCH = "0015-trainer-public-save.patch"

# verl's own trainer on CPU with the workers and the dataloader replaced by recorders: a step that the periodic
# schedule does not save (save_freq 0) is saved through the public method, completely, and resumes.
CHECK = TRAINER_SCRIPT_PRELUDE + """

class Workers:
    def save_checkpoint(self, local_path, *args, **kwargs):
        os.makedirs(local_path, exist_ok=True)
        events.append(("actor saved", os.path.relpath(local_path, root)))
    def load_checkpoint(self, local_path, **kwargs):
        events.append(("actor loaded", os.path.relpath(local_path, root)))

class Loader:
    def state_dict(self):
        return {"consumed": 7}
    def load_state_dict(self, state):
        events.append(("dataloader loaded", state))

@register_trainer("saves_on_demand")
class SavesOnDemand(PPOTrainerSync):
    pass

with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                           version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=["trainer.v1.trainer_mode=saves_on_demand",
                                                       "trainer.save_freq=0", f"trainer.default_local_dir={root}"])
t = SavesOnDemand(cfg)
t.trainer_mode, t.is_async = "sync", False  # a sync trainer under its own name (patch 0007 or not)
t.actor_rollout_wg, t.train_dataloader, t.use_critic, t.global_steps = Workers(), Loader(), False, 5
t.save_checkpoint()
tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
assert open(tracker).read() == "5", open(tracker).read()  # the step is marked complete
assert os.path.exists(os.path.join(root, "global_step_5", "data.pt"))
t.global_steps = 0
t._load_checkpoint()
print(events)
assert events == [("actor saved", "global_step_5/actor"), ("actor loaded", "global_step_5/actor"),
                  ("dataloader loaded", {"consumed": 7})], events
assert t.global_steps == 5
"""


def test_a_step_off_the_schedule_is_saved_completely_and_resumes(fails_without_passes_with):
    fails_without_passes_with(PATCH, CHECK, expect_without="'SavesOnDemand' object has no attribute 'save_checkpoint'")
