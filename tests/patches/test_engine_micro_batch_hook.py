"""0014: the FSDP engine's micro-batch split is an overridable method (the plugin's resident adapters keep each slot's
rows in few micro-batches by rebinding the module-level ``prepare_micro_batches`` of verl's FSDP engine module for the
duration of each ``forward_backward_batch``)."""

from __future__ import annotations

PATCH = "0014-engine-micro-batch-hook.patch"

# verl's own forward_backward_batch (train and forward-only) and micro-batch split on CPU: FSDPEngineWithLMHead built
# without its GPU set-up on a one-rank gloo group, with a stand-in forward_step (a per-token score from one weight).
CHECK = """
import ast, atexit, inspect, os, shutil, tempfile
import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import seqlen_balancing, tensordict_utils as tu
from verl.workers.engine import utils as engine_utils
from verl.workers.engine.fsdp import transformer_impl as impl

impl.get_device_id = seqlen_balancing.get_device_name = lambda: "cpu"  # verl's device queries, on a gloo group
root = tempfile.mkdtemp()
atexit.register(shutil.rmtree, root, True)
dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)

TASKS = [2, 0, 1, 0, 2, 1, 1, 0]
LENGTHS = [5, 3, 7, 2, 4, 6, 3, 5]

def batch(dynamic=True):
    offs = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    ids = torch.nested.nested_tensor_from_jagged(torch.arange(1, int(offs[-1]) + 1), offs)
    loss_mask = torch.nested.nested_tensor_from_jagged(torch.ones(int(offs[-1]), dtype=torch.long), offs)
    td = TensorDict({"input_ids": ids, "loss_mask": loss_mask, "task": torch.tensor(TASKS)}, batch_size=[len(TASKS)])
    tu.assign_non_tensor(td, use_dynamic_bsz=dynamic, max_token_len_per_gpu=12, micro_batch_size_per_gpu=2)
    return td

seen, splits = [], []

class Scored(impl.FSDPEngineWithLMHead):
    def forward_step(self, micro_batch, loss_function, forward_only):
        seen.append(micro_batch["task"].tolist())
        ids = micro_batch["input_ids"]
        score = torch.nested.nested_tensor_from_jagged(ids.values().float() * self.weight, ids.offsets())
        loss = score.values().sum()
        return loss, {"model_output": {"score": score}, "loss": loss.detach()}

class ByTask(Scored):
    def prepare_micro_batches(self, data):
        tasks = data["task"].tolist()
        parts = [[i for i, t in enumerate(tasks) if t == k] for k in sorted(set(tasks))]
        splits.append(parts)
        return [tu.index_select_tensor_dict(data, p) for p in parts], parts

def build(cls):
    eng = cls.__new__(cls)
    eng.ulysses_sequence_parallel_size, eng.ulysses_device_mesh, eng.scaler = 1, None, None
    eng.engine_config = type("Cfg", (), {"use_no_sync_for_gradient_accumulation": True})()
    eng.module = torch.nn.Linear(1, 1)  # what the gradient-sync context looks at
    eng.weight = torch.nn.Parameter(torch.tensor(0.5))
    return eng

want_score = [0.5 * torch.arange(1, sum(LENGTHS) + 1).float()[sum(LENGTHS[:i]):sum(LENGTHS[:i + 1])]
              for i in range(len(TASKS))]

# a subclass's split is the one verl's forward_backward_batch runs, training and forward-only
for forward_only in (False, True):
    seen.clear(), splits.clear()
    eng = build(ByTask)
    out = eng.forward_backward_batch(batch(), loss_function=None, forward_only=forward_only)
    assert len(splits) == 1, "verl did not use the engine's own micro-batch split"
    assert seen == [[0, 0, 0], [1, 1, 1], [2, 2]], seen
    if forward_only:  # the outputs come back in row order through the split's indices
        got = out["model_output"]["score"].unbind()
        assert all(torch.equal(g, w) for g, w in zip(got, want_score, strict=True)), got
    else:  # one backward per micro-batch, accumulated over the batch
        assert eng.weight.grad == float(sum(range(1, sum(LENGTHS) + 1))), eng.weight.grad

# the default split is verl's, with the arguments forward_backward_batch passed before
eng = build(Scored)
for dynamic in (True, False):
    data = batch(dynamic)
    tu.assign_non_tensor(data, sp_size=1)
    mine, idx = eng.prepare_micro_batches(data)
    theirs, want = engine_utils.prepare_micro_batches(data=data, dp_group=dist.group.WORLD, same_micro_num_in_dp=True)
    assert idx == want and [m["task"].tolist() for m in mine] == [m["task"].tolist() for m in theirs], (idx, want)
seen.clear()
eng.forward_backward_batch(batch(), loss_function=None, forward_only=True)
assert sorted(t for m in seen for t in m) == sorted(TASKS) and len(seen) > 1, seen
assert any(len(set(m)) > 1 for m in seen), seen  # verl's balanced split mixes tasks: the override above mattered

# VeOmniEngine (an FSDPEngine whose own forward_backward_batch needs the veomni package) splits through the method
src = open(os.path.join(os.path.dirname(impl.__file__), "..", "veomni", "transformer_impl.py")).read()
fbb = next(n for c in ast.parse(src).body if isinstance(c, ast.ClassDef) and c.name == "VeOmniEngine"
           for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "forward_backward_batch")
calls = [ast.unparse(n.func) for n in ast.walk(fbb) if isinstance(n, ast.Call)]
assert "self.prepare_micro_batches" in calls and "prepare_micro_batches" not in calls, calls

dist.destroy_process_group()
print("ok")
"""


def test_a_subclass_chooses_the_fsdp_engines_micro_batches(fails_without_passes_with):
    assert "ok" in fails_without_passes_with(
        PATCH, CHECK, expect_without="verl did not use the engine's own micro-batch split"
    )
