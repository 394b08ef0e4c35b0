"""0008: hooks for a trainer's own state in verl's checkpoint (the plugin overrides the private ``_save_checkpoint``
and ``_load_checkpoint`` to write and read its adapter bank and population around verl's)."""

from __future__ import annotations

from _shared import TRAINER_RECORDERS, TRAINER_SCRIPT_PRELUDE

PATCH = "0008-trainer-pre-save-hook.patch"

# verl's own save and resume on CPU, with the workers and the dataloader replaced by recorders.
CHECK = TRAINER_SCRIPT_PRELUDE + """

""" + TRAINER_RECORDERS + """
@register_trainer("with_state")
class WithState(PPOTrainerSync):
    def on_save_checkpoint(self, checkpoint_dir):
        tracker = os.path.join(self.config.trainer.default_local_dir, "latest_checkpointed_iteration.txt")
        events.append(("own state saved", os.path.basename(checkpoint_dir), os.path.exists(tracker)))
    def on_load_checkpoint(self, checkpoint_dir):
        events.append(("own state loaded", os.path.basename(checkpoint_dir)))

t = recording_trainer(WithState, "with_state")
t.global_steps = 3
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
