"""vLLM's engine core forked from a preloaded forkserver (populora_verl.rollout.engine_preload), without vLLM: a
real forkserver in a fresh interpreter (a process has one forkserver), a probe module standing for vLLM's."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from populora_verl.rollout import engine_preload as ep

PROBE = '''
import os, time
IMPORTED_IN = os.getpid()
NVML_CHECK_AT_IMPORT = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
time.sleep(0.5)  # a slow import: the launch must wait for it, not import again


def sleeper(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)


def child(path):
    import json, sys
    with open(path, "w") as f:
        json.dump({"pid": os.getpid(), "imported_in": IMPORTED_IN, "env": os.environ.get("POPULORA_PROBE_ENV"),
                   "preloaded": "populora_probe_heavy" in sys.modules, "nvml_check_at_import": NVML_CHECK_AT_IMPORT,
                   "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}, f)
'''

SCRIPT = '''
import json, multiprocessing, os, sys
sys.path.insert(0, sys.argv[1])
from populora_verl.rollout import engine_preload as ep

os.environ["POPULORA_PROBE_ENV"] = "before"
# a module that raises on import (not ImportError) must not stop the forkserver: the engine imports it itself
assert ep.start(["populora_probe_broken", "populora_probe_heavy"]) is True and ep.started()
assert ep.start(["populora_probe_heavy"]) is True  # once per process
os.environ["POPULORA_PROBE_ENV"] = "after"  # set by vLLM or verl after the forkserver started
get = ep.wrap_get_mp_context(lambda: multiprocessing.get_context("spawn"))
ctx = get()
import populora_probe_heavy  # the launcher's own import: the target is pickled by reference
out = os.path.join(sys.argv[1], "child.json")
p = ctx.Process(target=populora_probe_heavy.child, args=(out,))
p.start(); p.join(60)
# what vLLM does with its engine-core processes: wait on the sentinel, check, terminate, join
from multiprocessing import connection
s = ctx.Process(target=populora_probe_heavy.sleeper, args=(os.path.join(sys.argv[1], "sleeper.pid"),))
s.start()
alive = s.is_alive() and not connection.wait([s.sentinel], timeout=0)
s.terminate(); s.join(60)
print(json.dumps({"exitcode": p.exitcode, "parent": os.getpid(), "same_ctx": isinstance(ctx, ep.PreloadedContext),
                  "child": json.load(open(out)), "sleeper_alive": alive, "sleeper_exit": s.exitcode}))
if len(sys.argv) > 2:  # the launcher dies without ending its engine core: the forked child must not outlive it
    o = ctx.Process(target=populora_probe_heavy.sleeper, args=(sys.argv[2],))
    o.start()
    while not os.path.exists(sys.argv[2]) or not open(sys.argv[2]).read():
        pass
    os._exit(0)
'''


def test_the_child_is_forked_from_the_preloaded_server_with_the_launchers_environment(tmp_path: Path):
    (tmp_path / "populora_probe_heavy.py").write_text(PROBE)
    (tmp_path / "populora_probe_broken.py").write_text("raise RuntimeError('not on this host')\n")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    child = report["child"]
    assert report["exitcode"] == 0 and report["same_ctx"]
    assert child["preloaded"]
    # imported once, in the forkserver: neither in the launcher (its own import is another) nor in the child
    assert child["imported_in"] not in (child["pid"], report["parent"])
    assert child["env"] == "after"  # the launcher's environment at start(), as under spawn
    # torch's CUDA checks ask NVML during the forkserver's imports only (the driver would spoil every fork)
    assert child["nvml_check_at_import"] == "1" and child["nvml_check"] is None
    assert report["sleeper_alive"] and report["sleeper_exit"] == -signal.SIGTERM


def test_a_forked_engine_core_does_not_outlive_its_server(tmp_path: Path):
    (tmp_path / "populora_probe_heavy.py").write_text(PROBE)
    pid_file = tmp_path / "orphan.pid"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), str(pid_file)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    pid = int(pid_file.read_text())
    # the launcher is gone, so its forkserver exits and the child gets SIGKILL from the kernel (PR_SET_PDEATHSIG);
    # it is reaped by init, so poll for the pid to go (a test timeout would catch a child left running)
    while _alive(pid):
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_vllms_choice_stands_where_it_is_not_spawn_or_nothing_was_preloaded(monkeypatch):
    fork = multiprocessing.get_context("fork")
    spawn = multiprocessing.get_context("spawn")
    monkeypatch.setattr(ep, "_STATE", {})
    assert ep.wrap_get_mp_context(lambda: spawn)() is spawn  # no forkserver started in this process
    ours = ep.PreloadedContext()
    monkeypatch.setattr(ep, "_STATE", {"context": ours, "started_at": 0.0, "unusable": None})  # probed: usable
    assert ep.wrap_get_mp_context(lambda: fork)() is fork
    calls = []
    assert ep.wrap_get_mp_context(lambda: calls.append(1) or spawn)() is ours
    assert calls == [1]  # vLLM's own function ran (its environment side effects stay)


def test_install_wraps_the_launch_modules_function_once():
    def vllms():
        return multiprocessing.get_context("spawn")

    module = types.SimpleNamespace(get_mp_context=vllms)
    assert ep.install(module) is None
    wrapped = module.get_mp_context
    assert wrapped is not vllms and wrapped.__wrapped__ is vllms
    assert ep.install(module) is None and module.get_mp_context is wrapped
    if ep.engine_launch_module() is None:  # no vLLM here: a reason, and vLLM's spawn stays
        assert "not found" in ep.install()


def test_the_preload_list_names_the_engine_and_our_worker_extension():
    assert "vllm.v1.engine.core" in ep.ENGINE_MODULES
    assert "populora_verl.rollout.vllm_extension" in ep.ENGINE_MODULES
    assert textwrap.dedent(ep.__doc__ or "")  # documented for users reading the module


FAKE_CUDA = '''
import os, sys, types
if "torch" not in sys.modules:  # stands for an import that initialized CUDA, or asked its driver, in the forkserver
    bad = os.environ["POPULORA_FAKE_CUDA"]
    sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(
        is_initialized=lambda: bad == "initialized", _is_in_bad_fork=lambda: bad == "bad_fork"))
'''

GUARD_SCRIPT = '''
import multiprocessing, os, sys
sys.path.insert(0, sys.argv[1])
from populora_verl.rollout import engine_preload as ep
ep.start(["populora_probe_fake_cuda"])
ctx = ep.wrap_get_mp_context(lambda: multiprocessing.get_context("spawn"))()
print("spawned", not isinstance(ctx, ep.PreloadedContext))
p = ctx.Process(target=os.getpid)
p.start(); p.join(60)
print("exitcode", p.exitcode)
'''


@pytest.mark.parametrize("bad, why", [("initialized", "the forkserver's imports initialized CUDA"),
                                      ("bad_fork", "torch marks its forks unable to use CUDA")])
def test_a_forkserver_whose_forks_cannot_use_cuda_leaves_vllms_spawn(tmp_path: Path, bad, why):
    # what an H200 host showed: vLLM's engine core forked from the forkserver failed with "Cannot re-initialize CUDA
    # in forked subprocess"; a probe forked first finds it, and the engine core is spawned as vLLM chose
    (tmp_path / "populora_probe_fake_cuda.py").write_text(FAKE_CUDA)
    env = dict(os.environ, POPULORA_FAKE_CUDA=bad)
    proc = subprocess.run(
        [sys.executable, "-c", GUARD_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip().splitlines()
    assert out[-2:] == ["spawned True", "exitcode 0"], proc.stdout + proc.stderr
    assert f"[populora] vLLM engine core spawned: {why}" in proc.stdout


def test_the_probe_of_a_clean_forkserver_finds_it_usable():
    assert ep.unusable({"cuda_initialized": False, "bad_fork": False}) is None
    assert ep.unusable(ep.fork_state()) is None  # this CPU process: no CUDA at all
