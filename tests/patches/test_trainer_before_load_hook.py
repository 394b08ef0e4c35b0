"""0021: a hook before verl's resume (the plugin overrides the private ``_load_checkpoint`` to build its adapter bank
before verl's load and to point the resume at an older step when the newest fails its own checks)."""

from __future__ import annotations

from _shared import TRAINER_RECORDERS, TRAINER_SCRIPT_PRELUDE

PATCH = "0021-trainer-before-load-hook.patch"

# verl's own resume on CPU, with the workers and the dataloader replaced by recorders: the hook runs first, on a
# fresh start as on a resume, and a resume folder it chooses (an older step than the tracked one) is the one loaded.
CHECK = TRAINER_SCRIPT_PRELUDE + """
from omegaconf import open_dict

""" + TRAINER_RECORDERS + """
@register_trainer("picks_folder")
class PicksFolder(PPOTrainerSync):
    older = None
    def before_load_checkpoint(self):
        events.append(("before load", self.global_steps))
        if self.older is not None:
            with open_dict(self.config):
                self.config.trainer.resume_mode = "resume_path"
                self.config.trainer.resume_from_path = self.older

t = recording_trainer(PicksFolder, "picks_folder")
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
assert events == [("before load", -1), ("actor saved", "global_step_2"), ("actor saved", "global_step_4"),
                  ("before load", -1), ("actor loaded", "global_step_2")], events
assert t.global_steps == 2, t.global_steps
"""


def test_the_hook_runs_before_every_resume_and_can_choose_its_folder(fails_without_passes_with):
    fails_without_passes_with(PATCH, CHECK, expect_without="AssertionError")
