"""Every console script ends a user mistake in one line, without a traceback (``--debug`` shows it)."""

from __future__ import annotations

import json

import pytest

from populora_verl.eval.cli import eval_main, report_main
from populora_verl.local.__main__ import main as local_main


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err, err
    return err


def test_local_invalid_yaml_and_missing_model(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("populora:\n  pbt: [unclosed\n")
    assert local_main(["--config", str(bad), "--run-dir", str(tmp_path / "r")]) == 2
    assert _one_line(capsys).startswith(f"error: --config: {bad} is not valid YAML (line 3)")
    empty = tmp_path / "model"
    empty.mkdir()
    assert local_main(["--model", str(empty), "--run-dir", str(tmp_path / "r")]) == 2
    assert _one_line(capsys) == (f"error: --model: {empty} holds no HF model (no config.json); convert a GGUF with "
                                 "`python -m populora_verl.models convert` or pass --gguf")


def test_local_ctrl_c_names_the_last_checkpoint_and_the_resume_command(tmp_path, capsys, monkeypatch):
    import populora_verl.local.driver as driver_mod

    run = tmp_path / "run"
    for step in (1, 2):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step}" / "COMPLETE").write_text("")
    (run / "checkpoints" / "step_3.tmp").mkdir()  # the save Ctrl-C interrupted

    class Interrupted:
        def __init__(self, *a, **kw):
            raise KeyboardInterrupt

    monkeypatch.setattr(driver_mod, "LocalDriver", Interrupted)
    assert local_main(["--run-dir", str(run), "--resume"]) == 130
    assert _one_line(capsys) == (f"populora-local: interrupted; last complete checkpoint: {run}/checkpoints/step_2; "
                                 f"continue with: python -m populora_verl.local --run-dir {run} --resume")
    assert local_main(["--run-dir", str(run), "--resume", "--model", str(tmp_path / "m")]) == 130
    assert _one_line(capsys).endswith(f"--run-dir {run} --model {tmp_path / 'm'} --resume")
    assert local_main(["--run-dir", str(tmp_path / "fresh")]) == 130
    assert "nothing to resume" in _one_line(capsys)
    with pytest.raises(KeyboardInterrupt):  # --debug: the traceback, for a bug report
        local_main(["--run-dir", str(run), "--resume", "--debug"])


def _damaged_run(tmp_path):
    pop = tmp_path / "run" / "checkpoints" / "step_1" / "population"
    pop.mkdir(parents=True)
    (pop.parent / "COMPLETE").write_text("")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_1\n")
    (pop / "population.json").write_text('{"format": 1, "lineage": [')  # truncated
    return tmp_path / "run"


def test_eval_errors_are_one_line(tmp_path, capsys):
    assert eval_main(["--run-dir", str(tmp_path / "missing"), "--benchmarks", "gsm8k"]) == 1
    assert "no population.json under" in _one_line(capsys)
    run = _damaged_run(tmp_path)
    assert eval_main(["--run-dir", str(run), "--benchmarks", "gsm8k"]) == 1
    err = _one_line(capsys)
    assert err.startswith("populora-eval: error: ") and "--debug" in err
    assert eval_main(["--benchmarks", "gsm8k", "--data-dir", str(tmp_path / "nope")]) == 1
    assert "--data-dir: benchmark directory" in _one_line(capsys)
    with pytest.raises(json.JSONDecodeError):
        eval_main(["--run-dir", str(run), "--benchmarks", "gsm8k", "--debug"])


def test_report_errors_are_one_line(tmp_path, capsys):
    assert report_main([str(tmp_path / "missing")]) == 1
    assert _one_line(capsys) == f"populora-report: error: run directory {tmp_path / 'missing'} does not exist " \
                                "(--debug shows the traceback)"
    run = _damaged_run(tmp_path)
    (run / "metrics.jsonl").write_text('{"step": 1, "populora/validity/mean": 0.5}\n{"step": 2, "popu')
    assert report_main([str(run), "--out", str(tmp_path / "rep")]) == 1
    assert _one_line(capsys).startswith("populora-report: error: ")
