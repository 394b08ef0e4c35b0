"""What a call leaves behind, and how its verdict is reached, attacked once more: kernel objects and compiled
code a call leaves must not reach the next run, SandboxFusion's runs must not share /tmp or leave processes,
answers are judged on whole outputs, program-derived values never raise on the host, and saved golds are out of
a program's reach. Each test failed on the executor and task code before its fix (the socket and
compile-cache tests on the executor that forked programs from the slot's runner)."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import sys
import tempfile
from dataclasses import replace

import pytest

from populora_verl.config import PopuLoRAConfig, load_config
from populora_verl.executor import Executor
from populora_verl.step.task_env import TaskEnv
from populora_verl.tasks import score_answer, solver_prompt, validate_proposal
from populora_verl.tasks.task import TRUNCATE_CHARS, Task, identity_code_f_task

TIMEOUT = 2.0
MEMORY_MB = 256
ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def ex():
    with Executor(timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_workers=2) as executor:
        yield executor


def _need(ex: Executor, *keys: str) -> None:
    off = [k for k in keys if not ex.protections.get(k)]
    if off:
        pytest.skip(f"{', '.join(off)} not available here")


def _per_slot(ex: Executor, program: str, inputs: str = "1", check: bool = True) -> list:
    req = ex._prepare(program, inputs, check, None)
    return [w.call([req], 5.0)[0] for w in ex._backend.workers]


def wrap(answer: str) -> str:
    return f"let me think</think>\n<answer>\n{answer}\n</answer>"


def fence(tag: str, body: str) -> str:
    return f"```{tag}\n{body}\n```"


# --- unix sockets kept alive by passing themselves -------------------------------------------------------------
# Run A binds an abstract unix socket named after a random value and drops it into a cycle of sockets that hold
# each other in flight: no process owns them, so no kill frees them. Run B finds the name in /proc/net/unix and
# returns the value: a random gold passes the determinism check, and later calls read the name too.
def _cycle(tag: str) -> str:
    return f"""import os, socket
def f(x):
    for line in open('/proc/net/unix'):
        if '@{tag}-' in line:
            return line.split('@{tag}-')[1].split()[0]
    value = os.urandom(8).hex()
    named = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    named.bind('\\0{tag}-' + value)
    named.listen(1)
    a, b = socket.socketpair()
    socket.send_fds(a, [b'x'], [named.fileno(), a.fileno(), b.fileno()])
    socket.send_fds(b, [b'y'], [a.fileno(), b.fileno()])
    for s in (named, a, b):
        s.detach()
    return value
"""


def test_unix_sockets_a_run_leaves_alive_are_no_channel(ex):
    _need(ex, "network_namespace")
    tag = "populora-cycle-" + secrets.token_hex(4)
    program = _cycle(tag)
    res = ex.run(program, "1")
    assert not res.ok, res
    seek = f"def f(x):\n    return any('@{tag}-' in line for line in open('/proc/net/unix'))"
    for reply in _per_slot(ex, seek, check=False):
        assert reply["ok"] and reply["output"] == "False", reply
    assert ex.run("def f(x):\n    return x + 1", "1").output == "2"


# --- compiled code of earlier calls ----------------------------------------------------------------------------
def _folds_to_8_mb(tag: int) -> str:
    """About 24 KB of source whose constant folding builds one 8 MB string in the compiled code (not made
    of name characters, so not interned: every program holds its own)."""
    def tree(n: int) -> str:
        return "'a-'*2048" if n == 1 else f"({tree(n // 2)}+{tree(n - n // 2)})"

    return f"def f(x):\n    s = {tree(2048)}\n    return x + {tag} + 0 * len(s)"


def test_programs_whose_constants_fold_to_megabytes_do_not_starve_the_next_call():
    with Executor(timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_workers=1) as one:
        results = one.run_many([(_folds_to_8_mb(k), "0") for k in range(50)])
        assert all(r.ok for r in results), [r for r in results if not r.ok][:2]
        honest = one.run("def f(n):\n    return len(bytearray(n))", str(200 << 20))
        assert honest.ok and honest.output == str(200 << 20), honest


# --- outputs are judged whole; truncation is for prompts -------------------------------------------------------
# Both ends of the output stay the same for every input; only the middle tells them apart.
LONG = "def f(n):\n    return 'a' * 300 + str(n) + 'b' * 300"


def test_code_i_and_code_o_are_judged_on_the_full_output(ex):
    cfg = PopuLoRAConfig()
    assert cfg.executor.truncate_output
    proposal = validate_proposal(wrap(fence("python", LONG) + "\n" + fence("input", "7")), "code_i", ex, cfg)
    assert proposal.valid, proposal.reason
    task = proposal.task
    full = repr("a" * 300 + "7" + "b" * 300)
    assert task.output == full
    shown = task.shown(task.output)
    assert len(shown) == TRUNCATE_CHARS and shown in solver_prompt(task)
    # code_i: a wrong input whose output shares both ends of the gold is wrong.
    assert score_answer(task, wrap(fence("input", "8")), ex, cfg).status == "wrong"
    assert score_answer(task, wrap(fence("input", "7")), ex, cfg).status == "correct"
    # code_o: the whole output is right, the prompt's cut form is not.
    as_o = replace(task, type="code_o")
    assert score_answer(as_o, wrap(fence("output", full)), ex, cfg).status == "correct"
    assert score_answer(as_o, wrap(fence("output", shown)), ex, cfg).status == "wrong"


def test_code_f_hidden_pairs_are_judged_on_the_full_output(ex):
    cfg = PopuLoRAConfig()
    program = Task(type="code_f", program=LONG + "\n", inputs=["1"], outputs=["x"], num_visible=0, teacher="seed")
    text = wrap("\n".join(fence("input", str(k)) for k in range(10)) + "\n" + fence("message", "digits"))
    proposal = validate_proposal(text, "code_f", ex, cfg, program=program)
    assert proposal.valid, proposal.reason
    task = proposal.task
    assert all(len(out) > TRUNCATE_CHARS for out in task.outputs)
    # Same ends, another middle: every hidden output's cut form matches, the whole one does not.
    cheat = "def f(n):\n    return 'a' * 300 + str(n + 1) + 'b' * 300"
    assert score_answer(task, wrap(fence("python", cheat)), ex, cfg).status == "wrong"
    assert score_answer(task, wrap(fence("python", LONG)), ex, cfg).status == "correct"


# --- values Python refuses to print ----------------------------------------------------------------------------
# 4,000 hex digits parse, but the int has more decimal digits than Python's int-to-str limit: its repr raises.
HUGE = "0x" + "f" * 4000


@pytest.mark.parametrize("rule", ["azr", "lenient"])
def test_an_input_python_cannot_print_is_a_verdict_not_an_exception(ex, rule):
    cfg = load_config({"tasks": {"code_f_rule": rule}})
    text = wrap("\n".join(fence("input", HUGE) for _ in range(10)) + "\n" + fence("message", "echo"))
    res = validate_proposal(text, "code_f", ex, cfg, program=identity_code_f_task())
    assert res.status == "invalid", res
    env = TaskEnv(cfg, executor=ex)
    (task, status, code), = env.validate_many([("code_f", text, {"program": identity_code_f_task()}, "t", 1)])
    assert task is None and status == "invalid" and code, (status, code)
    io = wrap(fence("python", f"def f(a):\n    return {HUGE}") + "\n" + fence("input", HUGE))
    for task_type in ("code_i", "code_o"):
        assert validate_proposal(io, task_type, ex, cfg).status == "invalid"
    seed = Task(type="code_i", program="def f(a):\n    return a\n", input="1", output="1")
    for task, answer in ((seed, fence("input", HUGE)), (replace(seed, type="code_o"), fence("output", HUGE)),
                         (identity_code_f_task(), fence("python", f"def f(a):\n    return {HUGE}"))):
        assert score_answer(task, wrap(answer), ex, cfg).status == "wrong"


# --- SandboxFusion: the service's /tmp and processes that call setsid ---------------------------------------------
def _runnable_by_anyone(path: str) -> bool:
    real = os.path.realpath(path)
    parts = real.split("/")
    dirs = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    return os.path.isfile(real) and all(os.stat(p).st_mode & 0o001 for p in [*dirs, real])


SF_PYTHON = next((p for p in (sys.executable, "/usr/bin/python3") if _runnable_by_anyone(p)), sys.executable)


def _run_like_sandbox_fusion(self, payload: dict, timeout: float) -> dict:
    """SandboxFusion's ``run_code`` in a local process (the code in a file, stdin from the request)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "main.py")
        with open(script, "w") as fh:
            fh.write(payload["code"])
        proc = subprocess.run([SF_PYTHON, script], input=payload["stdin"], capture_output=True, text=True,
                              timeout=payload["run_timeout"] + 5, cwd=tmp, env=env)
    run = {"status": "Finished", "return_code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
    return {"status": "Success" if proc.returncode == 0 else "Failed", "message": "", "run_result": run}


@pytest.fixture(scope="module")
def sf():
    from populora_verl.executor.sandbox_fusion import SandboxFusionBackend

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SandboxFusionBackend, "_post", _run_like_sandbox_fusion)
        with Executor(backend="sandbox_fusion", sandbox_fusion_url="http://sandbox-fusion.invalid/run_code",
                      timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_workers=1) as executor:
            yield executor


def _mount_namespaces_here() -> bool:
    """Whether a process like the service's may make a mount namespace (as root, or in a user namespace)."""
    cmd = ["unshare", "--mount", "true"] if ROOT else ["unshare", "--user", "--map-root-user", "--mount", "true"]
    try:
        return subprocess.run(cmd, capture_output=True).returncode == 0
    except OSError:
        return False


# Run A leaves a random value in the service's /tmp, run B returns it: a random gold.
SHARED_TMP = """import os
def f(x):
    path = '/tmp/populora-sf-shared-gold'
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        value = os.urandom(8).hex()
        with open(path, 'w') as fh:
            fh.write(value)
        return value
"""


def test_sandbox_fusion_runs_do_not_share_the_services_tmp(sf):
    if not _mount_namespaces_here():
        pytest.skip("no mount namespace for the script here: determinism through /tmp is not checked (documented)")
    res = sf.run(SHARED_TMP, "1")
    assert not res.ok and res.error_kind == "nondeterministic", res
    assert not os.path.exists("/tmp/populora-sf-shared-gold")
    assert sf._backend.run(sf._prepare("def f(x):\n    return x", "1", False, None))["private_tmp"] is True


# A grandchild that leaves the program's process group (setsid) and lives on: it outlived the call.
SETSID = """import os
def f(x):
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            while True:
                pass
        os._exit(0)
    return int(os.read(r, 32))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_sandbox_fusion_leaves_no_process_behind(sf):
    res = sf.run(SETSID, "1", check_determinism=False)
    assert res.ok, res
    pid = int(res.output)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive, "a setsid grandchild outlived the call"


# --- saved golds ---------------------------------------------------------------------------------------------------
# A code_f student that can open the run's buffers.json reads every hidden gold.
def _peek(path: str) -> str:
    return (f"def f(x):\n    try:\n        with open({path!r}) as fh:\n            return 'read ' + str(len(fh.read()))\n"
            "    except OSError as e:\n        return type(e).__name__")


@pytest.fixture
def saved_run(ex):
    """A checkpoint under a world-readable folder outside /tmp (the sandbox has its own /tmp), like a run folder
    in a project directory."""
    import torch

    from populora_verl.checkpoint import save_checkpoint
    from populora_verl.step import PopulationStep

    if not os.path.isdir("/var/tmp"):
        pytest.skip("no /var/tmp")
    parent = tempfile.mkdtemp(prefix="populora-run-", dir="/var/tmp")
    os.chmod(parent, 0o755)
    cfg = load_config({"population": {"num_teachers": 1, "num_students": 1},
                       "diagnostics": {"cvt_cells": 8, "cvt_samples": 500}})
    ps = PopulationStep(cfg, executor=ex, seed=0)
    run = os.path.join(parent, "run")
    adapters = {i: {"m.lora_A.weight": torch.zeros(4, 8), "m.lora_B.weight": torch.zeros(8, 4)}
                for i in ps.population.ids()}
    save_checkpoint(run, 1, population=ps.population, adapters=adapters,
                    lora_config={"r": 4, "lora_alpha": 8, "target_modules": ["m"]}, optimizers={},
                    step_state=ps.state_dict())
    try:
        yield parent, os.path.join(run, "checkpoints", "step_1", "buffers.json")
    finally:
        subprocess.run(["rm", "-rf", parent], check=False)


def test_saved_buffers_are_the_owners_alone(ex, saved_run):
    _, buffers = saved_run
    assert "1001101100010001" in open(buffers).read()  # the code_f seed's hidden gold is in there
    assert stat.S_IMODE(os.stat(buffers).st_mode) == 0o600
    for folder in (os.path.dirname(os.path.dirname(os.path.dirname(buffers))), os.path.dirname(buffers)):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, folder
    if ex.protections.get("uid_drop"):
        res = ex.run(_peek(buffers), "1")
        assert res.ok and res.output == "'PermissionError'", res


def test_the_run_folder_is_hidden_where_programs_keep_the_trainers_uid(saved_run):
    from populora_verl.executor.local import _NS_FLAGS, LocalBackend, SandboxPlan

    parent, buffers = saved_run
    plan = SandboxPlan(("unshare", "--user", "--map-root-user", *_NS_FLAGS), "user", False)
    settings = {"banned": [], "nproc": 16, "fsize_mb": 16, "tmp_mb": 64, "memory_mb": MEMORY_MB, "hide": [parent]}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("populora_verl.executor.local.detect_sandbox", lambda isolation="auto": plan)
        try:
            backend = LocalBackend(num_workers=1, settings=settings, memory_cgroup=False)
        except RuntimeError as e:
            pytest.skip(f"unprivileged user namespaces not available: {e}")
    try:
        req = {"program": _peek(buffers), "inputs": "1", "timeout_s": TIMEOUT, "memory_mb": MEMORY_MB,
               "max_output_chars": 10_000, "plain_data": True, "check_determinism": False}
        res = backend.run_batch([req])[0]
        assert res["ok"] and res["output"] == "'FileNotFoundError'", res
        assert backend.protections.get("hidden_paths")
    finally:
        backend.close()


def test_without_namespaces_or_a_uid_of_its_own_no_process_outlives_the_call():
    """The local backend's weakest mode (no namespaces, not root): cleanup by descent from the runner, not by
    process group, so a setsid grandchild dies with the call too."""
    from populora_verl.executor.local import LocalBackend, SandboxPlan

    plan = SandboxPlan((), "none", False)
    settings = {"banned": [], "nproc": 16, "fsize_mb": 16, "tmp_mb": 64, "memory_mb": MEMORY_MB}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("populora_verl.executor.local.detect_sandbox", lambda isolation="auto": plan)
        backend = LocalBackend(num_workers=1, settings=settings, memory_cgroup=False)
    try:
        req = {"program": SETSID, "inputs": "1", "timeout_s": TIMEOUT, "memory_mb": MEMORY_MB,
               "max_output_chars": 10_000, "plain_data": True, "check_determinism": False}
        res = backend.run_batch([req])[0]
        assert res["ok"], res
        pid = int(res["output"])
        alive = _alive(pid)
        if alive:
            os.kill(pid, 9)
        assert not alive, "a setsid grandchild outlived the call"
    finally:
        backend.close()
