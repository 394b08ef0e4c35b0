"""Exact resume: a run killed between steps, or during a checkpoint write, continues bit-identically."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from populora_verl.checkpoint import latest_checkpoint, load_checkpoint
from populora_verl.local.__main__ import build_configs, parse_args
from populora_verl.local.driver import LocalDriver

STEPS = 3


def _h(text: str) -> int:
    return zlib.crc32(text.encode())


def _scripted_validate(self, items):
    """A random model proposes nothing valid; make some proposals "valid" (a deterministic function of the text) so
    teachers get spread-out rewards, non-zero advantages and real updates to compare after a resume."""
    from populora_verl.tasks import identity_task

    out = []
    for task_type, text, meta, teacher, step in items:
        if task_type != "code_f" and _h(text) % 2 == 0:
            t = identity_task(task_type)
            t.teacher, t.step, t.input = teacher, step, repr(text[:8])
            t.output, t.id = t.input, ""
            t.__post_init__()
            out.append((t, "valid"))
        else:
            out.append((None, "format_error"))
    return out


def _scripted_score(self, items):
    return [((1.0, True, "correct"), (-0.5, False, "wrong"), (-1.0, False, "format_error"))[_h(text) % 3]
            for _, text in items]


@pytest.fixture(scope="module", autouse=True)
def scripted():
    with pytest.MonkeyPatch.context() as mp:
        from populora_verl.step.task_env import TaskEnv

        mp.setattr(TaskEnv, "validate_many", _scripted_validate)
        mp.setattr(TaskEnv, "score_many", _scripted_score)
        yield


def _driver(run_dir, steps, resume=False):
    args = parse_args(["--run-dir", str(run_dir), "-q", "--steps", str(steps), "--seed", "7",
                       "populora.rollout.max_new_tokens=16", "local.tensorboard=false",
                       "populora.diagnostics.plots=false"] + (["--resume"] if resume else []))
    cfg, local = build_configs(args)
    return LocalDriver(cfg, local, run_dir, resume=resume)


def _run(run_dir, steps, resume=False):
    d = _driver(run_dir, steps, resume)
    try:
        d.run()
    finally:
        d.close()
    return d


def _state(run_dir):
    ck = load_checkpoint(latest_checkpoint(run_dir))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if "/time/" not in k} for r in rows]
    state = dict(ck.step_state)
    coverage = state.pop("coverage")
    return ck, rows, state, coverage


def _without_base_path(state):
    state = dict(state)
    if state.get("lora_config"):
        state["lora_config"] = {k: v for k, v in state["lora_config"].items() if k != "base_model_name_or_path"}
    return state


def _assert_same(a_dir, b_dir):
    ck_a, rows_a, st_a, cov_a = _state(a_dir)
    ck_b, rows_b, st_b, cov_b = _state(b_dir)
    assert ck_a.step == ck_b.step == STEPS
    # The comparison has teeth: founders that survived were actually trained (LoRA B starts at zero).
    founders = [m.id for m in ck_a.population.members if not m.parents]
    assert founders and all(any(v.abs().sum() > 0 for k, v in ck_a.adapters[m].items() if "lora_B" in k)
                            for m in founders)
    assert any("populora/pair/" in k for r in rows_a for k in r)  # some matches had valid tasks
    assert rows_a == rows_b  # every logged metric of every step, once each
    # ratings, lineage; the adapters' base-model path names each run's own folder
    assert _without_base_path(ck_a.population.state_dict()) == _without_base_path(ck_b.population.state_dict())
    assert set(ck_a.adapters) == set(ck_b.adapters)
    for m, sd in ck_a.adapters.items():
        for k, v in sd.items():
            assert torch.equal(v, ck_b.adapters[m][k]), (m, k)  # bit-identical
    for m, opt in ck_a.optimizers.items():
        for pid, s in opt["state"].items():
            for name, t in s.items():
                assert torch.equal(t, ck_b.optimizers[m]["state"][pid][name]), (m, pid, name)
    assert json.dumps(st_a, sort_keys=True) == json.dumps(st_b, sort_keys=True)  # buffers, matchmaker, PBT, RNG
    assert all((cov_a[k] == cov_b[k]).all() for k in cov_a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    _run(run_dir, STEPS)
    return run_dir


def test_kill_between_steps_then_resume(uninterrupted, tmp_path):
    _run(tmp_path, 1)  # "killed" after step 1 (checkpoint step_1 written)
    d = _run(tmp_path, STEPS, resume=True)
    assert d.start_step == 1
    _assert_same(uninterrupted, tmp_path)


def test_kill_during_save_never_loads_half_checkpoint(uninterrupted, tmp_path, monkeypatch):
    _run(tmp_path, 1)
    with pytest.raises(FileExistsError, match="--resume"):  # a fresh run never overwrites a run dir
        _driver(tmp_path, STEPS)
    d = _driver(tmp_path, STEPS, resume=True)
    real_save = torch.save
    calls = {"n": 0}

    def dying_save(obj, f, *a, **kw):  # die in the middle of writing the optimizer states of step 2
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed during save")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        d.run()
    d.close()
    monkeypatch.setattr(torch, "save", real_save)
    ckdir = tmp_path / "checkpoints"
    assert (ckdir / "step_2.tmp").is_dir() and not (ckdir / "step_2").exists()
    assert (ckdir / "latest").read_text().strip() == "step_1"
    assert latest_checkpoint(tmp_path) == ckdir / "step_1"
    # Even a stale pointer to a half-written folder is ignored.
    (ckdir / "latest").write_text("step_2\n")
    assert latest_checkpoint(tmp_path) == ckdir / "step_1"
    d = _run(tmp_path, STEPS, resume=True)
    assert d.start_step == 1
    assert not (ckdir / "step_2.tmp").exists()
    _assert_same(uninterrupted, tmp_path)


def test_keep_checkpoints_prunes_old_steps_but_never_latest(tmp_path):
    """``local.keep_checkpoints`` (default 2): the newest N complete checkpoints stay, what ``latest`` names is
    never deleted, incomplete folders are left for the next save, and 0 keeps all."""
    from populora_verl.checkpoint import latest_checkpoint, list_checkpoints, prune_checkpoints
    from populora_verl.local.config import LocalConfig, load_local_config

    assert LocalConfig().keep_checkpoints == 2
    from populora_verl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^local\.keep_checkpoints: must be an integer >= 0"):
        load_local_config({"keep_checkpoints": -1})
    root = tmp_path / "checkpoints"
    for step in range(1, 6):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "COMPLETE").write_text("")
    (root / "step_6.tmp").mkdir()
    (root / "latest").write_text("step_2\n")  # e.g. a resume re-pointed latest at an older step
    gone = prune_checkpoints(tmp_path, 2)
    assert [p.name for p in gone] == ["step_1", "step_3"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_4", "step_5"]
    assert latest_checkpoint(tmp_path).name == "step_2" and (root / "step_6.tmp").is_dir()
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # the renamed-aside folders are gone too


def test_events_after_the_checkpoint_are_not_logged_twice(tmp_path):
    """A run killed after an evolution event but before the checkpoint of that step redoes the step on resume; the
    event log keeps the events up to the checkpoint only, as the metrics log does."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "evolution.jsonl").write_text('{"step": 2, "replacements": []}\n{"step": 4, "replacements": []}\n{"st')
    args = parse_args(["--run-dir", str(run), "-q", "local.tensorboard=false"])
    cfg, local = build_configs(args)
    d = LocalDriver(cfg, local, run)  # no checkpoint: a fresh start over a run killed before its first save
    try:
        assert (run / "evolution.jsonl").read_text() == ""
    finally:
        d.close()
