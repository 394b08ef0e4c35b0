"""0020: the V1 trainer's prompt hand-off to the rollout is public (the plugin overrides verl's private
``_add_prompts_to_generate``, the replay buffer's refill, to resubmit its own evicted prompts, and calls the private
``_submit_batch_to_rollout`` to hand each phase's prompts to the agent loop)."""

from __future__ import annotations

from _shared import TRAINER_SCRIPT_PRELUDE

PATCH = "0020-trainer-public-prompt-submission.patch"

# verl's own trainers built by their __init__ with verl's default config, on CPU: TransferQueue's put and the agent
# loop are recorders (where the prompts leave verl), the dataloader a generator of prompt chunks.
CHECK = TRAINER_SCRIPT_PRELUDE + """
from types import SimpleNamespace
import numpy as np
import verl
from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.trainer_base import get_trainer_cls
from verl.utils import tensordict_utils as tu
from verl.utils.skip import SkipManager

def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose(config_name="ppo_trainer", overrides=["data.train_batch_size=4", *overrides])

def prompts(*uids):
    return tu.get_tensordict({"uid": np.array(uids, dtype=object),
                              "raw_prompt": np.array([[{"role": "user", "content": u}] for u in uids], dtype=object)})

class Loader:  # what verl's default refill reads: chunks of train_batch_size prompts
    def __init__(self):
        self.fetched = 0
    def __iter__(self):
        while True:
            self.fetched += 1
            yield {"raw_prompt": np.array([[{"role": "user", "content": f"p{self.fetched}_{i}"}] for i in range(4)],
                                          dtype=object)}

# TransferQueue and the agent loop are where the prompts leave verl: both record what they receive
tq_puts = []
trainer_base.tq = SimpleNamespace(kv_batch_put=lambda **kwargs: tq_puts.append(kwargs))
generated = []
agent_loop = SimpleNamespace(generate_sequences=lambda batch: generated.append(list(batch["uid"])))

# verl's submission, as a trainer with prompts of its own calls it: tagged pending at the step, then generated
t = PPOTrainerSync(compose_cfg())
t.global_steps, t.agent_loop_manager = 3, agent_loop
assert t.submit_batch_to_rollout(prompts("a", "b")) == 2
assert generated == [["a", "b"]], generated
assert tq_puts[0]["keys"] == ["a", "b"] and tq_puts[0]["partition_id"] == "train", tq_puts
assert tq_puts[0]["tags"] == [{"is_prompt": True, "status": "pending", "global_steps": 3}] * 2, tq_puts

# verl's default refill reads the dataloader and submits through the public method, so a subclass's submission runs
class Submits(PPOTrainerSync):
    def submit_batch_to_rollout(self, batch):
        events.append(("submit", len(batch)))
        return len(batch)

s = Submits(compose_cfg())
s.global_steps, s.train_dataloader, s.train_dataloader_it = 1, Loader(), None
assert s.add_prompts_to_generate(4) == 4 and events == [("submit", 4)], events
s._add_batch_to_generate()  # verl's step submits its batch the same way
assert events[-1] == ("submit", 4), events

# ... and so does SkipManager's submit phase on a step it has no cached rollout for
SkipManager.step = 7
SkipManager.skip_instances = {"rollout_tq": SimpleNamespace(is_enabled=lambda: True, steps={7},
                                                            maybe_load_and_inject=lambda step, uids: False)}
s._add_batch_to_generate()
assert events[-1] == ("submit", 4) and len(events) == 3, events
SkipManager.skip_instances = {}

# a trainer that makes its own prompts overrides the refill: the replay buffer's refill_fn and the async warm-up
# call its method
class Refills:
    def add_prompts_to_generate(self, num_prompts):
        events.append(("refill", num_prompts))
        return 0

class SyncRefills(Refills, PPOTrainerSync):
    pass

r = SyncRefills(compose_cfg())
assert r.replay_buffer.refill_fn.__func__ is Refills.add_prompts_to_generate, r.replay_buffer.refill_fn
r.replay_buffer.refill_fn(2)
assert events[-1] == ("refill", 2), events

class AsyncRefills(Refills, get_trainer_cls("colocate_async")):
    pass

a = AsyncRefills(compose_cfg("trainer.v1.trainer_mode=colocate_async"))
assert a.replay_buffer.refill_fn.__func__ is Refills.add_prompts_to_generate
a._add_async_warmup_batches(1)
assert events[-1] == ("refill", 4), events
print("ok")
"""


def test_the_prompt_hand_off_is_public_and_a_subclass_refill_is_called(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(
        PATCH, CHECK, expect_without="has no attribute 'submit_batch_to_rollout'"
    )
