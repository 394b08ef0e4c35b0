"""populora_verl.bench.gpu_plan: phases of GPU jobs side by side on one host, run here with shell jobs."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from populora_verl.bench import gpu_plan, gpu_scaling, step_scaling

from _shared import REPO

PLAN = """\
# comment
0,1  a   echo "$CUDA_VISIBLE_DEVICES $RAY_ADDRESS $RAY_TMPDIR" > "$OUT/env.txt"; date +%s.%N > "$OUT/t0"; sleep 1; date +%s.%N > "$OUT/t1"
2,3  b   date +%s.%N > "$OUT/t0"; sleep 1; date +%s.%N > "$OUT/t1"; exit 3
---
0,1,2,3  c   date +%s.%N > "$OUT/t0"; echo "$CUDA_VISIBLE_DEVICES" > "$OUT/env.txt"
"""


def _t(out: Path, job: str, name: str) -> float:
    return float((out / job / name).read_text())


def test_phases_run_side_by_side_then_in_order_each_job_on_its_gpus(tmp_path):
    phases = gpu_plan.parse_plan(PLAN, gpu_count=4)
    assert [[j.name for j in p] for p in phases] == [["a", "b"], ["c"]]
    rc = gpu_plan.run_plan(phases, tmp_path, poll_s=0.1)
    assert rc == 1  # b exited 3: the plan reports it but still ran phase 2
    assert (tmp_path / "a" / "env.txt").read_text().split() == ["0,1", "local", "/tmp/ray_a"]
    assert (tmp_path / "c" / "env.txt").read_text().strip() == "0,1,2,3"
    # a and b overlapped; c started after both ended
    assert _t(tmp_path, "a", "t0") < _t(tmp_path, "b", "t1") and _t(tmp_path, "b", "t0") < _t(tmp_path, "a", "t1")
    assert _t(tmp_path, "c", "t0") >= max(_t(tmp_path, "a", "t1"), _t(tmp_path, "b", "t1"))
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["state"] == "finished"
    assert {k: v["rc"] for k, v in progress["jobs"].items()} == {"a": 0, "b": 3, "c": 0}
    text = gpu_plan.status(tmp_path)
    assert "plan finished" in text and "rc=3" in text


def test_run_plan_gives_the_callers_sigterm_handler_back(tmp_path):
    import signal

    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        gpu_plan.run_plan(gpu_plan.parse_plan("0 a true\n"), tmp_path, poll_s=0.05)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_stop_file_starts_no_further_phase(tmp_path):
    plan = "0 first touch \"$OUT/../STOP\"\n---\n0 second touch \"$OUT/ran\"\n"
    assert gpu_plan.run_plan(gpu_plan.parse_plan(plan), tmp_path, poll_s=0.1) == 1
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["jobs"]["second"]["state"] == "not run" and not (tmp_path / "second" / "ran").exists()


@pytest.mark.parametrize("plan,needle", [
    ("0,1 a true\n1 b true\n", "GPU(s) [1] already used"),
    ("0 a true\n---\n1 a true\n", "job name 'a'"),
    ("0,x a true\n", "comma-separated"),
    ("7 a true\n", "GPU 7 does not exist"),
    ("0 a\n", "want '<gpus> <name> <command>'"),
    ("# nothing\n---\n", "no job"),
])
def test_bad_plans_fail_with_one_line_naming_the_line(plan, needle, tmp_path, capsys):
    with pytest.raises(gpu_plan.PlanError, match=None) as e:
        gpu_plan.parse_plan(plan, gpu_count=4)
    assert needle in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "p").write_text(plan)
    assert gpu_plan.main(["--plan", str(tmp_path / "p"), "--out", str(tmp_path / "o"), "--gpu-count", "4"]) == 2
    assert needle in capsys.readouterr().err


def test_sigterm_ends_running_jobs_and_skips_the_rest(tmp_path):
    import subprocess

    (tmp_path / "p").write_text("0 long sleep 60\n---\n0 never touch \"$OUT/ran\"\n")
    proc = subprocess.Popen([sys.executable, "-m", "populora_verl.bench.gpu_plan", "--plan", str(tmp_path / "p"),
                             "--out", str(tmp_path / "o")])
    deadline = time.time() + 30
    while time.time() < deadline:
        p = tmp_path / "o" / "progress.json"
        if p.exists() and json.loads(p.read_text())["jobs"]["long"]["state"] == "running":
            break
        time.sleep(0.2)
    t0 = time.time()
    proc.terminate()
    assert proc.wait(timeout=40) == 1 and time.time() - t0 < 30
    jobs = json.loads((tmp_path / "o" / "progress.json").read_text())["jobs"]
    assert jobs["long"]["state"] == "stopped" and jobs["never"]["state"] == "not run"


def test_gpu_scaling_merge_joins_rows_measured_in_separate_folders(tmp_path, capsys):
    def row(g, s):
        return gpu_scaling.ScalingRow(g, 1, "4t4s", "H100", 0, 1.0, {2: s, 3: s}, {2: 3000.0, 3: 3000.0})

    for g, s in ((1, 30.0), (2, 15.0)):
        (tmp_path / str(g)).mkdir()
        gpu_scaling.save_rows(tmp_path / str(g) / "results.json", [row(g, s)])
    assert gpu_scaling.main(["--merge", str(tmp_path / "1"), str(tmp_path / "2"), str(tmp_path / "4"),
                             "--out", str(tmp_path / "all")]) == 0
    captured = capsys.readouterr()
    assert "| smoke_0.5b | 4t4s | - | fixed | 2 | 2 x TP1 | H100 | 15.0 | 200 | 2.00x | >= 1.7x |" in captured.out
    assert "results.json is missing" in captured.err  # the 4-GPU folder that never ran is named, not fatal
    assert len(gpu_scaling.load_rows(tmp_path / "all" / "results.json")) == 2
    with pytest.raises(SystemExit):
        gpu_scaling.main(["--gpus", "1"])  # a run needs --model


def test_memory_poller_asks_nvidia_smi_for_this_runs_gpus_only(monkeypatch):
    calls = []

    class Done:
        stdout = "100\n200\n"

    monkeypatch.setattr(step_scaling.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or Done())
    poller = step_scaling.GpuMemoryPoller()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert poller._sample() == 300.0 and calls[-1][1:3] == ["-i", "2,3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    poller._sample()
    assert "-i" not in calls[-1]


def test_shipped_plans_parse_for_the_host_they_name():
    plans = sorted((REPO / "scripts" / "gpu" / "plans").glob("*.plan"))
    assert plans
    for p in plans:
        gpus = int(p.name.split("gpu_", 1)[0]) if "gpu_" in p.name else 1  # 2gpu_..., 4gpu_...: the host's GPUs
        assert gpu_plan.parse_plan(p.read_text(), gpu_count=gpus)


def test_background_launcher_runs_a_driver_from_a_private_copy_and_waits_for_it(tmp_path):
    """scripts/gpu/bg_lib.sh (shared by the three background wrappers) on a plan whose job reports its directory."""
    import subprocess

    repo = REPO
    root, src = tmp_path / "root", tmp_path / "src"
    root.mkdir()
    (tmp_path / "plan").write_text("0 j pwd > \"$OUT/cwd\"; sleep 1\n")
    script = (f"set -u; ROOT={root}; BG_SRC={src}; BG_START_WAIT_S=0; source scripts/gpu/bg_lib.sh; "
              f"bg_launch populora_verl.bench.gpu_plan --plan {tmp_path / 'plan'} --out {root} && bg_wait 60; "
              f"bg_refuse_if_running; echo after")
    res = subprocess.run(["bash", "-c", script], cwd=repo, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "started pid" in res.stdout and res.stdout.rstrip().endswith("after")
    assert (src / "populora_verl" / "bench" / "gpu_plan.py").exists()  # the driver ran from the copy
    assert (root / "j" / "cwd").read_text().strip() == str(src)
    assert json.loads((root / "progress.json").read_text())["state"] == "finished"
    # a second launch while a driver runs is refused
    hold = subprocess.Popen(["sleep", "30"])
    try:
        (root / "driver.pid").write_text(str(hold.pid))
        res = subprocess.run(["bash", "-c", f"ROOT={root}; source scripts/gpu/bg_lib.sh; bg_refuse_if_running"],
                             cwd=repo, capture_output=True, text=True)
        assert res.returncode == 1 and "already running" in res.stdout
    finally:
        hold.kill()
