"""0018: the V1 trainer's batching, old-log-prob and actor-update stages are public (the plugin calls verl's private
``_balance_batch`` / ``_compute_old_log_prob`` / ``_update_actor``, overrides ``_get_required_batch_multiple`` and
copies ``_update_actor``'s extra_info block to update each adapter's batch as one PPO mini-batch)."""

from __future__ import annotations

from _shared import TRAINER_SCRIPT_PRELUDE

PATCH = "0018-trainer-public-step-stages.patch"

# verl's own stages on a trainer built without __init__, with verl's default config: the actor worker group, the
# replay buffer and the advantage stage are recorders, so nothing needs TransferQueue or a GPU.
CHECK = TRAINER_SCRIPT_PRELUDE + """
from types import SimpleNamespace
from transfer_queue import KVBatchMeta
import verl

class Workers:
    def __init__(self, dp):
        self._dispatch_info = {"actor": list(range(dp))}
        self.extra_info = None
    def dispatch_info(self, mesh_name):  # asked by verl with WorkerGroup.dispatch_info (the series)
        return self._dispatch_info[mesh_name]
    def update_actor(self, batch):
        self.extra_info = dict(batch.extra_info)
        return {"metrics": {"pg_loss": [1.0, 2.0], "mfu": [0.5]}}

class OneMiniBatchPerBatch(PPOTrainerSync):
    # each batch is one PPO mini-batch: only the data-parallel split needs divisibility
    def get_required_batch_multiple(self, dp_size):
        return dp_size
    def get_actor_update_extra_info(self, batch):
        info = super().get_actor_update_extra_info(batch)
        info.update(global_batch_size=len(batch), mini_batch_size=len(batch))
        return info

with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                           version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=["actor_rollout_ref.rollout.n=2"])

def build(cls, dp=2):
    t = cls.__new__(cls)
    t.config, t.global_steps, t.use_critic, t.use_reference_policy = cfg, 1, False, False
    t.tokenizer = SimpleNamespace(eos_token_id=1)
    t.actor_rollout_wg = Workers(dp)
    return t

def batch(lengths):
    return KVBatchMeta(partition_id="train", keys=[f"k{i}_0_0" for i in range(len(lengths))],
                       tags=[{"seq_len": n} for n in lengths])

# the default stays verl's: padded to the actor's mini-batch (ppo_mini_batch_size * n), which updates on it
default = build(PPOTrainerSync)
assert default.get_required_batch_multiple(2) == 512, default.get_required_batch_multiple(2)
info = default.get_actor_update_extra_info(batch([3, 4]))
assert info["global_batch_size"] == info["mini_batch_size"] == 512, info
assert info["epochs"] == 1 and info["distillation_only"] is False and "temperature" in info, info

# a subclass's multiple decides the padding: four rows over two ranks, no padding row, balanced by length
t = build(OneMiniBatchPerBatch)
m = {}
b = t.balance_batch(batch([100, 1, 1, 100]), metrics=m)
assert len(b) == 4 and sorted(tag["seq_len"] for tag in b.tags[:2]) == [1, 100], b.tags
assert any(k.startswith("global_seqlen/") for k in m), m

# the update runs with the subclass's mini-batch and verl's other keys, and reports verl's metrics
m = {}
b = t.update_actor(batch([5, 6, 7, 8, 9, 10]), metrics=m)
sent = t.actor_rollout_wg.extra_info
assert sent["global_batch_size"] == sent["mini_batch_size"] == 6, sent
assert {k: v for k, v in sent.items() if k not in ("global_batch_size", "mini_batch_size")} == \\
    {k: v for k, v in info.items() if k not in ("global_batch_size", "mini_batch_size")}, (sent, info)
assert m["actor/pg_loss"] == 1.5 and m["perf/mfu/actor"] == 0.5, m

# verl's step runs the public stages, so a subclass's own stages are the ones run
class Recorder(PPOTrainerSync):
    def on_sample_end(self):
        pass
    def balance_batch(self, batch, metrics, **kwargs):
        events.append("balance_batch")
        return batch
    def compute_old_log_prob(self, batch, metrics):
        events.append("compute_old_log_prob")
        return batch
    def _compute_advantage(self, batch, metrics):
        return batch
    def update_actor(self, batch, metrics):
        events.append("update_actor")
        return batch

r = build(Recorder)
r.replay_buffer = SimpleNamespace(sample=lambda **kwargs: (batch([3, 4]), {}))
r.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=["reward worker"])
r._step_once({}, {}, sample_batch_size=2)
assert events == ["balance_batch", "compute_old_log_prob", "update_actor"], events

# verl's own override of the old-log-prob stage follows the public name
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
assert "compute_old_log_prob" in vars(PPOTrainerSeparateAsync), sorted(vars(PPOTrainerSeparateAsync))
assert not hasattr(PPOTrainerSeparateAsync, "_compute_old_log_prob")
print("ok")
"""


def test_the_step_stages_are_public_and_the_update_takes_a_subclass_mini_batch(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, CHECK, expect_without="has no attribute 'get_required_batch_multiple'")
