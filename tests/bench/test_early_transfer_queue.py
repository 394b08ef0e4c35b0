"""The early TransferQueue benchmark's rounds and table, with a stand-in measurement (a real round starts a Ray
cluster per arm: run it on purpose, BENCHMARKS.md §5)."""

from __future__ import annotations

import pytest

from populora_verl.bench import early_transfer_queue as bench


def test_arms_alternate_and_the_table_gives_medians_and_the_ratio(capsys):
    calls = []

    def fake(arm, units, timeout_s):
        calls.append(arm)
        n = calls.count(arm)
        return {"ready_s": (20.0 if arm == "A" else 14.0) + n, "init_s": 9.0 if arm == "A" else 4.0}

    assert bench.main(["--rounds", "3", "--units", "1"], measure=fake) == 0
    assert calls == ["A", "B", "B", "A", "A", "B"]
    out = capsys.readouterr().out
    assert "| A: the task runner starts it | 22.0 (21.0-23.0) | 9.0 (9.0-9.0) | 1.00 |" in out
    assert "| B: the launching process starts it | 16.0 (15.0-17.0) | 4.0 (4.0-4.0) | 0.73 |" in out
    assert "1 storage units" in out


def test_rounds_and_units_must_be_positive():
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"], measure=lambda *a: {})
