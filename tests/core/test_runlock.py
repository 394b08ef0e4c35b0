"""One writer per run directory, for both engines: a second run into a directory in use is refused at start-up in
one line naming the holder, a stale lock from a killed run is taken over, and two CPU runs started together leave
one intact run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from populora_verl.runlock import LOCK_FILE, RunDirInUse, acquire_run_lock, claim_run_dir, read_holder

from _shared import REPO

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           TORCH_COMPILE_DISABLE="1", RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")

# A process that takes the lock, says so, and waits to be killed (the runlock module alone: no torch import).
HOLDER = ("import sys, time; from populora_verl.runlock import claim_run_dir; "
          "claim_run_dir(sys.argv[1], command='holder'); print('locked', flush=True); time.sleep(120)")


def _holder(run_dir: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_second_writer_is_refused_with_one_line_naming_the_holder(tmp_path):
    first = acquire_run_lock(tmp_path, command="populora-local --run-dir x")
    assert read_holder(tmp_path)["pid"] == os.getpid()
    with pytest.raises(RunDirInUse) as e:
        acquire_run_lock(tmp_path, what="--run-dir")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--run-dir {tmp_path} is in use by pid {os.getpid()} on ")
    assert "(populora-local --run-dir x)" in msg and msg.endswith("choose another --run-dir")
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()  # a clean end leaves no lock file
    second = acquire_run_lock(tmp_path)
    assert second.took_over is None
    second.release()


def test_a_stale_lock_of_a_killed_run_is_detected_and_taken_over(tmp_path):
    p = _holder(tmp_path)
    try:
        with pytest.raises(RunDirInUse, match=rf"in use by pid {p.pid} .*\(holder\)"):
            acquire_run_lock(tmp_path)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert read_holder(tmp_path)["pid"] == p.pid  # the killed run's record is still there
    notes: list[str] = []
    lock = acquire_run_lock(tmp_path, warn=notes.append)
    try:
        assert lock.took_over["pid"] == p.pid
        assert len(notes) == 1 and f"taking over the lock of pid {p.pid}" in notes[0] and "no longer running" in notes[0]
        assert read_holder(tmp_path)["pid"] == os.getpid()
    finally:
        lock.release()


def test_without_flock_the_record_decides(tmp_path, monkeypatch):
    """Filesystems without flock (some network mounts): a live holder on this host keeps the lock, a dead one not."""
    import errno

    import populora_verl.runlock as rl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rl.fcntl, "flock", no_flock)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rec = {"pid": alive.pid, "host": rl.socket.gethostname(), "started": time.time(), "command": "other run"}
        (tmp_path / LOCK_FILE).write_text(json.dumps(rec))
        with pytest.raises(RunDirInUse, match=rf"in use by pid {alive.pid} .*\(other run\)"):
            acquire_run_lock(tmp_path)
    finally:
        alive.kill()
        alive.wait()
    lock = acquire_run_lock(tmp_path, warn=lambda m: None)
    assert lock.took_over["pid"] == alive.pid
    lock.release()


def test_claim_removes_only_a_folder_it_created(tmp_path):
    lock = claim_run_dir(tmp_path / "new" / "run")
    assert lock.created and (tmp_path / "new" / "run" / LOCK_FILE).is_file()
    (lock.run_dir / "partial").write_text("x")
    lock.abandon()  # a failed start: the folder it made goes, debris and all
    assert not (tmp_path / "new" / "run").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep").write_text("x")
    lock = claim_run_dir(tmp_path / "old")
    assert not lock.created
    lock.abandon()
    assert (tmp_path / "old" / "keep").is_file()


# --- the CPU driver ---------------------------------------------------------------------------------------------


def test_cpu_driver_refuses_a_run_dir_in_use_before_loading_a_model(tmp_path, capsys, monkeypatch):
    import populora_verl.local.driver as driver_mod
    from populora_verl.local.__main__ import main

    def no_model(*a, **kw):
        raise AssertionError("a model was loaded for a run that must not start")

    monkeypatch.setattr(driver_mod, "load_model", no_model)
    run = tmp_path / "run"
    p = _holder(run)
    try:
        assert main(["--run-dir", str(run), "-q"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"populora-local: error: --run-dir {run} is in use by pid {p.pid} on ")
        assert "\n" not in err and err.endswith("(holder): wait for that run to end, or choose another --run-dir")
        assert sorted(x.name for x in run.iterdir()) == [LOCK_FILE]  # nothing of the refused run was written
    finally:
        p.kill()
        p.wait()


def test_a_start_between_the_holders_lock_and_its_record_still_names_the_holder(tmp_path, monkeypatch):
    """The holder writes its record just after taking the lock: a start in between waits for the record (here the
    holder writes it while the start waits) instead of naming "another process"."""
    import fcntl

    import populora_verl.runlock as rl

    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked, its record not written yet
    record = {"pid": 4242, "host": "elsewhere", "started": 0, "command": "holder"}
    monkeypatch.setattr(rl.time, "sleep", lambda s: os.pwrite(fd, json.dumps(record).encode(), 0))
    try:
        with pytest.raises(RunDirInUse, match=r"is in use by pid 4242 on elsewhere .*\(holder\)"):
            acquire_run_lock(tmp_path)
    finally:
        os.close(fd)


def test_two_cpu_runs_started_together_leave_one_intact_run(tmp_path):
    """Two runs into one directory at the same moment: one runs, the other stops at start-up in one line, and the
    run directory holds every step once."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "populora_verl.local", "--run-dir", str(run), "-q", "--steps", "2",
           "populora.rollout.max_new_tokens=8", "local.tensorboard=false", "populora.diagnostics.plots=false"]
    procs = [subprocess.Popen(cmd, env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    loser = next(o for p, o in zip(procs, outs) if p.returncode == 2)
    winner = next(p for p in procs if p.returncode == 0)
    assert loser[1].strip().startswith(f"populora-local: error: --run-dir {run} is in use by pid {winner.pid} ")
    assert len(loser[1].strip().splitlines()) == 1 and "Traceback" not in loser[1]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # every step once
    logged = (run / "evolution.jsonl").read_text().splitlines() if (run / "evolution.jsonl").exists() else []
    assert len(logged) == sum(r.get("populora/evolution/events", 0) > 0 for r in rows)  # no event twice
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert not (run / LOCK_FILE).exists() and not list(run.rglob("*.tmp"))


# --- the verl trainer's start-up ----------------------------------------------------------------------------------


def _compose(name, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "recipes" / "populora"), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def test_trainer_start_up_locks_default_local_dir(tmp_path, capsys, monkeypatch):
    from populora_verl.startup import PreflightCallback

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    cfg = _compose("smoke_0.5b", [f"actor_rollout_ref.model.path={tmp_path / 'm'}",
                                  "trainer.default_local_dir=runs/smoke"])
    first = PreflightCallback(check_gpus=False)
    first.on_job_start(cfg)
    assert read_holder(tmp_path / "runs" / "smoke")["pid"] == os.getpid()  # relative: resolved like the trainer
    second = PreflightCallback(check_gpus=False)
    with pytest.raises(SystemExit) as e:
        second.on_job_start(cfg)
    assert e.value.code == 2
    # the smoke recipe's small teacher groups print a start-up warning first; the refusal is one line of its own
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "warning:" not in line][-1]
    assert err.startswith(f"populora: trainer.default_local_dir {tmp_path / 'runs' / 'smoke'} is in use by pid "
                          f"{os.getpid()} ") and err.endswith("choose another trainer.default_local_dir")
    first.on_job_end(cfg)
    assert not (tmp_path / "runs" / "smoke").exists()  # created by this run, left empty: removed
    # a stale lock of a killed trainer is taken over
    (tmp_path / "runs" / "smoke").mkdir(parents=True)
    (tmp_path / "runs" / "smoke" / LOCK_FILE).write_text(json.dumps(
        {"pid": 2**22 + 7, "host": os.uname().nodename, "started": 0, "command": "killed"}))
    third = PreflightCallback(check_gpus=False)
    third.on_job_start(cfg)
    assert read_holder(tmp_path / "runs" / "smoke")["pid"] == os.getpid()
    third.on_job_end(cfg)
    assert (tmp_path / "runs" / "smoke").is_dir()  # it existed before: kept


def test_verl_main_refuses_a_run_dir_in_use_before_ray(tmp_path):
    """The real entry point, ``python -m verl.trainer.main_ppo``, against a directory another process holds."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    run = tmp_path / "run"
    p = _holder(run)
    try:
        r = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "--config-path",
                            str(REPO / "recipes" / "populora"), "--config-name", "smoke_0.5b",
                            f"actor_rollout_ref.model.path={tmp_path / 'm'}", f"trainer.default_local_dir={run}",
                            "+hydra.callbacks.populora_preflight.check_gpus=false"],
                           cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"populora: trainer.default_local_dir {run} is in use by pid {p.pid} "), last
    assert "Traceback" not in r.stderr and "ray" not in r.stdout.lower()
    assert not (tmp_path / "outputs").exists()  # no Hydra output folder left by the refused start
