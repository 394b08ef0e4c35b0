"""0012: a trainer that makes its own prompts builds no dataset (the plugin overrides the private ``_init_dataloader``
with an empty stand-in loader and ``_validate`` with an empty result, because verl builds both from ``data.*_files``)."""

from __future__ import annotations

from _shared import TRAINER_SCRIPT_PRELUDE

PATCH = "0012-trainer-without-dataset.patch"

# verl's own set-up, save, resume and fit loop on CPU, with verl's default config but no data files: the workers and
# the step are recorders.
CHECK = TRAINER_SCRIPT_PRELUDE + """

class Stop(Exception):
    pass

class Workers:
    def save_checkpoint(self, local_path, *args, **kwargs):
        os.makedirs(local_path, exist_ok=True)
    def load_checkpoint(self, local_path, **kwargs):
        events.append("actor loaded")

@register_trainer("own_prompts")
class OwnPrompts(PPOTrainerSync):
    uses_dataset = False
    def on_validate_begin(self):
        events.append("validate")
    def step(self, metrics, timing_raw):
        events.append(f"step {self.global_steps}")
        return None
    def on_step_end(self):
        events.append("step end")
    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        raise Stop  # the rest of the loop logs the step's batch: none here

def build(*overrides):
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            "trainer.v1.trainer_mode=own_prompts", "data.train_files=null", "data.val_files=null",
            f"trainer.default_local_dir={root}", "trainer.logger=[console]", *overrides])
    t = OwnPrompts(cfg)
    t.trainer_mode, t.is_async = "sync", False  # a sync trainer under its own name (patch 0007 or not)
    t.tokenizer = t.processor = None
    try:
        t._init_dataloader()
    except ValueError:
        raise
    except Exception as e:
        raise AssertionError(f"verl built a dataset for a trainer without one: {e!r}")
    return t

# set-up: no dataset, the run's length from the config, one epoch
t = build("trainer.total_training_steps=5")
assert t.train_dataset is t.val_dataset is t.train_dataloader is t.val_dataloader is None
assert t.total_training_steps == 5 and t.steps_per_epoch == 5
assert t.config.actor_rollout_ref.actor.optim.total_training_steps == 5
for steps in ("null", "0"):
    try:
        build(f"trainer.total_training_steps={steps}")
    except ValueError as e:
        assert "trainer.total_training_steps" in str(e), e
    else:
        raise AssertionError(f"trainer.total_training_steps={steps} accepted without a dataset")

# no validation set: nothing to validate, and reading prompts from the dataloader names the mistake
assert t._validate() == {}
try:
    t._fetch_one_gen_batch()
except RuntimeError as e:
    assert "uses_dataset" in str(e), e
else:
    raise AssertionError("a prompt was fetched without a dataset")

# save and resume: no dataloader state, the step is marked complete and resumes
t.actor_rollout_wg, t.use_critic, t.global_steps = Workers(), False, 3
t._save_checkpoint()
step_dir = os.path.join(root, "global_step_3")
assert not os.path.exists(os.path.join(step_dir, "data.pt")), os.listdir(step_dir)
with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
    assert f.read() == "3"
import torch
torch.save({}, os.path.join(step_dir, "data.pt"))  # a folder with dataloader state (written with a dataset) resumes
t.global_steps = 0
t._load_checkpoint()
assert t.global_steps == 3 and events == ["actor loaded"], (t.global_steps, events)

# fit: no validation before training or at test_freq, the steps run
events.clear()
t = build("trainer.total_training_steps=2", "trainer.val_before_train=true", "trainer.test_freq=1")
t.global_steps = 0
try:
    t.fit(agent_loop_manager=None)
except Stop:
    pass
assert events == ["step 1", "step end"], events
print("ok")
"""


def test_a_trainer_without_a_dataset_sets_up_checkpoints_and_fits(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(
        PATCH, CHECK, expect_without="verl built a dataset for a trainer without one"
    )
