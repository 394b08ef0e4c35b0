"""Slot micro-batching on a real 2-process gloo group (CPU): ranks holding different rows agree on one micro-batch
count (verl's forward and backward collectives pair up only then), or all fall back to verl's own partition."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORLD = 2
BUDGET = 10
# per case, each rank's rows as (slot, tokens)
CASES = {
    # rank 0 packs into 2 micro-batches, rank 1 into 4: rank 0 splits to 4
    "uneven": [[(0, 4), (0, 4), (1, 4), (1, 4)], [(0, 9), (1, 9), (2, 9), (3, 9)]],
    # rank 1 packs in slot order into 3 micro-batches (6 | 5 4 | 5), which rank 0's 2 rows cannot match; verl's
    # balanced partition needs 2 (6 4 | 5 5): both ranks take it
    "too_few_rows": [[(0, 2), (1, 2)], [(0, 6), (1, 5), (2, 4), (3, 5)]],
}


RANK_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import seqlen_balancing, tensordict_utils as tu
from populora_verl.workers import resident_engine

seqlen_balancing.get_device_name = lambda: "cpu"  # verl's own partition (the fallback) on a CPU gloo group

rank, port, outdir, budget = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
cases = json.loads(sys.argv[5])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=len(next(iter(cases.values()))))
out = {}
for name, ranks in cases.items():
    rows = ranks[rank]
    lengths = [n for _, n in rows]
    offs = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    td = TensorDict({"input_ids": torch.nested.nested_tensor_from_jagged(torch.arange(int(offs[-1])), offs),
                     resident_engine.SLOT_FIELD: torch.tensor([k for k, _ in rows])}, batch_size=[len(rows)])
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=budget)
    micro, parts = resident_engine._slot_micro_batches(td, dp_group=dist.group.WORLD)
    out[name] = {"parts": [list(map(int, p)) for p in parts],
                 "tokens": [int(m["input_ids"].offsets()[-1]) for m in micro]}
json.dump(out, open(os.path.join(outdir, f"rank{rank}.json"), "w"))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("slot_micro")
    script = outdir / "rank.py"
    script.write_text(RANK_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port), str(outdir), str(BUDGET), json.dumps(CASES)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(WORLD)
    ]
    logs = [p.communicate()[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-3000:]}"
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_ranks_agree_on_the_count_by_splitting(results):
    r0, r1 = results[0]["uneven"], results[1]["uneven"]
    assert len(r0["parts"]) == len(r1["parts"]) == 4
    assert r1["parts"] == [[0], [1], [2], [3]]
    assert sorted(i for p in r0["parts"] for i in p) == [0, 1, 2, 3]
    assert all(t <= BUDGET for r in (r0, r1) for t in r["tokens"])


def test_ranks_fall_back_together_when_one_cannot_split(results):
    r0, r1 = results[0]["too_few_rows"], results[1]["too_few_rows"]
    # verl's own partition: the same count on both ranks, every row once, within the budget
    assert len(r0["parts"]) == len(r1["parts"]) == 2
    assert sorted(i for p in r0["parts"] for i in p) == [0, 1]
    assert sorted(sorted(p) for p in r1["parts"]) == [[0, 2], [1, 3]]
    assert all(t <= BUDGET for r in (r0, r1) for t in r["tokens"])
