"""The bank-swap benchmark: a module with PEFT's LoRA names on FSDP2-style DTensors, swapped slot by slot."""

from __future__ import annotations

import pytest

from populora_verl.bench import bank_swap as bs


# In a child process: a gloo group in this one left a later module's Ray start (ray.init from a thread) hanging
# in its forked child under pytest.
_MODULE_CHECK = """
import json
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from populora_verl.bench import bank_swap as bs, optimizer_step as ops
from populora_verl.workers.adapter_bank import AdapterBank
shapes = ops.lora_shapes(4, scale=96, dims=ops.QWEN_1_5B | {"layers": 2})
ops.init_one_rank("cpu")
model = bs.lora_module(shapes, init_device_mesh("cpu", (1,)), "cpu")
print(json.dumps({"names": [n for n, _ in model.named_parameters()], "shapes": [list(p.shape) for p in model.parameters()],
                  "expected": [list(s) for s in shapes], "keys": len(AdapterBank(model).peft_keys)}))
dist.destroy_process_group()
"""


def test_the_module_carries_peft_names_and_the_shapes_in_order():
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _MODULE_CHECK], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["names"][:2] == ["layers.0.q_proj.lora_A.default.weight", "layers.0.q_proj.lora_B.default.weight"]
    assert got["shapes"] == got["expected"] and len(got["shapes"]) == 28
    assert got["keys"] == 28  # the bank finds every one as a LoRA parameter


def test_main_prints_both_swaps_per_round(capsys, monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert bs.main(["--scale", "96", "--layers", "2", "--rounds", "2", "--slots", "2"]) == 0
    out = capsys.readouterr().out
    assert "28 LoRA tensors" in out and "2 slots, 2 rounds on cpu" in out
    lines = {ln.split(":")[0]: ln for ln in out.splitlines() if ln.startswith("swap_")}
    assert set(lines) == {"swap_in_ms", "swap_out_ms"}
    assert all(float(ln.split()[2]) > 0 for ln in lines.values())
    import os

    assert "MASTER_PORT" not in os.environ  # a later process group (or a child's) must not find a stale port


def test_one_slot_is_refused(capsys):
    with pytest.raises(SystemExit):
        bs.main(["--slots", "1"])
    assert "--slots must be >= 2" in capsys.readouterr().err
