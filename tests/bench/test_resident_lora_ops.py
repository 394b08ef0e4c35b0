"""``python -m populora_verl.bench.resident_lora --count-ops``: kernels and bytes per micro-batch of one decoder
layer's LoRA linears, counted at full size on meta tensors. The figures are structural (no timing), so these tests
pin what the resident forward writes against the bank's lean forward."""

from __future__ import annotations

import pytest

from populora_verl.bench import resident_lora as R

TOKENS = 4096


@pytest.fixture(scope="module")
def counts():
    def run(arm, slots=1, interleaved=False, grouped=True):
        fwd, bwd = R.count_layer_ops(arm, slots=slots, interleaved=interleaved, tokens=TOKENS, rank=16,
                                     grouped=grouped)
        return fwd, bwd
    return run


def test_one_resident_slot_writes_what_the_banks_lean_forward_writes(counts):
    bank, res = counts("bank"), counts("resident", 1)
    for b, r in zip(bank, res, strict=True):
        # the same activation-sized passes (one addmm per linear); only the weights' small casts differ
        assert r.full_ops == b.full_ops
        assert abs(r.bytes - b.bytes) < 0.01 * b.bytes


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
def test_slots_present_cost_no_activation_pass_of_their_own(counts, grouped):
    bank_fwd, bank_bwd = counts("bank")
    fwd8, bwd8 = counts("resident", 8, grouped=grouped)
    if grouped:
        # the grouped kernel: as many kernels for 16 slots as for 8, and one extra activation-sized add per linear
        fwd16, bwd16 = counts("resident", 16)
        assert (fwd16.ops, bwd16.ops) == (fwd8.ops, bwd8.ops)
        assert fwd8.full_ops == bank_fwd.full_ops + 7 and bwd8.full_ops == bank_bwd.full_ops
    # each slot's weights: one stacked cast per set and linear forward, one multi-tensor add backward
    assert fwd8.names["_to_copy"] == 14 and bwd8.names["_foreach_add_"] == 7 and "add_" not in bwd8.names


def test_interleaved_rows_pay_the_permutation(counts):
    sorted_, inter = counts("resident", 8), counts("resident", 8, interleaved=True)
    assert inter[0].names["index_select"] == 7 and "index_select" not in sorted_[0].names
    assert inter[0].bytes > sorted_[0].bytes and inter[1].bytes > sorted_[1].bytes


def test_the_command_prints_every_arm(capsys):
    assert R.main(["--count-ops", "--micro-tokens", str(TOKENS), "--rank", "16"]) == 0
    out = capsys.readouterr().out
    for label in ("base", "bank", "resident 1 slot", "resident 16 slots", "resident 8 slots interleaved"):
        assert f"  {label} " in out
