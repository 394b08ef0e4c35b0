"""python -m populora_verl.bench.evolution_event: one evolution event, the trainer's former path and the workers'."""

from __future__ import annotations

from populora_verl.bench import evolution_event as bench


def test_the_benchmark_runs_both_paths_and_prints_a_table(capsys):
    assert bench.main(["--rounds", "2", "--layers", "1", "--rank", "4", "--slots", "5"]) == 0
    out = capsys.readouterr().out
    assert "| driver |" in out and "| workers |" in out
    assert "round 2 workers" in out and "round 2 driver" in out
