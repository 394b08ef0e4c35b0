"""The optimizer-step benchmark: LoRA shapes of a Qwen2 stack, every AdamW implementation on FSDP2-style DTensors."""

from __future__ import annotations

import pytest

from populora_verl.bench import optimizer_step as ops


def test_lora_shapes_are_a_qwen2_stacks_adapters():
    shapes = ops.lora_shapes(16)
    assert len(shapes) == 28 * 7 * 2  # A and B of q k v o gate up down, per layer
    assert sum(r * c for r, c in shapes) == 18_464_768  # Qwen2.5-1.5B's LoRA at r=16
    assert shapes[:4] == [(16, 1536), (1536, 16), (16, 1536), (256, 16)]  # q's A and B, k's A and B
    tiny = ops.lora_shapes(4, scale=96, dims=ops.QWEN_1_5B | {"layers": 1})
    assert len(tiny) == 14 and (4, 16) in tiny and (93, 4) in tiny  # widths divided, the tensor count kept


def test_every_implementation_steps_alike_and_the_table_prints(capsys):
    # one rank, gloo: main sets the process group up and tears it down
    assert ops.main(["--scale", "96", "--layers", "2", "--rounds", "2", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines() if line.startswith("| ")}
    assert {"foreach", "fused", "for-loop"} <= set(rows)
    assert rows["foreach"][4].strip() == "1.00"
    for name in ("fused", "for-loop"):  # the same AdamW: one step from one state lands on the same parameters
        assert float(rows[name][6]) < 1e-6
    assert "28 LoRA tensors" in out  # 2 layers x 7 modules x (A, B)


def test_unknown_implementations_and_a_missing_gpu_are_refused(capsys):
    with pytest.raises(SystemExit):
        ops.main(["--impls", "foreach,turbo"])
    assert "--impls: unknown ['turbo']" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert ops.main(["--device", "cuda"]) == 2
        assert "no CUDA GPU is visible" in capsys.readouterr().err
