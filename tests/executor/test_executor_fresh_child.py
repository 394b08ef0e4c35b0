"""A third red team's findings against the local backend: a program's process must hold nothing of another
call (no program text, input, result or compiled code), both runs of a call must be indistinguishable to it,
and nothing it does may outlive the call. Each test failed on the executor that forked programs from the
slot's runner."""

from __future__ import annotations

import os
import tempfile

import pytest

from populora_verl.executor import Executor
from populora_verl.executor.local import _NS_FLAGS, LocalBackend, SandboxPlan

TIMEOUT = 2.0
MEMORY_MB = 256
ROOT = os.geteuid() == 0
X86 = os.uname().machine == "x86_64"


@pytest.fixture(scope="module")
def ex():
    with Executor(timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_workers=2) as executor:
        yield executor


def spelled(name: str) -> str:
    """An expression building ``name`` at run time that no static walk folds back."""
    return f"''.join(map(chr, {[ord(c) for c in name]!r}))"


def _per_slot(ex: Executor, program: str, inputs: str = "1", check: bool = True) -> list:
    req = ex._prepare(program, inputs, check, None)
    return [w.call([req], 5.0)[0] for w in ex._backend.workers]


def _need(ex: Executor, *keys: str) -> None:
    off = [k for k in keys if not ex.protections.get(k)]
    if off:
        pytest.skip(f"{', '.join(off)} not available here")


# --- another call's program, input and result are not in the program's process ---------------------------------
SECRET = "def f(x):\n    return 'hidden-teacher-' + 'gold' * x\n"
# Looks through every object the collector knows (dict keys included: a compile cache keyed by program text) and
# every frame up the stack for a string holding the marker; builds the marker at run time.
SNOOP = f"""import gc
def f(x):
    mark = {spelled('hidden-teacher-')}
    for o in gc.get_objects():
        items = list(o.keys()) + list(o.values()) if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()
        for v in items:
            if isinstance(v, str) and mark in v:
                return True
    return False
"""


def test_a_program_cannot_find_another_calls_program_text(ex):
    assert ex.run(SECRET, "2").ok
    for res in _per_slot(ex, SNOOP):
        assert res["ok"] and res["output"] == "False", res


# Run B looks for run A's reply up the stack (a frame's locals reached by names built at run time) and returns it:
# a random value then passes the determinism check.
REPLAY = f"""import inspect, os
SALT = int.from_bytes(os.urandom(8), 'big')
def f(x):
    fr = inspect.currentframe()
    while fr is not None:
        for v in getattr(fr, {spelled('f_locals')}).values():
            if isinstance(v, dict) and v.get('ok') is True and isinstance(v.get('output'), str):
                return int(v['output'])
        fr = getattr(fr, {spelled('f_back')})
    return SALT
"""


def test_the_second_run_cannot_replay_the_first_runs_result(ex):
    res = ex.run(REPLAY, "1")
    assert not res.ok and res.error_kind == "nondeterministic", res


# --- compilation happens in the program's process, under its limits ------------------------------------------------
def _nested_finally(depth: int) -> str:
    """A few KB whose compilation needs 2 ** depth copies of the innermost block (each ``finally`` body is
    compiled twice: normal and exceptional exit)."""
    lines = ["def f(x):"]
    for i in range(depth):
        lines += ["    " * (i + 1) + "try:", "    " * (i + 2) + "x += 1", "    " * (i + 1) + "finally:"]
    lines += ["    " * (depth + 1) + "x += 2", "    return x"]
    return "\n".join(lines)


def test_a_program_that_explodes_in_the_compiler_costs_only_its_own_call():
    with Executor(timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_workers=1) as one:
        bomb, honest = _nested_finally(19), ("def f(a):\n    return a * 2", "21")
        res = one.run_many([(bomb, "1"), honest, (bomb, "2"), honest])
        assert not res[0].ok and res[0].error_kind in ("memory", "timeout", "MemoryError", "RecursionError"), res[0]
        assert res[1].ok and res[1].output == "42", res[1]
        assert res[3].ok and res[3].output == "42", res[3]


# --- the two runs of a call are indistinguishable; golds do not depend on the slot ---------------------------------
def test_address_dependent_builtins_give_the_same_gold_in_every_slot_and_restart(ex):
    honest = "def f(people):\n    return sorted(map(repr, list(set(people))))[:1] + [list(set(people))]"
    people = "[('ann', 31), ('bob', None), (None, 7), ('cy', 2), (None, None)]"
    seen = set()
    for program, inputs in (("def f(x):\n    return hash(None), hash(len) ^ 0, x", "1"), (honest, people)):
        replies = _per_slot(ex, program, inputs)
        ex._backend.workers[0].restart()
        replies += _per_slot(ex, program, inputs)
        assert all(r["ok"] for r in replies), replies
        seen.add((program, frozenset(r["output"] for r in replies)))
    for _, outputs in seen:
        assert len(outputs) == 1, outputs


def test_pids_and_clocks_do_not_tell_the_first_run_from_the_second(ex):
    _need(ex, "pid_namespace")
    # Earlier forks cannot steer a run's pid: every run starts in a fresh pid namespace.
    forker = ("import os\ndef f(n):\n    for _ in range(n):\n        pid = os.fork()\n        if pid == 0:\n"
              "            os._exit(0)\n        os.waitpid(pid, 0)\n    return os.getpid()")
    first = ex.run(forker, "30")
    assert first.ok, first
    assert ex.run(forker, "3").output == first.output
    # The first run's clock offsets are as random as the second's: no run reads "I am the first".
    offsets = "def f(x):\n    return open('/proc/self/timens_offsets').read()"
    if ex.protections.get("time_namespace_second_run"):
        a = ex.run(offsets, "1", check_determinism=False)
        b = ex.run(offsets, "1", check_determinism=False)
        assert a.ok and b.ok and a.output != b.output, (a, b)
        assert ex.run(offsets, "1").error_kind == "nondeterministic"


# --- keyrings: the persistent one, and the keyctl family ------------------------------------------------------------
# A random value kept in the uid's persistent keyring (it outlives every process of the slot): the second run
# finds the first run's value, so a random gold passes.
PERSISTENT = """import ctypes, os
def f(x):
    libc = ctypes.CDLL(None, use_errno=True)
    ring = libc.syscall(250, 22, -1, -2)  # KEYCTL_GET_PERSISTENT(own uid) linked into the process keyring
    if ring < 0:
        raise OSError(ctypes.get_errno(), 'no persistent keyring')
    key = libc.syscall(250, 10, ring, b'user', b'populora-k', 0)  # KEYCTL_SEARCH
    buf = ctypes.create_string_buffer(16)
    if key < 0:
        value = os.urandom(8).hex().encode()
        key = libc.syscall(248, b'user', b'populora-k', value, len(value), ring)  # add_key
    n = libc.syscall(250, 11, key, buf, 16)  # KEYCTL_READ
    return buf.raw[:n].decode()
"""


@pytest.mark.skipif(not X86, reason="syscall numbers of x86_64 in the program")
def test_the_persistent_keyring_carries_nothing_between_runs(ex):
    for _ in range(2):
        res = ex.run(PERSISTENT, "1")
        assert not res.ok, res


# --- capabilities and the runner in the user-namespace mode --------------------------------------------------------
CAPS = "def f(x):\n    return [l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapPrm'))]"
SETHOST = ("import ctypes\ndef f(x):\n    libc = ctypes.CDLL(None)\n    return libc.sethostname(b'forged', 6), "
           "open('/proc/sys/kernel/hostname').read().strip()")


@pytest.fixture(scope="module")
def user_mode():
    plan = SandboxPlan(("unshare", "--user", "--map-root-user", *_NS_FLAGS), "user", False)
    settings = {"banned": [], "nproc": 16, "fsize_mb": 16, "tmp_mb": 64, "memory_mb": MEMORY_MB}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("populora_verl.executor.local.detect_sandbox", lambda isolation="auto": plan)
        try:
            backend = LocalBackend(num_workers=1, settings=settings, memory_cgroup=False)
        except RuntimeError as e:
            pytest.skip(f"unprivileged user namespaces not available: {e}")
    yield backend
    backend.close()


def _call(backend: LocalBackend, program: str) -> dict:
    req = {"program": program, "inputs": "1", "timeout_s": TIMEOUT, "memory_mb": MEMORY_MB,
           "max_output_chars": 10_000, "plain_data": True, "check_determinism": False}
    return backend.run_batch([req])[0]


def test_in_the_user_namespace_mode_programs_hold_no_capability(user_mode):
    res = _call(user_mode, CAPS)
    assert res["ok"] and res["output"] == "['0000000000000000', '0000000000000000']", res
    forged = _call(user_mode, SETHOST)
    assert forged["ok"] and forged["output"].startswith("(-1, 'sandbox')"), forged
    assert _call(user_mode, SETHOST)["output"] == "(-1, 'sandbox')"


# --- without namespaces: the host's /tmp, leftover folders ---------------------------------------------------------
SHARED_TMP = """import os
def f(x):
    path = '/tmp/populora-shared-gold'
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        value = os.urandom(8).hex()
        with open(path, 'w') as fh:
            fh.write(value)
        return value
"""


def _work_dirs() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("populora_exec_")}


@pytest.mark.skipif(not ROOT, reason="without namespaces only a root executor has a uid of its own to clean up")
def test_without_namespaces_the_hosts_tmp_is_no_channel_between_runs():
    with Executor(timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_workers=1, isolation="rlimits") as plain:
        res = plain.run(SHARED_TMP, "1")
        assert not res.ok and res.error_kind == "nondeterministic", res
    assert not os.path.exists("/tmp/populora-shared-gold")


def test_without_namespaces_no_work_folder_outlives_the_executor():
    before = _work_dirs()
    with Executor(timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_workers=1, isolation="rlimits") as plain:
        assert plain.run("def f(x):\n    return x", "1").ok
        plain._backend.workers[0].restart()
        assert plain.run("def f(x):\n    return x", "1").ok
    assert _work_dirs() - before == set()
