"""0019: a worker mesh's data-parallel ranks are a public query of the worker group (the plugin reads the private
``WorkerGroup._dispatch_info`` and calls the workers' private ``_query_dispatch_info`` to lay out its fused update's
rows as verl's dispatch splits them)."""

from __future__ import annotations

PATCH = "0019-worker-group-public-dispatch-info.patch"

# verl's worker group, dispatch and trainers' balancing on CPU: a group of four workers built without Ray, two
# tensor-parallel ranks per data-parallel rank, whose query of the workers is a recorder (the dispatch's Ray put of
# the chunks is replaced by the chunks themselves).
CHECK = """
from types import SimpleNamespace
import torch
from transfer_queue import KVBatchMeta
from verl.protocol import DataProto
from verl.single_controller.base.decorator import dispatch_lazy_compute_data_proto
from verl.single_controller.base.worker_group import WorkerGroup
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

class Group(WorkerGroup):
    def __init__(self, ranks):
        super().__init__(resource_pool=None)
        self._workers = [object()] * len(ranks)
        self.ranks, self.queries = ranks, []
    def _query_dispatch_info(self, mesh_name):  # bound from the workers' registered method on a Ray group
        self.queries.append(mesh_name)
        return list(self.ranks)

wg = Group([0, 0, 1, 1])
assert wg.dispatch_info("actor") == [0, 0, 1, 1] and wg.queries == ["actor"]
assert wg.dispatch_info("actor") == [0, 0, 1, 1] and wg.queries == ["actor"]  # asked once, then kept

# the dispatch of a method registered for the mesh reads the same answer: no second query, two chunks of two rows,
# each worker gets its data-parallel rank's chunk
import verl.utils.ray_utils as ray_utils
ray_utils.parallel_put = lambda chunks, max_workers: list(chunks)  # the chunks themselves instead of Ray refs
data = DataProto.from_dict({"x": torch.arange(4)})
(chunks,), _ = dispatch_lazy_compute_data_proto("actor", wg, data)
assert wg.queries == ["actor"], wg.queries
assert [c.batch["x"].tolist() for c in chunks] == [[0, 1], [0, 1], [2, 3], [2, 3]]

# a mesh the group has not been asked about is queried on first use, by the dispatch as by the query
other = Group([0, 1, 2, 3])
dispatch_lazy_compute_data_proto("critic", other, data)
assert other.dispatch_info("critic") == [0, 1, 2, 3] and other.queries == ["critic"]

# a group of another size than the answer is refused, as by the dispatch
bad = Group([0, 1])
bad._workers = [object()] * 4
try:
    bad.dispatch_info("actor")
except AssertionError:
    pass
else:
    raise AssertionError("a rank list of the wrong length was accepted")

# both trainers' balancing read the mesh's size through it: a group whose query answers differently each time
# would be asked once
legacy = RayPPOTrainer.__new__(RayPPOTrainer)
fresh = Group([0, 0, 1, 1])
assert legacy._get_dp_size(fresh, "actor") == 2 and legacy._get_dp_size(fresh, "actor") == 2
assert fresh.queries == ["actor"]

from hydra import compose, initialize_config_dir
import os, verl
with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                           version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=["actor_rollout_ref.actor.ppo_mini_batch_size=1",
                                                         "actor_rollout_ref.rollout.n=1"])
t = PPOTrainerSync.__new__(PPOTrainerSync)
t.config, t.global_steps, t.use_critic = cfg, 1, False
t.tokenizer = SimpleNamespace(eos_token_id=1)
t.actor_rollout_wg = Group([0, 0, 1, 1])
balance = getattr(t, "balance_batch", None) or t._balance_batch  # public with the step-stages patch
batch = KVBatchMeta(partition_id="train", keys=[f"k{i}_0_0" for i in range(4)],
                    tags=[{"seq_len": n} for n in (100, 1, 1, 100)])
m = {}
batch = balance(batch, metrics=m)
assert sorted(tag["seq_len"] for tag in batch.tags[:2]) == [1, 100], batch.tags  # balanced over two ranks
balance(batch, metrics=m)
assert t.actor_rollout_wg.queries == ["actor"], t.actor_rollout_wg.queries
print("ok")
"""


def test_the_worker_group_answers_a_meshs_data_parallel_ranks(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(PATCH, CHECK, expect_without="has no attribute 'dispatch_info'")
