"""``RUN/STOP`` ends a CPU-driver run at its next safe step, as it does a verl run: no evolution, a checkpoint."""

from __future__ import annotations

from populora_verl.checkpoint import latest_checkpoint
from populora_verl.local.__main__ import main

QUICK = ["-q", "populora.rollout.max_new_tokens=8", "local.tensorboard=false", "populora.diagnostics.plots=false",
         "local.save_every=0"]


def test_a_stop_file_ends_the_run_after_the_next_step_with_a_checkpoint(tmp_path, capsys, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "STOP").write_text("")  # left from before the start: said at once, then obeyed
    assert main(["--run-dir", str(run), "--steps", "5", *QUICK]) == 0
    out = capsys.readouterr().out
    assert "step 1/5 |" in out and "step 2/5" not in out
    assert f"stop file {run / 'STOP'} exists" in caplog.text
    assert f"step 1: stop file {run / 'STOP'} found" in caplog.text
    assert latest_checkpoint(run).name == "step_1"


def test_a_stop_file_waits_for_its_step_and_for_the_children_to_train(tmp_path, capsys):
    """``echo 3 > STOP`` with a 2-step quiet window: step 2's children are 1 step old at step 3, so the run ends
    after step 4, skipping that step's evolution."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "STOP").write_text("3\n")
    assert main(["--run-dir", str(run), "--steps", "8", "populora.pbt.final_quiet_steps=2", *QUICK]) == 0
    out = capsys.readouterr().out
    assert "step 4/8 |" in out and "step 5/8" not in out
    assert [line.split(" |")[0] for line in out.splitlines() if "evolved" in line] == ["step 2/8"]
    assert latest_checkpoint(run).name == "step_4"
