"""A damaged checkpoint is named in one line and resume falls back to the newest one that loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from populora_verl.checkpoint import CheckpointError, load_checkpoint, load_latest_checkpoint, save_checkpoint
from populora_verl.config import load_config
from populora_verl.step import PopulationStep

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["m"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory, executor):
    """A run directory with complete checkpoints step_1..step_3 (optimizer states included)."""
    cfg = load_config({"population": {"num_teachers": 1, "num_students": 1},
                       "diagnostics": {"cvt_cells": 8, "cvt_samples": 500}})
    ps = PopulationStep(cfg, executor=executor, seed=0)
    root = tmp_path_factory.mktemp("run")
    g = torch.Generator().manual_seed(0)
    for step in (1, 2, 3):
        adapters = {i: {"m.lora_A.weight": torch.randn(4, 8, generator=g),
                        "m.lora_B.weight": torch.randn(8, 4, generator=g)} for i in ps.population.ids()}
        optim = {i: {"state": {0: {"exp_avg": torch.randn(3, generator=g)}}, "param_groups": []}
                 for i in ps.population.ids()}
        save_checkpoint(root, step, population=ps.population, adapters=adapters, lora_config=LORA,
                        optimizers=optim, step_state=ps.state_dict(), extra={"step": step})
    return root


@pytest.fixture
def damaged(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _resume(run_dir):
    lines = []
    ck = load_latest_checkpoint(run_dir, warn=lines.append)
    return ck, lines


@pytest.mark.parametrize("rel", ["coverage.npz", "state.json", "buffers.json", "optimizer/t0.pt",
                                 "population/population.json", "population/adapters/s0/adapter_model.safetensors",
                                 "population/adapters/t0/adapter_config.json"])
def test_truncated_file_is_named_and_resume_falls_back(damaged, rel):
    bad = damaged / "checkpoints" / "step_3" / rel
    _truncate(bad)
    with pytest.raises(CheckpointError, match=str(bad)):
        load_checkpoint(damaged / "checkpoints" / "step_3")
    ck, lines = _resume(damaged)
    assert ck.step == 2 and ck.extra == {"step": 2}
    assert len(lines) == 2 and str(bad) in lines[0] and "\n" not in lines[0]
    assert "step_2" in lines[1]


@pytest.mark.parametrize("rel", ["coverage.npz", "optimizer/s0.pt", "population/adapters/t0/adapter_model.safetensors"])
def test_missing_file_is_named_and_resume_falls_back(damaged, rel):
    bad = damaged / "checkpoints" / "step_3" / rel
    bad.unlink()
    ck, lines = _resume(damaged)
    assert ck.step == 2
    assert f"{bad}: missing" in lines[0]


def test_missing_complete_marker_is_reported_and_skipped(damaged):
    (damaged / "checkpoints" / "step_3" / "COMPLETE").unlink()
    ck, lines = _resume(damaged)
    assert ck.step == 2
    assert "step_3" in lines[0] and "COMPLETE" in lines[0]


def test_every_checkpoint_damaged_stops_with_a_clear_message(damaged):
    for step in (1, 2, 3):
        _truncate(damaged / "checkpoints" / f"step_{step}" / "coverage.npz")
    with pytest.raises(CheckpointError, match="no checkpoint in .* can be loaded"):
        _resume(damaged)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_latest_checkpoint(damaged / "nowhere")


def test_cli_resume_errors_are_one_line(damaged, capsys):
    """``python -m populora_verl.local --resume``: no loadable checkpoint is one error line (before any model is
    built); a run directory without checkpoints is an error, not a silent fresh start."""
    from populora_verl.local.__main__ import main

    (damaged / "checkpoints" / "step_1" / "population" / "population.json").write_text("{not json")
    for step in (2, 3):
        _truncate(damaged / "checkpoints" / f"step_{step}" / "optimizer" / "t0.pt")
    # Every checkpoint is damaged: one error line, exit status 2, no traceback.
    rc = main(["--run-dir", str(damaged), "--resume", "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("populora-local: error: no checkpoint in") and "can be loaded" in err
    rc = main(["--run-dir", str(damaged / "missing"), "--resume", "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == (f"populora-local: error: --resume: no run directory {damaged / 'missing'}; "
                                       "drop --resume to start a new run there")
    assert not (damaged / "missing").exists()
    (damaged / "empty").mkdir()
    rc = main(["--run-dir", str(damaged / "empty"), "--resume", "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == (f"populora-local: error: --resume: no complete checkpoint in "
                                       f"{damaged / 'empty' / 'checkpoints'}; drop --resume to start a new run there")
    assert sorted((damaged / "empty").iterdir()) == []  # the refused resume wrote nothing there


# --- the verl trainer: global_step_N folders -----------------------------------------------------------------


@pytest.fixture
def verl_run(run, tmp_path):
    """A verl run directory: global_step_{1,2,3} with verl's actor folder, the PopuLoRA checkpoint and bank files,
    and verl's tracker naming step 3."""
    root = tmp_path / "verl_run"
    for step in (1, 2, 3):
        pdir = root / f"global_step_{step}" / "populora"
        shutil.copytree(run / "checkpoints" / f"step_{step}", pdir / "checkpoints" / f"step_{step}")
        (pdir / "checkpoints" / "latest").write_text(f"step_{step}\n")
        (pdir / "bank").mkdir()
        for rank in (0, 1):
            torch.save({"slots": [torch.ones(3) * step]}, pdir / "bank" / f"bank_world_size_2_rank_{rank}.pt")
        (root / f"global_step_{step}" / "actor").mkdir()
        (root / f"global_step_{step}" / "actor" / "model_world_size_2_rank_0.pt").write_bytes(b"x")
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    return root


@pytest.mark.parametrize("damage", ["truncated bank", "missing bank rank", "truncated coverage", "no COMPLETE",
                                    "no actor"])
def test_verl_resume_falls_back_past_a_damaged_step(verl_run, damage):
    from populora_verl.trainer.resume import choose_resume_folder

    g3 = verl_run / "global_step_3"
    bad = {"truncated bank": g3 / "populora" / "bank" / "bank_world_size_2_rank_1.pt",
           "missing bank rank": g3 / "populora" / "bank" / "bank_world_size_2_rank_0.pt",
           "truncated coverage": g3 / "populora" / "checkpoints" / "step_3" / "coverage.npz",
           "no COMPLETE": g3 / "populora" / "checkpoints",
           "no actor": g3 / "actor"}[damage]
    if damage == "truncated bank" or damage == "truncated coverage":
        _truncate(bad)
    elif damage == "missing bank rank":
        bad.unlink()
    elif damage == "no COMPLETE":
        (bad / "step_3" / "COMPLETE").unlink()
    else:
        shutil.rmtree(bad)
    lines = []
    folder, ck = choose_resume_folder(verl_run, warn=lines.append)
    assert folder == verl_run / "global_step_2" and ck.step == 2
    assert str(bad) in lines[0] and "global_step_3" in lines[0] and "global_step_2" in lines[1]


def test_verl_resume_without_usable_checkpoint_stops(verl_run, tmp_path):
    from populora_verl.trainer.resume import choose_resume_folder

    assert choose_resume_folder(tmp_path / "fresh") == (None, None)
    for step in (1, 2, 3):
        _truncate(verl_run / f"global_step_{step}" / "populora" / "bank" / "bank_world_size_2_rank_0.pt")
    with pytest.raises(CheckpointError, match="no usable checkpoint .*global_step_3, global_step_2, global_step_1"):
        choose_resume_folder(verl_run, warn=lambda _: None)


def test_trainer_load_checkpoint_hands_verl_the_fallback_folder(verl_run, bare_trainer):
    """PopuLoRATrainer._load_checkpoint: verl's own loader gets the older folder, and the population comes from
    the same step."""
    from omegaconf import OmegaConf

    _truncate(verl_run / "global_step_3" / "populora" / "checkpoints" / "step_3" / "state.json")
    t = bare_trainer(OmegaConf.create({"trainer": {"resume_mode": "auto", "default_local_dir": str(verl_run),
                                                   "resume_from_path": None, "del_local_ckpt_after_load": False}}),
                     pcfg=load_config({"population": {"num_teachers": 1, "num_students": 1}}),
                     use_critic=False, trainer_mode="sync")
    calls, loaded = [], {}

    class _WG:
        def __getattr__(self, name):
            return lambda *a, **kw: calls.append((name, a, kw)) or [None, None]

    class _Step:
        def load_state_dict(self, state, population):
            loaded["population"] = population

    t.actor_rollout_wg, t.pop_step = _WG(), _Step()
    # events of steps the resumed run will redo leave the evolution log, as on the CPU driver
    (verl_run / "evolution.jsonl").write_text("".join(json.dumps({"step": s, "replacements": []}) + "\n"
                                                      for s in (1, 2, 3)))
    t._load_checkpoint()
    assert t.global_steps == 2
    assert [json.loads(x)["step"] for x in (verl_run / "evolution.jsonl").read_text().splitlines()] == [1, 2]
    actor = next(kw for name, _, kw in calls if name == "load_checkpoint")
    assert actor["local_path"] == str(verl_run / "global_step_2" / "actor")
    bank = next(a for name, a, _ in calls if name == "populora_load_bank")
    assert bank[0] == str(verl_run / "global_step_2" / "populora" / "bank")
    assert loaded["population"] is not None


def test_pruning_keeps_the_newest_whole_step_folders_and_the_tracked_one(tmp_path):
    """trainer.max_actor_ckpt_to_keep removes whole global_step_N folders (verl's own pruning would leave our
    populora/ part behind), never the one verl's tracker names, and nothing when unset."""
    from populora_verl.trainer.resume import prune_step_folders

    for s in (5, 10, 15, 20):
        (tmp_path / f"global_step_{s}" / "populora").mkdir(parents=True)
    (tmp_path / "global_step_x").mkdir()  # not a step folder: never touched
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")  # a resume that fell back to step 5
    assert prune_step_folders(tmp_path, None) == [] and prune_step_folders(tmp_path, 0) == []
    gone = prune_step_folders(tmp_path, 2)
    assert sorted(p.name for p in gone) == ["global_step_10"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step_15", "global_step_20", "global_step_5", "global_step_x", "latest_checkpointed_iteration.txt"]
    assert prune_step_folders(tmp_path / "missing", 2) == []
