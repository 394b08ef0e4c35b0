"""The preload bench (populora_verl.bench.engine_preload) end to end on a light module: both arms run in fresh
interpreters, the child imports what it is given, the table and the ratio are printed."""

from __future__ import annotations

import pytest

from populora_verl.bench import engine_preload as bench


def test_both_arms_report_and_the_table_prints(capsys):
    assert bench.main(["--modules", "json,decimal", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "round 1 spawn: start() to ready" in out and "round 1 preloaded: start() to ready" in out
    assert "| forked from the preloaded forkserver |" in out and "preloaded / spawn:" in out


def test_a_child_that_cannot_import_fails_the_round_with_the_arm_named():
    with pytest.raises(RuntimeError, match="spawn: "):
        bench.measure_once("spawn", ["populora_no_such_module_here"], timeout_s=300)


def test_rounds_must_be_positive():
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
